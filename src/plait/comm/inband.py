"""In-band argument checks: a collective's messages carry a header that the receiver
checks against its own call, so ranks that disagree are named without an extra
collective.

The header (``HEADER_FIELDS``, int64 each) holds the call's sequence number on the
group, the collective, algorithm, element count, dtype, op, root, hierarchy and the
segment sizes that shape the messages. Two forms, chosen by the call's size:

- **small calls** (a buffer of at most ``INLINE_BYTES``, every latency-bound call):
  every message travels as ``[header | payload]`` in one message (a copy of a small
  payload, no extra message: the 1 KB latency stays), its receive posted
  ``HEADER_BYTES + INLINE_BYTES`` long, which holds any such message (gloo accepts a
  shorter message into a longer receive but aborts the process on a longer one). The
  first message to each peer goes on ``HEADER_TAG``, the others on their schedule tag
  + ``PACKED_TAG_OFFSET``: every message is checked, and none can overflow.
- **larger calls**: the first message to each peer is preceded by the header alone on
  ``HEADER_TAG`` (one small message per peer per call); payloads travel as they are,
  their receives posted at once (posting them only after the check would let two
  ranks wait on each other's sends). A mismatch is named when the header is read; a
  peer whose mismatched payload is longer than the receive can still stop the process
  with gloo's own "collective mismatch" error first: ``CommConfig(check="deep")``
  names every mismatch before any message.

Both forms meet on ``HEADER_TAG``, so a small call on one rank and a large one on
another are named too. A mismatch raises :class:`MismatchError` on the receiver,
naming both ranks and both calls (and "issued in different orders" when the peer's
call is one this rank made or queued under another number); the receiver then sends
its own header back, so the peer, waiting for it, names the mismatch too. Calls that
only receive from each other first (a star all-reduce's root against a broadcast's
leaf) exchange no header and time out naming the peer and the call.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from plait.comm.algorithms import ALGORITHMS, COLLECTIVES, TORCH
from plait.comm import tags
from plait.comm.errors import MismatchError
from plait.names.wire import OP_CODES, describe_dtype_code, describe_op_code, dtype_code, dtype_name

HEADER_TAG = tags.COLLECTIVE_HEADER
PACKED_TAG_OFFSET = tags.COLLECTIVE_PACKED.start - tags.COLLECTIVE.start
MAGIC = 0x504C_4149  # "PLAI"
HEADER_FIELDS = ("magic", "seq", "collective", "algorithm", "elements", "dtype", "op", "root",
                 "hierarchy or schedule", "segment_bytes", "pipeline_segment_bytes", "payload_bytes")
HEADER_BYTES = 8 * len(HEADER_FIELDS)
INLINE_BYTES = 64 << 10

_ALGORITHMS = sorted({name for name in ALGORITHMS} | {TORCH})
_COLLECTIVES = list(COLLECTIVES)


def _index(items, value) -> int:
    try:
        return items.index(value)
    except ValueError:
        return len(items) + (zlib.crc32(str(value).encode()) & 0xFFFF)  # the same in every process


def _name(items, code: int) -> str:
    return str(items[code]) if 0 <= code < len(items) else f"code {code}"


@dataclass(frozen=True)
class CallSignature:
    """What every rank's part of one collective call must agree on."""

    collective: str
    algorithm: str
    elements: int  # -1: not compared (uneven all-to-all)
    dtype: torch.dtype
    op: str
    root: int | None
    hierarchy: int  # crc of the hierarchy spec, or of a topology algorithm's cluster and schedule; 0 for none
    segment_bytes: int
    pipeline_segment_bytes: int

    def codes(self, seq: int) -> list[int]:
        return [MAGIC, seq, _index(_COLLECTIVES, self.collective), _index(_ALGORITHMS, self.algorithm),
                self.elements, dtype_code(self.dtype, self.collective), OP_CODES[self.op],
                -1 if self.root is None else self.root, self.hierarchy, self.segment_bytes,
                self.pipeline_segment_bytes]

    def describe(self) -> str:
        parts = [f"algorithm={self.algorithm}", f"{self.elements} elements of {dtype_name(self.dtype)}"]
        if self.op != "none":
            parts.append(f"op={self.op}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        return f"{self.collective}({', '.join(parts)})"


def describe_codes(codes: list[int]) -> str:
    """A received header as the call it describes."""
    fields = dict(zip(HEADER_FIELDS, codes))
    parts = [f"algorithm={_name(_ALGORITHMS, fields['algorithm'])}",
             f"{fields['elements']} elements of {describe_dtype_code(fields['dtype'])}"]
    if fields["op"] != 0:
        parts.append(f"op={describe_op_code(fields['op'])}")
    if fields["root"] >= 0:
        parts.append(f"root={fields['root']}")
    return f"{_name(_COLLECTIVES, fields['collective'])}({', '.join(parts)})"


class InbandBuffers:
    """The host buffers of small in-band calls, kept between the calls of one
    communicator (its executor owns one): a packed ``[header | payload]`` send buffer
    and a ``HEADER_BYTES + INLINE_BYTES`` staging receive per message of a call, each
    with a NumPy view of its header (writing or reading 12 int64 through it costs
    ~1 us, where ``torch.tensor(list)`` and ``torch.empty`` cost several each), and the
    header codes of recent signatures. A call takes its buffers in order from index 0
    (:meth:`begin`); the executor's run waits for every send and receive of a call
    before it returns, and drops these buffers (:meth:`clear`) when a call fails, as a
    failed call's receives may still land."""

    _MAX_SIGNATURES = 64

    def __init__(self):
        self._sends: list[tuple[torch.Tensor, np.ndarray]] = []
        self._recvs: list[tuple[torch.Tensor, np.ndarray]] = []
        self._codes: dict[CallSignature, list[int]] = {}
        self.send_index = 0
        self.recv_index = 0

    def begin(self) -> None:
        self.send_index = self.recv_index = 0

    def codes(self, signature: CallSignature) -> list[int]:
        """``signature.codes(0)`` (seq left 0), computed once per signature."""
        codes = self._codes.get(signature)
        if codes is None:
            if len(self._codes) >= self._MAX_SIGNATURES:
                self._codes.clear()
            codes = self._codes[signature] = signature.codes(0)
        return codes

    @staticmethod
    def _new(nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        return tensor, tensor[:HEADER_BYTES].numpy().view(np.int64)

    def send_buffer(self) -> tuple[torch.Tensor, np.ndarray]:
        """The next packed send buffer (``HEADER_BYTES + INLINE_BYTES``) and its header view."""
        if self.send_index == len(self._sends):
            self._sends.append(self._new(HEADER_BYTES + INLINE_BYTES))
        self.send_index += 1
        return self._sends[self.send_index - 1]

    def recv_buffer(self) -> tuple[torch.Tensor, np.ndarray]:
        """The next staging receive and its header view."""
        if self.recv_index == len(self._recvs):
            self._recvs.append(self._new(HEADER_BYTES + INLINE_BYTES))
        self.recv_index += 1
        return self._recvs[self.recv_index - 1]

    def clear(self) -> None:
        self._sends.clear()
        self._recvs.clear()
        self._codes.clear()
        self.begin()


class InbandCall:
    """One call's messages with headers, over a :class:`~plait.comm.transport.Transport`
    (same ``send``/``recv``/``describe`` interface, so the executors do not know).
    ``small``: every message of the call fits ``INLINE_BYTES`` (the packed form).
    ``history``: seq -> CallSignature of this rank's recent and queued calls, or a
    function returning it (asked only when a mismatch is named). ``buffers``: an
    :class:`InbandBuffers` to take the packed messages' buffers from (None: fresh ones)."""

    def __init__(self, transport, signature: CallSignature, seq: int, rank: int, label: str, history, small: bool,
                 deferred: tuple[str, ...] = (), buffers: InbandBuffers | None = None):
        self.transport = transport
        self.signature = signature
        self.seq = seq
        self.rank = rank
        self.label = label
        self.history = history
        self.small = small
        if buffers is None:
            buffers = InbandBuffers()
        buffers.begin()
        self._buffers = buffers
        self._codes = list(buffers.codes(signature))
        self._codes[1] = seq
        # fields not compared here: the call's own exchange compares them across every rank
        # (a rooted call's argument agreement names each rank's root; plait.comm.collectives)
        self._compared = [i for i, name in enumerate(HEADER_FIELDS[: len(self._codes)]) if name not in deferred]
        self._whole = not deferred  # every field compared: one list comparison
        self._sent_to: set[int] = set()
        self._received_from: set[int] = set()
        # receives whose message carries a header, by id of their work: (work, target, peer,
        # staging buffer, its header view, the raw payload's own receive or None when packed)
        self._checked: dict[int, tuple] = {}

    def describe(self, peer) -> str:
        return self.transport.describe(peer)

    def _header(self, payload_bytes: int) -> torch.Tensor:
        return torch.tensor(self._codes + [payload_bytes], dtype=torch.int64)

    def send(self, tensor: torch.Tensor, peer: int, tag: int):
        first = peer not in self._sent_to
        self._sent_to.add(peer)
        nbytes = tensor.numel() * tensor.element_size()
        if self.small:
            buffer, header = self._buffers.send_buffer()
            header[:-1] = self._codes
            header[-1] = nbytes
            packed = buffer[: HEADER_BYTES + nbytes]
            packed[HEADER_BYTES:].copy_(tensor.reshape(-1).view(torch.uint8))
            return _Sent([self.transport.send(packed, peer, HEADER_TAG if first else tag + PACKED_TAG_OFFSET)], packed)
        if not first:
            return self.transport.send(tensor, peer, tag)
        header = self._header(-1)
        return _Sent([self.transport.send(header, peer, HEADER_TAG), self.transport.send(tensor, peer, tag)], header)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int):
        first = peer not in self._received_from
        self._received_from.add(peer)
        if self.small:
            return self._recv_checked(tensor, peer, HEADER_TAG if first else tag + PACKED_TAG_OFFSET, None)
        if not first:
            return self.transport.recv(tensor, peer, tag)
        return self._recv_checked(tensor, peer, HEADER_TAG, self.transport.recv(tensor, peer, tag))

    def recv_reduce(self, tensor: torch.Tensor, peer: int, tag: int, combine):
        """A receive reduced into ``tensor`` as it arrives (the transport's
        ``recv_reduce``), or None where this message carries a header (the packed form,
        or the first message from ``peer``) or the transport cannot reduce from it: the
        caller then receives through :meth:`recv` into scratch, so every header is checked."""
        reduce = getattr(self.transport, "recv_reduce", None)
        if self.small or peer not in self._received_from or reduce is None:
            return None
        return reduce(tensor, peer, tag, combine)

    def _recv_checked(self, target: torch.Tensor, peer: int, tag: int, payload):
        """A receive whose message carries a header, into a staging buffer long enough
        for any header message; :meth:`landed` checks it and lands the payload."""
        staging, header = self._buffers.recv_buffer()
        work = self.transport.recv(staging, peer, tag)
        self._checked[id(work)] = (work, target, peer, staging, header, payload)
        return work

    def landed(self, work, deadline_s: float) -> None:
        """Once ``work`` (a receive this call posted) has completed: if its message
        carried a header, check it against this call (MismatchError naming both calls),
        then land the payload: packed in the same message, or its own receive, waited
        for until ``deadline_s`` (time.monotonic()). Other receives: nothing to do."""
        entry = self._checked.pop(id(work), None)
        if entry is None:
            return
        _, target, peer, staging, header, payload = entry
        codes = header.tolist()
        self._verify(peer, codes)
        payload_bytes = codes[-1]
        if payload_bytes >= 0:
            target.reshape(-1).view(torch.uint8).copy_(staging[HEADER_BYTES : HEADER_BYTES + payload_bytes])
        else:
            payload.wait(timedelta(seconds=max(deadline_s - time.monotonic(), 0.001)))

    def _verify(self, peer: int, codes: list[int]) -> None:
        if codes[:-1] == self._codes if self._whole else all(codes[i] == self._codes[i] for i in self._compared):
            return
        if peer not in self._sent_to:  # let the peer, maybe waiting for our header, name it too
            self._sent_to.add(peer)
            self.transport.send_detached(self._header(-1), peer, HEADER_TAG)
        raise self._mismatch(peer, codes)

    def _mismatch(self, peer: int, codes: list[int]) -> MismatchError:
        who = self.transport.describe(peer)
        if codes[0] != MAGIC:
            return MismatchError(
                f"{self.label}: rank {self.rank} got a message from rank {who} that is not a plait collective "
                f"header while running its call {self.seq}, {self.signature.describe()}: the ranks' calls on this "
                "group differ (or other traffic uses plait's header tag)")
        theirs, their_seq = describe_codes(codes), codes[1]
        order = ""
        history = self.history() if callable(self.history) else self.history
        for seq, signature in list(history.items()):
            if seq != their_seq and signature.describe() == theirs:
                order = (f"; rank {who}'s call {their_seq} is this rank's call {seq}: the ranks issued their calls "
                         "on this group in different orders")
                break
        if not order and their_seq != self.seq:
            order = (f"; the ranks are at different calls ({self.seq} here, {their_seq} on rank {who}): one of them "
                     "skipped or added a call")
        elif not order and codes[2] != self._codes[2]:
            order = ("; the ranks issued different collectives as the same call: different calls, or the same calls "
                     "issued in different orders on different ranks")
        differing = [name for name, a, b in zip(HEADER_FIELDS[1:-1], self._codes[1:], codes[1:-1]) if a != b]
        return MismatchError(
            f"{self.label}: rank {self.rank} is running call {self.seq} on this group, "
            f"{self.signature.describe()}, but rank {who} sent call {their_seq}, {theirs} "
            f"(they differ in {', '.join(differing)}){order}. Every rank of a group must issue the same "
            "collectives, with the same sizes, dtype, op, root and algorithm, in the same order")


class _Sent:
    """A send of one or two messages (header, payload), and the tensors they read."""

    def __init__(self, works, keep):
        self.works = works
        self._keep = keep

    def wait(self, timeout=None):
        for work in self.works:
            work.wait(timeout) if timeout is not None else work.wait()
        return True


__all__ = ["CallSignature", "HEADER_BYTES", "HEADER_FIELDS", "HEADER_TAG", "INLINE_BYTES", "InbandBuffers",
           "InbandCall", "PACKED_TAG_OFFSET"]
