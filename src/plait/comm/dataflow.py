"""The streaming (dataflow) executor's units and rules, for transports whose messages
complete one by one (gloo, shared memory): steps overlap wherever the data allows.
The loop that applies them is ``plait.comm.executor.Executor.run``'s streaming path.

A schedule's steps are a partial order in disguise: a message of step s+1 that
reads region R only needs the receives of earlier steps that write R, not the whole
of step s. So instead of marching the ranks in lock step, this executor posts each
step's receives at once and each send as soon as the region it reads has landed.
With messages split into segments, a ring then streams like gloo's own: segment j
of step s+1 leaves as soon as segment j of step s has arrived and been reduced,
while segment j+1 is still on the wire.

Rules that keep results bit-identical to the virtual executor:
- receives land (are waited for and applied) in the order they were posted, so
  reductions into one region happen in step order;
- before a send of region R is posted, every earlier receive overlapping R lands
  (read after write);
- before a receive writes region R (straight into the buffer when posted, or when
  it lands from scratch), every earlier send reading R completes (write after read)
  and every earlier receive into R lands (write after write);
- reductions landing together on one region in one step (direct, star) go through
  ``apply_receives``, which combines them in rank order;
- a streamed reduction the transport can combine straight from its ring (shared
  memory's ``recv_reduce``: no copy out, no scratch) writes its region from the moment
  it is posted, so it is posted like a direct copy: after every earlier send reading
  the region completes and every earlier receive into it lands. Its bits are those of
  combining a copied-out payload (same operands, same order, element by element).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DIRECT, STREAM_REDUCE, SCRATCH = "direct", "reduce", "scratch"
# a STREAM_REDUCE segment the transport combines into the buffer straight from its ring as
# the bytes arrive (shared memory's recv_reduce): posted like a direct copy (after earlier
# sends reading its region complete and earlier receives into it land), landed by its wait
REDUCED = "reduced"


@dataclass
class _Unit:
    """Receives that land together: one segment (direct copy, streamed reduction) or
    whole transfers through scratch (copies that overlap the step's own sends, and
    reductions that must be combined together or after the step's sends)."""

    kind: str
    step: int
    lo: int
    hi: int
    parts: list  # (transfer, [(peer, lo, hi, tag), ...])
    works: list = field(default_factory=list)
    payloads: list = field(default_factory=list)  # scratch tensors, one per transfer


def units_for_step(plan) -> list[_Unit]:
    units: list[_Unit] = []
    groups: dict[tuple[int, int], _Unit] = {}
    for recv in plan.recvs:
        t = recv.transfer
        if recv.scratch_lo is None or recv.stream:
            kind = DIRECT if recv.scratch_lo is None else STREAM_REDUCE
            for lo, hi, tag in recv.messages:
                units.append(_Unit(kind, plan.index, lo, hi, [(t, [(t.src, lo, hi, tag)])]))
            continue
        messages = [(t.src, lo, hi, tag) for lo, hi, tag in recv.messages]
        if t.reduce and t.dst_range in groups:
            groups[t.dst_range].parts.append((t, messages))
            continue
        unit = _Unit(SCRATCH, plan.index, t.dst_offset, t.dst_offset + t.numel, [(t, messages)])
        if t.reduce:
            groups[t.dst_range] = unit
        units.append(unit)
    return units


class ScratchPool:
    """Reusable receive buffers, by (numel, dtype, device); keeps at most
    ``max_bytes`` between calls (the sizes of the last collectives stay warm)."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._held_bytes = 0

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        free = self._free.get((numel, like.dtype, str(like.device)))
        if free:
            tensor = free.pop()
            self._held_bytes -= tensor.numel() * tensor.element_size()
            return tensor
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def give(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        while self._free and self._held_bytes + nbytes > self.max_bytes:
            oldest = next(iter(self._free))  # evict the least recently added size
            dropped = self._free.pop(oldest)
            self._held_bytes -= sum(t.numel() * t.element_size() for t in dropped)
        if nbytes <= self.max_bytes:
            key = (tensor.numel(), tensor.dtype, str(tensor.device))
            self._free[key] = self._free.pop(key, []) + [tensor]
            self._held_bytes += nbytes

    def clear(self) -> None:
        self._free.clear()
        self._held_bytes = 0


def chunks(works, parts):
    """Split a unit's flat list of works back per transfer."""
    position = 0
    for _, msgs in parts:
        yield works[position : position + len(msgs)]
        position += len(msgs)


__all__ = ["DIRECT", "REDUCED", "SCRATCH", "STREAM_REDUCE", "ScratchPool", "chunks", "units_for_step"]
