"""A call's argument agreement: every rank's arguments exchanged before its data lands.

One exchange, a Bruck all-gather of a block per rank (ceil(lg p) rounds), serves three
uses:

- **the "deep" check** (``CommConfig(check="deep")``, and NCCL's grouped steps): each
  block is the call's signature (9 int64: collective, algorithm, elements, dtype, op,
  root, hierarchy, segment sizes), exchanged before any message of the call;
- **rooted calls under the in-band check** (broadcast, reduce, gather, scatter): the
  root only sends (broadcast, scatter) or only receives (reduce, gather), so ranks that
  each take themselves for the root would exchange no in-band header at all. The same
  exchange runs first, its messages carrying the in-band header (a rank at another
  call is named as the in-band check names it), the root left out of that header
  comparison so that every rank ends with every rank's root and names them all;
- **small broadcasts, scatters and gathers carry their payload in it**: each block is
  [signature | the rank's part of the payload], and the call ends with the exchange:
  ceil(lg p) rounds in all (a binomial-tree broadcast takes ceil(lg p) too), where an
  exchange followed by the payload took twice as many. A block holds the root's whole
  buffer (broadcast, scatter) or the rank's own chunk (gather): (p - 1) * (72 + B)
  bytes reach each rank, B the block's payload, bounded by ``CARRIED_BYTES``.

Ranks that disagree all raise the same MismatchError, naming each rank's value, and
no tensor is written: the group stays usable.
"""

from __future__ import annotations

import zlib

import torch

from plait.comm.algorithms import build_schedule
from plait.comm.errors import MismatchError
from plait.comm.inband import INLINE_BYTES, CallSignature, InbandCall
from plait.comm.ops import COMBINE
from plait.names.wire import OP_CODES, dtype_code

FIELDS = ("collective", "algorithm", "elements", "dtype", "op", "root", "hierarchy or schedule",
          "segment_bytes", "pipeline_segment_bytes")
SIGNATURE_BYTES = 8 * len(FIELDS)
# payload bytes a block may carry: the whole exchange (p blocks) stays one packed in-band
# message per round (INLINE_BYTES), and a block stays small beside the signature's 72 bytes
CARRIED_BYTES = 8 << 10
CARRIERS = ("broadcast", "scatter", "gather")
# the root a rank sends when it refused its own arguments before the call (a root's
# gather_list or scatter_list of the wrong length): its peers, already in the call, learn
# it from the exchange and raise too, instead of waiting for a call that never comes
REFUSED_ROOT = -2


def code(text: str) -> int:
    """A name or a description as a non-negative int64 (crc32)."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _codes(signature: CallSignature) -> list[int]:
    return [code(signature.collective), code(signature.algorithm), signature.elements,
            dtype_code(signature.dtype, signature.collective), OP_CODES[signature.op],
            -1 if signature.root is None else signature.root, signature.hierarchy, signature.segment_bytes,
            signature.pipeline_segment_bytes]


def carried_payload_bytes(collective: str, tensor_nbytes: int, p: int) -> int | None:
    """The payload bytes a block of ``collective``'s exchange carries when the call's
    tensor has ``tensor_nbytes`` (the same on every rank that agrees), or None when the
    call does not carry its payload in the exchange."""
    if collective not in CARRIERS:
        return None
    block = p * tensor_nbytes if collective == "scatter" else tensor_nbytes  # a scatter's root holds p chunks
    if block > CARRIED_BYTES or p * (SIGNATURE_BYTES + _padded(block)) > INLINE_BYTES:
        return None
    return block


def _padded(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def exchange(communicator, signature: CallSignature, device, *, seq: int | None = None,
             carried: int | None = None, buffer: torch.Tensor | None = None, root: int | None = None
             ) -> tuple[int, int]:
    """Exchange ``signature`` with every rank of ``communicator``'s group; raises
    MismatchError on every rank if the signatures differ. ``seq``: the call's number on
    the group, to carry the in-band header (rooted calls); None: plain messages (the
    deep check). ``carried``: the payload bytes of each block (carried_payload_bytes),
    taken from ``buffer`` (the call's flat buffer; None on a rank that refused its own
    arguments: its block carries zeros); the call is then complete when this returns,
    ``buffer`` holding what the collective's schedule would have left in it. Returns
    (bytes sent, messages), as the executor counts them."""
    p, rank, config = communicator.size, communicator.rank, communicator.config
    carried = carried or 0
    block = SIGNATURE_BYTES + _padded(carried)
    table = torch.zeros(p * block, dtype=torch.uint8, device=device)
    mine = table[rank * block : (rank + 1) * block]
    mine[:SIGNATURE_BYTES].copy_(torch.tensor(_codes(signature), dtype=torch.int64).view(torch.uint8))
    if carried and buffer is not None:
        raw = buffer.reshape(-1).view(torch.uint8)
        if signature.collective == "gather":
            mine[SIGNATURE_BYTES : SIGNATURE_BYTES + carried].copy_(raw[rank * carried : (rank + 1) * carried])
        elif rank == root:
            mine[SIGNATURE_BYTES : SIGNATURE_BYTES + carried].copy_(raw)
    label = f"{signature.collective} argument check"
    transport = communicator.transport
    if seq is not None:
        small = table.numel() <= INLINE_BYTES
        transport = InbandCall(transport, signature, seq, rank, label, communicator.known_calls, small,
                               deferred=("root",), buffers=communicator.executor.inband)
    sent, messages = communicator.executor.run(build_schedule("all_gather", "bruck", p, p * block), rank, transport,
                                               table, COMBINE["sum"], timeout_s=config.timeout_s, label=label,
                                               grouped=device.type != "cpu")
    blocks = table.view(p, block)
    rows = blocks[:, :SIGNATURE_BYTES].contiguous().view(torch.int64).tolist()
    error = _disagreement(signature, rows, rank)
    if error is not None:
        raise error
    if carried and buffer is not None:  # every rank agreed: the payload lands
        raw = buffer.reshape(-1).view(torch.uint8)
        payload = blocks[:, SIGNATURE_BYTES : SIGNATURE_BYTES + carried]
        if signature.collective == "gather":
            raw.copy_(payload.reshape(-1))
        else:
            raw.copy_(payload[root])
    return sent, messages


def _disagreement(signature: CallSignature, rows: list[list[int]], rank: int) -> MismatchError | None:
    bad = [i for i in range(len(FIELDS)) if len({row[i] for row in rows}) > 1]
    if not bad:
        return None
    root = FIELDS.index("root")
    refused = [r for r, row in enumerate(rows) if row[root] == REFUSED_ROOT]
    if refused:
        return MismatchError(
            f"{signature.collective}: rank{'s' if len(refused) > 1 else ''} {', '.join(map(str, refused))} refused "
            f"{'their' if len(refused) > 1 else 'its'} own arguments to this call (that rank's error names them, "
            f"e.g. the root's gather_list or scatter_list); nothing was sent (this rank {rank}: "
            f"{signature.describe()})", before_any_message=True)
    parts = []
    for i in bad:
        if FIELDS[i] in ("elements", "root", "segment_bytes", "pipeline_segment_bytes"):
            parts.append(f"{FIELDS[i]}: " + ", ".join(f"rank {r}={row[i]}" for r, row in enumerate(rows)))
        else:
            groups: dict[int, list[int]] = {}
            for r, row in enumerate(rows):
                groups.setdefault(row[i], []).append(r)
            parts.append(f"{FIELDS[i]} differs between ranks {list(groups.values())}")
    return MismatchError(
        f"{signature.collective}: ranks disagree ({'; '.join(parts)}); every rank must call the same collective "
        f"with the same algorithm, op, root, tensor size and dtype, and the same CommConfig segment sizes "
        f"(this rank {rank}: {signature.describe()})", before_any_message=True)


__all__ = ["CARRIED_BYTES", "CARRIERS", "FIELDS", "REFUSED_ROOT", "carried_payload_bytes", "code",
           "exchange"]
