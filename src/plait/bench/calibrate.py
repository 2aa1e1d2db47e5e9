"""Calibration microbenchmarks: time plait's own executor, all ranks busy at once.

Ring shift (the model). A hand-built schedule of k steps on a buffer of two halves
A and B of n bytes each: at step s every rank sends one half to rank+1 and
receives the other from rank-1 (A -> B at even steps, B -> A at odd ones), so step
s+1 forwards what step s received, as a ring reduce-scatter or all-gather does.
With ``reduce`` the receiver adds what arrives (streamed per segment, as in the
collectives). It runs through the communication engine and executor exactly as a
plait collective does (same segmenting, same dataflow), and

    t(k, n, r) = c + k * (alpha + beta * n + r * gamma * n)

is fitted to the times by ``plait.cost.calibration`` (c: per-call overhead).

Ping-pong (reference). Rank 0 sends n bytes to rank 1 and gets them back with the
process group's own send/recv, the other ranks idle; half the round trip is the
classic one-message latency/bandwidth, reported but not the model: it misses the
contention of all ranks sharing the cores and links.

Calls (the software cost). One real call of each kind (all_reduce, all_gather,
reduce_scatter, broadcast, a p2p exchange) at sizes below any benchmarked one (64 B
and 256 B), through a communicator configured as users run it, the collectives timed
exactly as plait bench times them (``measure_one``): ``plait.bench.calibrate_calls``.

Timing, per (kind, k, n, reduce) and per call (kind, n): warm-up, one probe call (max over ranks) that
sets how many back-to-back calls fill ``time_budget_s``; then in each of ``reps``
sweeps over all configurations {barrier; those calls}: a rep's time is
elapsed / calls, max over ranks (as ``plait bench``); the sample is the median rep.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from plait.bench.calibrate_calls import CALL_ALGORITHM, CALL_KINDS, call_numel, call_terms, make_call
from plait.bench.collectives import BenchConfig, buffer_plan, measure_one, message_sizes
from plait.comm.communicator import Communicator, init_communicator, process_group
from plait.comm.config import CommConfig
from plait.comm.ops import COMBINE
from plait.comm.schedule import Schedule, Step, Transfer, make_schedule
from plait.comm.transport import stream_segment_bytes
from plait.cost.profile import Sample

ELEMENT_SIZE = 4  # float32, as plait bench's default


@dataclass(frozen=True, kw_only=True)
class CalibrateConfig:
    """One `plait calibrate` run (CLI flags map 1:1 to fields)."""

    min_nbytes: int = 1024
    max_nbytes: int = 64 << 20
    factor: int = 2
    steps: tuple[int, ...] = (1, 2, 4)
    reps: int = 7
    warmup: int = 1
    time_budget_s: float = 0.02
    max_calls_per_rep: int = 30
    ping_pong: bool = True
    timeout_s: float = 120.0
    transport: str = "shm"  # the measured communicator's CommConfig.transport: shm (required) or gloo
    call_sizes_nbytes: tuple[int, ...] = (64, 256)  # the "call" samples' sizes (below plait bench's 1 KB)
    call_kinds: tuple[str, ...] = CALL_KINDS  # () measures no calls (the profile then has no call costs)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(sorted(set(self.steps))))
        object.__setattr__(self, "call_sizes_nbytes", tuple(sorted(set(self.call_sizes_nbytes))))
        object.__setattr__(self, "call_kinds", tuple(self.call_kinds))
        problems = []
        unknown = [kind for kind in self.call_kinds if kind not in CALL_KINDS]
        if unknown:
            problems.append(f"call_kinds {unknown} not in {CALL_KINDS}")
        if any(not isinstance(n, int) or n < 1 for n in self.call_sizes_nbytes):
            problems.append(f"call_sizes_nbytes={self.call_sizes_nbytes} must be ints >= 1")
        if self.transport not in ("shm", "gloo"):
            problems.append(f"transport={self.transport!r} must be 'shm' or 'gloo'")
        if self.min_nbytes < ELEMENT_SIZE or self.max_nbytes < self.min_nbytes:
            problems.append(f"need {ELEMENT_SIZE} <= min_nbytes({self.min_nbytes}) <= max_nbytes({self.max_nbytes})")
        if self.factor < 2:
            problems.append(f"factor({self.factor}) must be >= 2")
        if len(self.steps) < 2 or any(not isinstance(k, int) or k < 1 for k in self.steps):
            problems.append(f"steps={self.steps} must be >= 2 distinct ints >= 1 (to separate the call "
                            "overhead from alpha), e.g. 1,2,4")
        elif len(message_sizes(self.min_nbytes, self.max_nbytes, self.factor)) < 2:
            problems.append(f"min_nbytes({self.min_nbytes})..max_nbytes({self.max_nbytes}) x{self.factor} "
                            "gives one size; need >= 2 to separate alpha from beta")
        if self.reps < 1 or self.warmup < 0 or self.max_calls_per_rep < 1:
            problems.append(f"need reps({self.reps}) >= 1, warmup({self.warmup}) >= 0 and "
                            f"max_calls_per_rep({self.max_calls_per_rep}) >= 1")
        if self.time_budget_s < 0 or self.timeout_s <= 0:
            problems.append(f"need time_budget_s({self.time_budget_s}) >= 0 and timeout_s({self.timeout_s}) > 0")
        if problems:
            raise ValueError("invalid calibrate config: " + "; ".join(problems))

    @property
    def sizes_nbytes(self) -> list[int]:
        """Message sizes, rounded down to whole float32 elements."""
        sizes = message_sizes(self.min_nbytes, self.max_nbytes, self.factor)
        return sorted({n - n % ELEMENT_SIZE for n in sizes})


def shift_schedule(world_size: int, numel: int, steps: int, reduce: bool, regions: int | None = None) -> Schedule:
    """k steps of a ring shift on a buffer of ``regions`` (default p, at least 2)
    regions of numel elements: at step s rank r sends region s % m to r+1 and
    receives region (s+1) % m from r-1 (adding it in with ``reduce``). Per step each
    rank sends and receives numel elements:
    T = c + k (alpha + numel b + [reduce] numel g).

    With m = p regions the dependencies are those of a ring of p: step s+1 forwards
    what step s received, and overwrites a region last sent m - 2 steps before."""
    regions = max(2, world_size if regions is None else regions)
    if world_size < 2 or numel < 1 or steps < 1:
        raise ValueError(f"need world_size({world_size}) >= 2, numel({numel}) >= 1, steps({steps}) >= 1")
    plan = []
    for step in range(steps):
        send_offset, recv_offset = (step % regions) * numel, ((step + 1) % regions) * numel
        plan.append(Step(tuple(Transfer(r, (r + 1) % world_size, send_offset, recv_offset, numel, reduce)
                               for r in range(world_size))))
    return make_schedule("calibrate", "shift", world_size, regions * numel, plan)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels are asynchronous on GPUs
        torch.cuda.synchronize(device)


def _max_over_ranks(values: list[float], device: torch.device, group) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def _timed(call: Callable[[], None], calls: int, device: torch.device) -> float:
    """Seconds per call of ``calls`` back-to-back calls on this rank."""
    _synchronize(device)
    start_s = time.perf_counter()
    for _ in range(calls):
        call()
    _synchronize(device)
    return (time.perf_counter() - start_s) / calls


def calls_per_rep(call: Callable[[], None], config: CalibrateConfig, device: torch.device, group=None) -> int:
    """Warm up, then time one probe call (max over ranks, so every rank agrees):
    as many calls as fit ``time_budget_s``, between 1 and ``max_calls_per_rep``."""
    for _ in range(config.warmup):
        call()
    (probe_s,) = _max_over_ranks([_timed(call, 1, device)], device, group)
    calls = config.max_calls_per_rep if probe_s <= 0 else int(config.time_budget_s / probe_s)
    return max(1, min(config.max_calls_per_rep, calls))


def _shift_call(schedule: Schedule, buffer: torch.Tensor, communicator: Communicator):
    """One call as plait.comm's collectives make it: the schedule on the group's comm
    engine (inline), over its transport, with its segment size (no argument check:
    the raw messages are what is measured)."""
    config = communicator.config
    segment_bytes = stream_segment_bytes(config, communicator.backend)
    segment_numel = segment_bytes // buffer.element_size() if segment_bytes else 0

    def job():
        communicator.executor.run(schedule, communicator.rank, communicator.transport, buffer, COMBINE["sum"],
                                  timeout_s=config.timeout_s, label="calibrate shift",
                                  grouped=buffer.device.type != "cpu", segment_numel=segment_numel)

    return lambda: communicator.engine.submit(job, "calibrate shift", async_op=False)


def _ping_pong_call(buffer: torch.Tensor, rank: int, group):
    """A round trip 0 -> 1 -> 0 with the group's own send/recv; other ranks idle."""
    if rank > 1:
        return lambda: None
    peer = dist.get_global_rank(group, 1 - rank)

    def call():
        if rank == 0:
            dist.send(buffer, peer, group=group)
            dist.recv(buffer, peer, group=group)
        else:
            dist.recv(buffer, peer, group=group)
            dist.send(buffer, peer, group=group)

    return call


def _sample(kind: str, steps: int, nbytes: int, reduce: bool, rep_times_s: list[float]) -> Sample:
    floor_s = 1e-9  # a rep can never be faster than this: keeps Sample's times > 0
    rep_times_s = [max(t, floor_s) for t in rep_times_s]
    return Sample(kind=kind, steps=steps, nbytes=nbytes, reduce=reduce,
                  time_s=statistics.median(rep_times_s), rep_times_s=tuple(rep_times_s))


def _call_time_s(kind: str, numel: int, communicator: Communicator, transport: str, config: CalibrateConfig,
                 device: torch.device, group, calls: dict, key: tuple) -> float:
    """One call sample's time (max over ranks): a collective timed exactly as plait bench
    times it (``measure_one``: its buffers, warm-up, probe, iteration count and barrier)
    on ``communicator`` (the "@transport" group), so calibration and the benchmark it
    predicts measure the same thing; a p2p exchange with the shift's own timing."""
    if kind in CALL_KINDS[:4]:
        algorithm = f"{CALL_ALGORITHM}@{transport}"
        bench = BenchConfig(collective=kind, algorithms=(algorithm,), timeout_s=config.timeout_s)
        count, size_bytes = buffer_plan(kind, numel * ELEMENT_SIZE, communicator.size, ELEMENT_SIZE)
        row = measure_one(bench, algorithm, count, size_bytes, group=group, device=device,
                          communicators={transport: communicator})
        return row.time_us * 1e-6
    call = make_call(kind, numel, communicator, device)
    if key not in calls:
        calls[key] = calls_per_rep(call, config, device, group)
    dist.barrier(group=group)
    return _timed(call, calls[key], device)


def _call_sample(kind: str, numel: int, terms, rep_times_s: list[float]) -> Sample:
    rep_times_s = [max(t, 1e-9) for t in rep_times_s]
    return Sample(kind="call", steps=1, nbytes=numel * ELEMENT_SIZE, reduce=kind in ("all_reduce", "reduce_scatter"),
                  time_s=statistics.median(rep_times_s), rep_times_s=tuple(rep_times_s), collective=kind,
                  algorithm=CALL_ALGORITHM if kind in CALL_KINDS[:4] else "isend/irecv", terms=terms)


def measurement_plan(config: CalibrateConfig) -> list[tuple[str, int, int, bool]]:
    """(kind, steps, nbytes, reduce) in measuring order: size-major, copy and reduce
    of each step count back to back, then the ping-pong."""
    plan = []
    for nbytes in config.sizes_nbytes:
        plan += [("shift", steps, nbytes, reduce) for steps in config.steps for reduce in (False, True)]
        if config.ping_pong:
            plan.append(("ping_pong", 1, nbytes, False))
    return plan


def run_calibration(config: CalibrateConfig, *, group=None, device: torch.device | None = None,
                    emit: Callable[[str, object], None] | None = None) -> list[Sample]:
    """Measure every (size, steps, copy/reduce) ring shift and the ping-pong on all
    ranks of ``group``; returns the samples (identical on every rank).

    The whole plan is swept ``config.reps`` times and each sample is the median of
    its reps: the machine's slow phases (seconds long on a shared, oversubscribed
    machine) then land on different configurations in different sweeps and the
    median drops them. emit(kind, payload): ("progress", text) per sweep, then
    ("row", Sample) per sample."""
    device = device or torch.device("cpu")
    group = process_group(group)  # a Communicator's or a 1-D torch DeviceMesh's process group
    group = group if group is not None else dist.group.WORLD
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size < 2:
        raise ValueError("calibration needs >= 2 ranks (it measures messages between them): use --nprocs 2 or more")
    # shm is required, not auto: a profile must price the transport its name says
    transport = config.transport if "nccl" not in str(dist.get_backend(group)).lower() else "gloo"
    communicator = init_communicator(group, CommConfig(timeout_s=config.timeout_s, check="off", transport=transport))
    emit = emit or (lambda kind, payload: None)
    plan = measurement_plan(config)
    call_plan = [("call", kind, nbytes) for nbytes in config.call_sizes_nbytes for kind in config.call_kinds]
    user_communicator = None
    if call_plan:  # a communicator as users run it (CommConfig's defaults: in-band check) on its own group
        user_group = dist.new_group(dist.get_process_group_ranks(group))
        user_communicator = init_communicator(user_group, CommConfig(timeout_s=config.timeout_s, transport=transport))
    calls: dict[tuple, int] = {}
    schedules: dict[tuple, Schedule] = {}  # kept: the executor caches its plan on them
    times_s: dict[tuple, list[float]] = {key: [] for key in plan + call_plan}
    for sweep in range(config.reps):
        emit("progress", f"sweep {sweep + 1}/{config.reps} over {len(plan)} configurations")
        local_s = []
        for nbytes in config.sizes_nbytes:
            numel = nbytes // ELEMENT_SIZE
            # zeros: repeated sums never overflow or go denormal
            buffer = torch.zeros(max(2, world_size) * numel, dtype=torch.float32, device=device)
            for key in (key for key in plan if key[2] == nbytes):
                kind, steps, _, reduce = key
                if kind == "shift":
                    if key not in schedules:
                        schedules[key] = shift_schedule(world_size, numel, steps, reduce)
                    call = _shift_call(schedules[key], buffer, communicator)
                else:
                    call = _ping_pong_call(buffer[:numel], rank, group)
                if key not in calls:
                    calls[key] = calls_per_rep(call, config, device, group)
                dist.barrier(group=group)
                per_call_s = _timed(call, calls[key], device)
                local_s.append(per_call_s / 2 if kind == "ping_pong" else per_call_s)  # one way
            del buffer
        for key in call_plan:
            _, kind, nbytes = key
            local_s.append(_call_time_s(kind, call_numel(kind, nbytes, world_size), user_communicator, transport,
                                        config, device, group, calls, key))
        for key, time_s in zip(plan + call_plan, _max_over_ranks(local_s, device, group)):
            times_s[key].append(time_s)
    communicator.executor.release()
    if user_communicator is not None:
        user_communicator.executor.release()
    samples = [_sample(*key, times_s[key]) for key in plan]
    shared_host = device.type == "cpu"  # as tuner_from_profile prices a CPU profile
    for key in call_plan:
        _, kind, nbytes = key
        numel = call_numel(kind, nbytes, world_size)
        samples.append(_call_sample(kind, numel, call_terms(kind, numel, world_size, shared_host), times_s[key]))
    for sample in samples:
        emit("row", sample)
    return samples


def describe_device(backend: str) -> str:
    """"cpu" for gloo; "cuda (<GPU name>)" for nccl."""
    if backend == "nccl" and torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return "cpu"
