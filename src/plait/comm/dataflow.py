"""The streaming (dataflow) executor for transports whose messages complete one by
one (gloo): steps overlap wherever the data allows.

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
  ``apply_receives``, which combines them in rank order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from plait.comm.ops import apply_receives

DIRECT, STREAM_REDUCE, SCRATCH = "direct", "reduce", "scratch"


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


def _units_for_step(plan) -> list[_Unit]:
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


def run_streaming(executor, plans, buffer, call, combine, max_scratch_numel: int) -> tuple[int, int]:
    """Run ``plans`` (from ``plan_rank``) as a dataflow for ``call`` (plait.comm.executor.Call,
    which posts and waits with the deadline); returns (bytes sent, messages)."""
    rank, transport = call.rank, call.transport
    pool: ScratchPool = executor.pool
    posted: deque[_Unit] = deque()  # receives not yet landed, in posting order
    sends: list = []  # (lo, hi, work, peer, step): sends not yet known complete
    scratch_in_use = 0
    sent_numel = 0
    messages = 0

    def wait(work, step, peer):
        call.wait(work, step, transport.describe(peer))

    def settle(lo, hi):
        """Wait for earlier sends that read [lo, hi)."""
        nonlocal sends
        if sends and any(s[0] < hi and lo < s[1] for s in sends):
            keep = []
            for item in sends:
                if item[0] < hi and lo < item[1]:
                    wait(item[2], item[4], item[3])
                else:
                    keep.append(item)
            sends = keep

    def land_first():
        nonlocal scratch_in_use
        unit = posted.popleft()
        for (transfer, msgs), in_flight in zip(unit.parts, _chunks(unit.works, unit.parts)):
            for (peer, _, _, _), work in zip(msgs, in_flight):
                wait(work, unit.step, peer)
        if unit.kind == DIRECT:
            return
        settle(unit.lo, unit.hi)
        if unit.kind == STREAM_REDUCE:
            combine(buffer[unit.lo : unit.hi], unit.payloads[0])
        else:
            apply_receives(buffer, rank, [(t, payload) for (t, _), payload in zip(unit.parts, unit.payloads)],
                           combine)
        for payload in unit.payloads:
            scratch_in_use -= payload.numel()
            pool.give(payload)

    def land_overlapping(lo, hi, step):
        """Land every posted receive up to the last one of an earlier step that writes
        [lo, hi). (The step's own receives land after its sends: a step's sends read
        the buffer as it was when the step began.)"""
        last = -1
        for index, unit in enumerate(posted):
            if unit.step >= step:
                break
            if unit.lo < hi and lo < unit.hi:
                last = index
        for _ in range(last + 1):
            land_first()

    for plan in plans:
        for unit in _units_for_step(plan):
            if unit.kind == DIRECT:
                settle(unit.lo, unit.hi)
                land_overlapping(unit.lo, unit.hi, plan.index)
            else:
                need = unit.hi - unit.lo if unit.kind == STREAM_REDUCE else sum(t.numel for t, _ in unit.parts)
                while posted and scratch_in_use + need > max_scratch_numel:
                    land_first()
                scratch_in_use += need
            for transfer, msgs in unit.parts:
                if unit.kind == DIRECT:
                    target, offset = buffer, 0
                elif unit.kind == STREAM_REDUCE:  # one segment
                    target, offset = pool.take(unit.hi - unit.lo, buffer), unit.lo
                    unit.payloads.append(target)
                else:  # the whole transfer
                    target, offset = pool.take(transfer.numel, buffer), transfer.dst_offset
                    unit.payloads.append(target)
                for peer, lo, hi, tag in msgs:
                    unit.works.append(call.recv(target[lo - offset : hi - offset], peer, tag, plan.index))
            posted.append(unit)
        for peer, lo, hi, tag in plan.sends:
            land_overlapping(lo, hi, plan.index)
            work = call.send(buffer[lo:hi], peer, tag, plan.index)
            sends.append((lo, hi, work, peer, plan.index))
            sent_numel += hi - lo
            messages += 1
    while posted:
        land_first()
    settle(0, buffer.numel())
    return sent_numel * buffer.element_size(), messages


def _chunks(works, parts):
    """Split a unit's flat list of works back per transfer."""
    position = 0
    for _, msgs in parts:
        yield works[position : position + len(msgs)]
        position += len(msgs)


__all__ = ["ScratchPool", "run_streaming"]
