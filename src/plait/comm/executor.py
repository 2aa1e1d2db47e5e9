"""The torch executor: runs one rank's part of a schedule over torch.distributed
point-to-point messages.

``plan_rank`` turns a rank's part of a schedule into messages: transfers larger
than ``segment_bytes`` are split into segments; copies that overlap nothing the rank
sends in the step land straight in the buffer, the rest go through scratch; a
reduction that is alone on its region and not being sent in the same step is
combined segment by segment as it arrives. Receives land with
``ops.apply_receives`` (the virtual executor's function), so results are
bit-identical to the virtual executor's.

On gloo (CPU tensors) each message is posted with the process group's own
``send``/``recv`` (the least Python per message) and the steps run as a dataflow
(``plait.comm.dataflow``). On accelerators (NCCL) each step is posted as one
``batch_isend_irecv`` group, so a pair that sends and receives in one step cannot
deadlock, and the steps run one after the other. No ``torch.cuda`` here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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
        # tags: the step (mod 2^14) in the high bits, the message's index between this
        # pair in this step in the low 16; sends of a step may still be in flight
        # when the next step's are posted
        base = (index % 16384) << 16
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


class Transport:
    """Posts point-to-point messages on one process group (group-local peer ranks).

    CPU tensors go one message at a time through the group's own ``send``/``recv``
    (gloo; the least Python per message, and each message can be waited for on its
    own). Tensors on an accelerator go through ``batch_isend_irecv``, which NCCL
    runs as one group per step, so a pair that sends and receives in one step
    cannot deadlock; that path is ``grouped``: its works complete together.
    """

    def __init__(self, group, device):
        self.group = group
        self.grouped = torch.device(device).type != "cpu"
        self._global: dict[int, int] = {}

    def global_rank(self, peer: int) -> int:
        if peer not in self._global:
            self._global[peer] = dist.get_global_rank(self.group, peer)
        return self._global[peer]

    def post(self, recvs, sends):
        """Grouped path: recvs/sends are lists of (tensor, peer, tag), posted as one
        ``batch_isend_irecv``; returns its works (they complete together)."""
        ops = [dist.P2POp(dist.irecv, t, self.global_rank(peer), self.group, tag) for t, peer, tag in recvs]
        ops += [dist.P2POp(dist.isend, t, self.global_rank(peer), self.group, tag) for t, peer, tag in sends]
        return dist.batch_isend_irecv(ops)

    def describe(self, peer) -> str:
        """'3', or '3 (global rank 5)' when the group is not the world."""
        if not isinstance(peer, int) or self.group is dist.group.WORLD:
            return str(peer)
        try:
            return f"{peer} (global rank {self.global_rank(peer)})"
        except (RuntimeError, ValueError):
            return str(peer)


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

    def run(
        self,
        schedule: Schedule,
        buffer: torch.Tensor,
        rank: int,
        transport: Transport,
        combine,
        *,
        timeout_s: float,
        segment_numel: int = 0,
        label: str | None = None,
    ) -> tuple[int, int]:
        """Run ``rank``'s part of ``schedule`` on ``buffer``; returns (bytes sent, messages).

        Message-by-message transports (gloo) run as a dataflow (``plait.comm.dataflow``);
        grouped ones (NCCL) step by step."""
        plans = plan_rank(schedule, rank, segment_numel)
        deadline = time.monotonic() + timeout_s
        if not transport.grouped:
            return run_streaming(self, plans, schedule, buffer, rank, transport, combine, deadline, timeout_s,
                                 label, max_scratch_numel=2 * buffer.numel() + 1)
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
                works = transport.post(recv_posts, send_posts)
            except RuntimeError as error:  # the grouped path posts a step at once
                raise self._fail(error, schedule, rank, plan.index, peers, timeout_s, label) from error
            for work in works:  # they complete together: wait for all, then land
                self._wait(work, deadline, schedule, rank, plan.index, peers, timeout_s, label)
            landed = []
            for recv in plan.recvs:
                if recv.scratch_lo is None:
                    landed.append((recv.transfer, None))
                else:
                    landed.append((recv.transfer, scratch[recv.scratch_lo : recv.scratch_lo + recv.transfer.numel]))
            if landed:
                apply_receives(buffer, rank, landed, combine)
            messages += len(send_posts)
            sent_numel += sum(hi - lo for _, lo, hi, _ in plan.sends)
        return sent_numel * buffer.element_size(), messages

    def _post(self, transport, kind, tensor, peer, tag, schedule, rank, step, timeout_s, label):
        """Post one message (message-by-message transports)."""
        try:
            return getattr(transport.group, kind)([tensor], peer, tag)
        except RuntimeError as error:
            raise self._fail(error, schedule, rank, step, transport.describe(peer), timeout_s, label) from error

    def _wait(self, work, deadline, schedule, rank, step, peer, timeout_s, label):
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timedelta(seconds=remaining))
        except RuntimeError as error:
            raise self._fail(error, schedule, rank, step, peer, timeout_s, label) from error

    def _fail(self, error, schedule, rank, step, peer, timeout_s, label):
        """The CommError to raise. Receives of the failed step may still land later,
        so the scratch buffers are dropped rather than reused."""
        self.release()
        return self._error(error, schedule, rank, step, peer, timeout_s, label)

    @staticmethod
    def _error(error, schedule, rank, step, peer, timeout_s, label):
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        collective = label or schedule.collective
        kwargs = dict(rank=rank, collective=collective, algorithm=schedule.algorithm, step=step, peer=peer)
        if "timed out" in reason.lower() or "timeout" in reason.lower():
            return CommTimeoutError(timeout_s=timeout_s, reason=reason, **kwargs)
        return CommError(reason=reason, **kwargs)
