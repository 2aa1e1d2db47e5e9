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

Every post and wait of a call is bounded by the call's deadline, and a transport
failure becomes a CommError (:func:`comm_error`) that names the rank, collective,
algorithm, step and peer. A receive posted through an in-band transport
(``plait.comm.inband.InbandCall``) is checked by it once it has landed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch

from plait.comm.errors import CommError, CommTimeoutError
from plait.comm.dataflow import DIRECT, REDUCED, STREAM_REDUCE, ScratchPool, chunks, units_for_step
from plait.comm.inband import InbandBuffers, InbandCall
from plait.comm.ops import apply_receives
from plait.comm.schedule import Schedule, Transfer


_SMALL_PLANS = 64  # run_small's cached step lists per executor


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


def comm_error(error: BaseException, *, rank: int, collective: str, algorithm: str, step, peer,
               timeout_s: float) -> CommError:
    """The CommError (CommTimeoutError for a timeout) for a transport failure of one
    call: names the rank, collective, algorithm, step and peer, and the transport's
    own first line."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    kwargs = dict(rank=rank, collective=collective, algorithm=algorithm, step=step, peer=peer)
    if "timed out" in reason.lower() or "timeout" in reason.lower():
        return CommTimeoutError(timeout_s=timeout_s, reason=reason, **kwargs)
    return CommError(reason=reason, **kwargs)


class Executor:
    """Runs schedules for this process; keeps scratch buffers between calls."""

    def __init__(self):
        self._scratch: dict[tuple, torch.Tensor] = {}
        self.pool = ScratchPool()
        self.inband = InbandBuffers()  # small in-band calls' packed messages (plait.comm.inband)
        self._small: dict[tuple, tuple] = {}  # run_small's step lists (_small_steps)

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
        self.inband.clear()
        self._small.clear()

    def run(self, schedule: Schedule, rank: int, transport, buffer: torch.Tensor, combine, *, timeout_s: float,
            label: str | None = None, grouped: bool = False, segment_numel: int = 0) -> tuple[int, int]:
        """Run ``rank``'s part of ``schedule`` on ``buffer`` over ``transport`` (a
        :class:`~plait.comm.transport.Transport`, or an ``InbandCall`` over one), every
        wait within ``timeout_s`` of now; returns (bytes sent, messages). ``label``: the
        collective's name in errors (default: the schedule's). Message-by-message
        transports (gloo, shared memory) run as a dataflow (the rules in
        ``plait.comm.dataflow``); ``grouped`` ones (tensors on an accelerator: NCCL, one
        ``batch_isend_irecv`` per step) step by step."""
        plans = plan_rank(schedule, rank, segment_numel)
        deadline = time.monotonic() + timeout_s
        context = dict(rank=rank, collective=label or schedule.collective, algorithm=schedule.algorithm,
                       timeout_s=timeout_s)
        try:
            if grouped:
                return self._run_grouped(plans, buffer, rank, transport, combine, deadline, context)
            # the dataflow (plait.comm.dataflow's rules), inline rather than a function of its
            # own: every frame between a collective and its first message is paid on every call
            # (bench/frame_depth.py counts them)
            pool: ScratchPool = self.pool
            checked = transport if isinstance(transport, InbandCall) else None
            recv_reduce = getattr(transport, "recv_reduce", None)  # shared memory: reduce from the ring
            max_scratch_numel = 2 * buffer.numel() + 1
            posted: deque = deque()  # units of receives not yet landed, in posting order
            sends: list = []  # (lo, hi, work, peer, step): sends not yet known complete
            scratch_in_use = 0
            sent_numel = 0
            messages = 0

            def wait(work, step, peer):
                try:
                    work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                    if checked is not None:  # a receive that carried a header: checked, its payload landed
                        checked.landed(work, deadline)
                except RuntimeError as error:
                    raise comm_error(error, step=step, peer=transport.describe(peer), **context) from error

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
                for (transfer, msgs), in_flight in zip(unit.parts, chunks(unit.works, unit.parts)):
                    for (peer, _, _, _), work in zip(msgs, in_flight):
                        wait(work, unit.step, peer)
                if unit.kind == DIRECT or unit.kind == REDUCED:  # landed in the buffer as it arrived
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
                for unit in units_for_step(plan):
                    if unit.kind == STREAM_REDUCE and recv_reduce is not None:
                        # reduced straight from the ring as it arrives (no scratch, no copy out): the
                        # region is written from the post on, so earlier sends reading it complete and
                        # earlier receives into it land first, as for a direct copy
                        (peer, lo, hi, tag), = unit.parts[0][1]
                        settle(lo, hi)
                        land_overlapping(lo, hi, plan.index)
                        try:
                            work = recv_reduce(buffer[lo:hi], peer, tag, combine)
                        except RuntimeError as error:
                            raise comm_error(error, step=plan.index, peer=transport.describe(peer), **context) from error
                        if work is not None:  # None: a message with a header, or over gloo: through scratch
                            unit.kind = REDUCED
                            unit.works.append(work)
                            posted.append(unit)
                            continue
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
                            try:
                                unit.works.append(transport.recv(target[lo - offset : hi - offset], peer, tag))
                            except RuntimeError as error:
                                raise comm_error(error, step=plan.index, peer=transport.describe(peer),
                                                 **context) from error
                    posted.append(unit)
                for peer, lo, hi, tag in plan.sends:
                    land_overlapping(lo, hi, plan.index)
                    try:
                        work = transport.send(buffer[lo:hi], peer, tag)
                    except RuntimeError as error:
                        raise comm_error(error, step=plan.index, peer=transport.describe(peer), **context) from error
                    sends.append((lo, hi, work, peer, plan.index))
                    sent_numel += hi - lo
                    messages += 1
            while posted:
                land_first()
            settle(0, buffer.numel())
            return sent_numel * buffer.element_size(), messages
        except BaseException:
            # receives of the failed step may still land later, so the scratch buffers
            # are dropped rather than reused
            self.release()
            raise

    def run_small(self, schedule: Schedule, rank: int, transport, buffer: torch.Tensor, combine, *,
                  timeout_s: float, label: str | None = None, segment_numel: int = 0) -> tuple[int, int]:
        """``run``'s result for a small call (a latency-bound one: its messages are a few
        KiB, nothing to stream) over a message-by-message transport, with the least
        Python per call: the lock-step order of the grouped path (every receive of a step
        posted, then its sends, all waited for, then ``apply_receives`` lands them: the
        same bits, as both paths give the virtual executor's), from a per-rank step list
        built once per (schedule, rank, dtype) with its scratch views. Steps of a small
        call depend on each other anyway (a star's, a doubling's), so streaming within a
        call buys nothing here; ``run`` streams the large calls."""
        steps = self._small_steps(schedule, rank, segment_numel, buffer)
        deadline = time.monotonic() + timeout_s
        checked = transport if isinstance(transport, InbandCall) else None
        sent_numel = messages = 0
        index = peer = None
        try:
            for index, recv_posts, send_posts, landed, step_numel in steps:
                recvs = [(transport.recv(buffer[lo:hi] if target is None else target, peer, tag), peer)
                         for target, lo, hi, peer, tag in recv_posts]
                sends = [(transport.send(buffer[lo:hi], peer, tag), peer) for peer, lo, hi, tag in send_posts]
                for work, peer in recvs:
                    work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                    if checked is not None:  # a receive that carried a header: checked, its payload landed
                        checked.landed(work, deadline)
                for work, peer in sends:
                    work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                if landed:
                    apply_receives(buffer, rank, landed, combine)
                sent_numel += step_numel
                messages += len(send_posts)
            return sent_numel * buffer.element_size(), messages
        except RuntimeError as error:
            self.release()  # receives of the failed step may still land later
            raise comm_error(error, rank=rank, collective=label or schedule.collective, algorithm=schedule.algorithm,
                             step=index, peer=transport.describe(peer), timeout_s=timeout_s) from error
        except BaseException:
            self.release()
            raise

    def _small_steps(self, schedule: Schedule, rank: int, segment_numel: int, buffer: torch.Tensor) -> list:
        """``rank``'s steps of ``schedule`` for :meth:`run_small`: (index, receives as
        (scratch view or None, lo, hi, peer, tag), sends as (peer, lo, hi, tag), what
        ``apply_receives`` lands, elements sent), with scratch of this executor's own
        (not shared with another communicator's thread). Cached per (schedule, rank,
        segments, dtype, device), at most ``_SMALL_PLANS`` of them."""
        key = (id(schedule), rank, segment_numel, buffer.dtype, buffer.device)
        cached = self._small.get(key)
        if cached is not None and cached[0] is schedule:
            return cached[1]
        steps = []
        for plan in plan_rank(schedule, rank, segment_numel):
            scratch = (torch.empty(plan.scratch_numel, dtype=buffer.dtype, device=buffer.device)
                       if plan.scratch_numel else None)
            recv_posts, landed = [], []
            for recv in plan.recvs:
                transfer = recv.transfer
                for lo, hi, tag in recv.messages:
                    target = None
                    if recv.scratch_lo is not None:
                        start = recv.scratch_lo + lo - transfer.dst_offset
                        target = scratch[start : start + hi - lo]
                    recv_posts.append((target, lo, hi, transfer.src, tag))
                landed.append((transfer, None if recv.scratch_lo is None
                               else scratch[recv.scratch_lo : recv.scratch_lo + transfer.numel]))
            steps.append((plan.index, tuple(recv_posts), plan.sends, tuple(landed),
                          sum(hi - lo for _, lo, hi, _ in plan.sends)))
        if len(self._small) >= _SMALL_PLANS:
            self._small.clear()
        self._small[key] = (schedule, steps)
        return steps

    def _run_grouped(self, plans, buffer, rank, transport, combine, deadline, context) -> tuple[int, int]:
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
            try:  # the grouped path posts a step at once
                works = transport.post(recv_posts, send_posts)
                for work in works:  # they complete together: wait for all, then land
                    work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as error:
                raise comm_error(error, step=plan.index, peer=peers, **context) from error
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
