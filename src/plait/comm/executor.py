"""The torch executor: runs one rank's part of a schedule over torch.distributed
point-to-point messages.

``plan_rank`` turns a rank's part of a schedule into messages: transfers larger
than ``segment_bytes`` are split into segments; copies that overlap nothing the rank
sends in the step land straight in the buffer, the rest go through scratch; a
reduction that is alone on its region and not being sent in the same step is
combined segment by segment as it arrives. Receives land with
``ops.apply_receives`` (the virtual executor's function), so results are
bit-identical to the virtual executor's.

One step semantics, two ways to run it. A step's sends read the buffer as it was
when the step began; its receives land after them, in the order the schedule lists
them (reductions into one region in rank order). The lock-step path below (NCCL's
grouped posts) does exactly that, step after step. The streaming path
(``plait.comm.dataflow``, gloo: messages complete one by one) lets a message of a
later step leave as soon as the regions it reads have landed; its ordering rules
make every result bit-identical to the lock-step order (and to the virtual
executor). No ``torch.cuda`` here.

Every wait goes through the :class:`Call` (one collective as it runs on this
rank), which owns the deadline and turns a transport failure into a CommError that
names the rank, collective, algorithm, step and peer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from plait.comm.errors import CommError, CommTimeoutError
from plait.comm.dataflow import ScratchPool, run_streaming
from plait.comm.ops import apply_receives
from plait.comm.schedule import Schedule, Transfer


@dataclass(frozen=True)
class _Recv:
    transfer: Transfer
    messages: tuple[tuple[int, int, int], ...]  # (lo, hi, tag) in the buffer's index space
    scratch_lo: int | None  # None: lands straight in the buffer
    stream: bool  # combine each segment as soon as it arrives


@dataclass(frozen=True)
class _StepPlan:
    index: int
    sends: tuple[tuple[int, int, int, int], ...]  # (peer, lo, hi, tag)
    recvs: tuple[_Recv, ...]
    scratch_numel: int


def _split(lo: int, hi: int, segment_numel: int) -> list[tuple[int, int]]:
    if segment_numel <= 0 or hi - lo <= segment_numel:
        return [(lo, hi)]
    return [(a, min(a + segment_numel, hi)) for a in range(lo, hi, segment_numel)]


def _overlaps(lo: int, hi: int, ranges) -> bool:
    return any(lo < b and a < hi for a, b in ranges)


def plan_rank(schedule: Schedule, rank: int, segment_numel: int) -> list[_StepPlan]:
    """Per-step messages of ``rank`` (cached on the schedule)."""
    key = ("plan", rank, segment_numel)
    cached = schedule._per_rank.get(key)
    if cached is not None:
        return cached
    plans = []
    for index, (sends, recvs) in enumerate(schedule.rank_steps(rank)):
        if not sends and not recvs:
            continue
        # tags: the step (mod 2^13) in the high bits, the message's index between this
        # pair in this step in the low 16; sends of a step may still be in flight
        # when the next step's are posted
        base = (index % 8192) << 16  # tags < 2^29 (plait.comm.tags)
        tags: dict[int, int] = {}
        send_msgs = []
        for t in sends:
            for lo, hi in _split(t.src_offset, t.src_offset + t.numel, segment_numel):
                tag = tags.get(t.dst, 0)
                tags[t.dst] = tag + 1
                send_msgs.append((t.dst, lo, hi, base + tag % 65536))
        send_ranges = [t.src_range for t in sends]
        reduce_ranges: dict[tuple[int, int], int] = {}
        for t in recvs:
            if t.reduce:
                reduce_ranges[t.dst_range] = reduce_ranges.get(t.dst_range, 0) + 1
        tags = {}
        recv_plans = []
        scratch = 0
        for t in recvs:
            messages = []
            for lo, hi in _split(t.dst_offset, t.dst_offset + t.numel, segment_numel):
                tag = tags.get(t.src, 0)
                tags[t.src] = tag + 1
                messages.append((lo, hi, base + tag % 65536))
            direct = not t.reduce and not _overlaps(t.dst_offset, t.dst_offset + t.numel, send_ranges)
            # streaming writes into the buffer while this step's sends may still be
            # reading it, so only where the rank sends nothing from that region
            stream = (
                t.reduce
                and reduce_ranges[t.dst_range] == 1
                and not _overlaps(t.dst_offset, t.dst_offset + t.numel, send_ranges)
            )
            recv_plans.append(_Recv(t, tuple(messages), None if direct else scratch, stream))
            if not direct:
                scratch += t.numel
        plans.append(_StepPlan(index, tuple(send_msgs), tuple(recv_plans), scratch))
    schedule._per_rank[key] = plans
    return plans


@dataclass
class Call:
    """One collective as it runs on this rank: its schedule, the transport its
    messages use (plain, or with in-band headers), its label and its deadline."""

    schedule: Schedule
    rank: int
    transport: object  # plait.comm.transport.Transport or plait.comm.inband.InbandCall
    timeout_s: float
    label: str | None = None
    grouped: bool = False  # one batch_isend_irecv per step (tensors on an accelerator: NCCL)
    deadline: float = field(default=0.0)

    def __post_init__(self):
        self.deadline = time.monotonic() + self.timeout_s

    @property
    def collective(self) -> str:
        return self.label or self.schedule.collective

    def send(self, tensor, peer: int, tag: int, step):
        try:
            return self.transport.send(tensor, peer, tag)
        except RuntimeError as error:
            raise self.error(error, step, self.transport.describe(peer)) from error

    def recv(self, tensor, peer: int, tag: int, step):
        try:
            return self.transport.recv(tensor, peer, tag)
        except RuntimeError as error:
            raise self.error(error, step, self.transport.describe(peer)) from error

    def wait(self, work, step, peer: str) -> None:
        remaining = max(self.deadline - time.monotonic(), 0.001)
        try:
            work.wait(timedelta(seconds=remaining))
        except RuntimeError as error:
            raise self.error(error, step, peer) from error

    def error(self, error, step, peer) -> CommError:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        kwargs = dict(rank=self.rank, collective=self.collective, algorithm=self.schedule.algorithm, step=step,
                      peer=peer)
        if "timed out" in reason.lower() or "timeout" in reason.lower():
            return CommTimeoutError(timeout_s=self.timeout_s, reason=reason, **kwargs)
        return CommError(reason=reason, **kwargs)


class Executor:
    """Runs schedules for this process; keeps scratch buffers between calls."""

    def __init__(self):
        self._scratch: dict[tuple, torch.Tensor] = {}
        self.pool = ScratchPool()

    def scratch(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        key = (dtype, str(device))
        held = self._scratch.get(key)
        if held is None or held.numel() < numel:
            held = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[key] = held
        return held

    def release(self) -> None:
        self._scratch.clear()
        self.pool.clear()

    def run(self, call: Call, buffer: torch.Tensor, combine, *, segment_numel: int = 0) -> tuple[int, int]:
        """Run ``call.rank``'s part of ``call.schedule`` on ``buffer``; returns (bytes
        sent, messages). Message-by-message transports (gloo) run as a dataflow
        (``plait.comm.dataflow``); grouped ones (NCCL) step by step."""
        schedule, rank = call.schedule, call.rank
        plans = plan_rank(schedule, rank, segment_numel)
        try:
            if not call.grouped:
                return run_streaming(self, plans, buffer, call, combine, max_scratch_numel=2 * buffer.numel() + 1)
            return self._run_grouped(plans, buffer, call, combine)
        except BaseException:
            # receives of the failed step may still land later, so the scratch buffers
            # are dropped rather than reused
            self.release()
            raise

    def _run_grouped(self, plans, buffer, call: Call, combine) -> tuple[int, int]:
        sent_numel = 0
        messages = 0
        for plan in plans:
            scratch = self.scratch(plan.scratch_numel, buffer.dtype, buffer.device) if plan.scratch_numel else None
            recv_posts = []
            for recv in plan.recvs:
                for lo, hi, tag in recv.messages:
                    if recv.scratch_lo is None:
                        target = buffer[lo:hi]
                    else:
                        start = recv.scratch_lo + lo - recv.transfer.dst_offset
                        target = scratch[start : start + hi - lo]
                    recv_posts.append((target, recv.transfer.src, tag))
            send_posts = [(buffer[lo:hi], peer, tag) for peer, lo, hi, tag in plan.sends]
            peers = f"one of {sorted({peer for _, peer, _ in recv_posts + send_posts})}"
            try:
                works = call.transport.post(recv_posts, send_posts)
            except RuntimeError as error:  # the grouped path posts a step at once
                raise call.error(error, plan.index, peers) from error
            for work in works:  # they complete together: wait for all, then land
                call.wait(work, plan.index, peers)
            landed = []
            for recv in plan.recvs:
                if recv.scratch_lo is None:
                    landed.append((recv.transfer, None))
                else:
                    landed.append((recv.transfer, scratch[recv.scratch_lo : recv.scratch_lo + recv.transfer.numel]))
            if landed:
                apply_receives(buffer, call.rank, landed, combine)
            messages += len(send_posts)
            sent_numel += sum(hi - lo for _, lo, hi, _ in plan.sends)
        return sent_numel * buffer.element_size(), messages
