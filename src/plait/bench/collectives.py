"""Measure collectives the way nccl-tests does, inside an initialised process group.

For every (algorithm, size): optional correctness check on seeded rank-distinct
inputs, untimed warm-up calls, a torch barrier, then `iters` back-to-back calls
timed with `time.perf_counter`. The reported time is max over ranks of
elapsed / iters, so it is the time of the slowest rank, as in nccl-tests.

    algbw = size_bytes / time            (GB/s, GB = 1e9 bytes)
    busbw = algbw * busbw_factor(collective, p)

"size" is the bytes of the largest buffer: for the chunked collectives
(all_gather, reduce_scatter, all_to_all, gather, scatter) the full p * chunk buffer,
and "count" is the per-rank chunk, as nccl-tests prints them.

The algorithm "torch" calls torch.distributed directly; every other name calls
plait.comm with `algorithm=name` on the world's communicator, whose transport is
``BenchConfig.transport`` (auto: shared memory between the local ranks). A name
with a transport suffix, "auto@gloo" or "ring@shm", runs on a second group of the
same ranks whose communicator uses that transport, so one run compares transports
side by side, interleaved size by size.
This module parses no command line: see plait.cli.bench and plait.bench.report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

import plait.comm as comm
from plait.bench.buffers import (
    Buffers,
    canonical_dtype_name,
    CHUNKED_COLLECTIVES,
    COLLECTIVES,
    count_wrong,
    fill_inputs,
    make_buffers,
    OPS,
    parse_dtype,
    REDUCING_COLLECTIVES,
    ROOTED_COLLECTIVES,
    TORCH_ALGORITHM,
)
from plait.comm.algorithms import TOPOLOGY_ALGORITHMS
from plait.comm.communicator import process_group
from plait.comm.config import TRANSPORTS
from plait.comm.tuner import Tuner, tuner_from_profile
from plait.cost.profile import load_profile
from plait.cost.topology_io import load_topology

AUTO_ALGORITHM = "auto"

# nccl-tests' bus-bandwidth factors. gather/scatter: (p-1)/p as nccl-tests'
# gather_perf/scatter_perf do (the root moves (p-1) of its p chunks).
_BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda p: 2.0 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "gather": lambda p: (p - 1) / p,
    "scatter": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
    "barrier": lambda p: 0.0,
}


BUSBW_FORMULAS = {"all_reduce": "2(p-1)/p", "reduce_scatter": "(p-1)/p", "all_gather": "(p-1)/p",
                  "all_to_all": "(p-1)/p", "gather": "(p-1)/p, as nccl-tests' gather_perf",
                  "scatter": "(p-1)/p, as nccl-tests' scatter_perf", "broadcast": "1", "reduce": "1",
                  "barrier": "0, no data"}


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests busbw / algbw: 2(p-1)/p all-reduce; (p-1)/p all-gather,
    reduce-scatter, all-to-all, gather, scatter; 1 broadcast, reduce; 0 barrier."""
    if collective not in _BUSBW_FACTORS:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    if world_size < 1:
        raise ValueError(f"world_size({world_size}) must be >= 1")
    return _BUSBW_FACTORS[collective](world_size)


def message_sizes(min_nbytes: int, max_nbytes: int, factor: int) -> list[int]:
    """min, min*factor, ... up to max inclusive, like nccl-tests -b/-e/-f."""
    if min_nbytes < 1 or max_nbytes < min_nbytes or factor < 2:
        raise ValueError(
            f"need 1 <= min_nbytes({min_nbytes}) <= max_nbytes({max_nbytes}) and factor({factor}) >= 2"
        )
    sizes, nbytes = [], min_nbytes
    while nbytes <= max_nbytes:
        sizes.append(nbytes)
        nbytes *= factor
    return sizes


def buffer_plan(collective: str, nbytes: int, world_size: int, element_size: int) -> tuple[int, int]:
    """(count, size_bytes) for a requested size: count is the per-rank chunk for the
    chunked collectives (size = p * count * element_size), else the element count.
    Rounds down to whole elements (and whole chunks); count may be 0 (size skipped)."""
    if collective == "barrier":
        return 0, 0
    if collective in CHUNKED_COLLECTIVES:
        count = nbytes // (element_size * world_size)
        return count, count * world_size * element_size
    count = nbytes // element_size
    return count, count * element_size


def available_algorithms(collective: str) -> list[str]:
    """"torch", plait's algorithms for `collective`, then "auto" (plait's default
    choice per size)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")

    return [TORCH_ALGORITHM, *comm.algorithms_for(collective), AUTO_ALGORITHM]


def accepted_algorithms(collective: str) -> list[str]:
    """The names --algorithms accepts: those run by default and the topology algorithms
    (which need --topology), and every plait name with a transport suffix
    ("ring@gloo", "auto@shm")."""
    names = [*available_algorithms(collective),
             *(name for name in comm.algorithms_for(collective, with_topology=True) if name in TOPOLOGY_ALGORITHMS)]
    suffixed = [f"{name}@{transport}" for name in names if name != TORCH_ALGORITHM
                for transport in TRANSPORTS if transport != "auto"]
    return names + suffixed


def split_transport(algorithm: str) -> tuple[str, str | None]:
    """("ring", "gloo") for "ring@gloo"; (name, None) without a suffix."""
    name, _, transport = algorithm.partition("@")
    return name, transport or None


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One `plait bench` run. iters is the most timed calls per (algorithm, size);
    time_budget_s > 0 scales it down for slow sizes (see choose_iteration_counts)."""

    collective: str
    algorithms: tuple[str, ...] = (TORCH_ALGORITHM,)
    min_nbytes: int = 1024
    max_nbytes: int = 64 * 1024 * 1024
    factor: int = 2
    iters: int = 20
    warmup: int = 5
    op: str = "sum"
    dtype: str = "float32"
    root: int = 0
    check: bool = False
    time_budget_s: float = 0.5
    timeout_s: float = 120.0
    seed: int = 1234
    rounds: int = 1
    profile_path: str | None = None  # algorithm="auto" follows this calibration profile
    topology_path: str | None = None  # the cluster's topology: blink/synth built from it, auto priced on it
    arg_check: str = "inband"  # plait's argument check: inband (the default users run), deep or off
    transport: str = "auto"  # the world communicator's CommConfig.transport

    def __post_init__(self) -> None:
        problems = []
        if self.transport not in TRANSPORTS:
            problems.append(f"transport {self.transport!r} not in {', '.join(TRANSPORTS)}")
        object.__setattr__(self, "algorithms", tuple(self.algorithms))
        if self.collective not in COLLECTIVES:
            problems.append(f"collective {self.collective!r} not in {', '.join(COLLECTIVES)}")
        if not self.algorithms:
            problems.append("algorithms is empty")
        if self.min_nbytes < 1 or self.max_nbytes < self.min_nbytes:
            problems.append(f"need 1 <= min_nbytes({self.min_nbytes}) <= max_nbytes({self.max_nbytes})")
        if self.factor < 2:
            problems.append(f"factor({self.factor}) must be >= 2")
        if self.iters < 1:
            problems.append(f"iters({self.iters}) must be >= 1")
        if self.warmup < 0:
            problems.append(f"warmup({self.warmup}) must be >= 0")
        if self.rounds < 1:
            problems.append(f"rounds({self.rounds}) must be >= 1")
        if self.op not in OPS:
            problems.append(f"op {self.op!r} not in {', '.join(OPS)}")
        try:
            dtype = parse_dtype(self.dtype)
        except ValueError as error:
            problems.append(str(error))
        else:
            object.__setattr__(self, "dtype", canonical_dtype_name(self.dtype))
            if self.op == "avg" and not dtype.is_floating_point:
                problems.append(f"op avg needs a floating dtype, got {self.dtype}")
        if self.root < 0:
            problems.append(f"root({self.root}) must be >= 0")
        needs_topology = [name for name in self.algorithms if name in TOPOLOGY_ALGORITHMS]
        if needs_topology and self.topology_path is None:
            problems.append(f"algorithm(s) {', '.join(needs_topology)} are built from the cluster's links: give "
                            "--topology FILE (e.g. from plait testbed probe)")
        if self.time_budget_s < 0 or self.timeout_s <= 0:
            problems.append(f"need time_budget_s({self.time_budget_s}) >= 0 and "
                            f"timeout_s({self.timeout_s}) > 0")
        if problems:
            raise ValueError("invalid bench config: " + "; ".join(problems))

    @property
    def reported_op(self) -> str:
        return self.op if self.collective in REDUCING_COLLECTIVES else "none"

    @property
    def reported_root(self) -> int:
        return self.root if self.collective in ROOTED_COLLECTIVES else -1


@dataclass(kw_only=True)
class BenchRow:
    """One measured (algorithm, size). time/bandwidths are None when `error` is set;
    wrong is None when the check is off."""

    collective: str
    algorithm: str
    nprocs: int
    size_bytes: int
    count: int
    dtype: str
    op: str
    root: int
    time_us: float | None = None
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    wrong: int | None = None
    iters: int = 0
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        keys = ("collective", "algorithm", "nprocs", "size_bytes", "count", "dtype", "op", "root",
                "time_us", "algbw_gbps", "busbw_gbps", "wrong", "iters", "error")
        out = {key: getattr(self, key) for key in keys}
        # --predict adds predicted_us, error_pct and (auto rows) auto_choice
        out.update({key: value for key, value in self.extra.items()
                    if key in ("predicted_us", "error_pct", "auto_choice")})
        return out


def choose_iteration_counts(per_call_s: float, iters: int, warmup_left: int,
                            time_budget_s: float) -> tuple[int, int]:
    """(timed iters, further warm-up calls) for a size whose calls take ~per_call_s.

    Rule: timed iters = clamp(floor(time_budget_s / per_call_s), 1, iters), so the
    timed loop of one (algorithm, size) lasts about time_budget_s or less; the
    warm-up still owed is capped at the timed iters (slow sizes need little warm-up).
    time_budget_s == 0 disables scaling."""
    if time_budget_s <= 0:
        return iters, warmup_left
    fitting = int(time_budget_s / per_call_s) if per_call_s > 0 else iters
    timed = max(1, min(iters, fitting))
    return timed, min(warmup_left, timed)


def _synchronize(device: torch.device) -> None:
    # Kernel launches are asynchronous on GPUs; on CPU/gloo calls are blocking.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allreduce_scalar(value: float, op: dist.ReduceOp, device: torch.device, group) -> float:
    scalar = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(scalar, op=op, group=group)
    return float(scalar.item())


def _timed_calls(call: Callable[[], None], ncalls: int, device: torch.device) -> float:
    _synchronize(device)
    start_s = time.perf_counter()
    for _ in range(ncalls):
        call()
    _synchronize(device)
    return time.perf_counter() - start_s


def _configure_plait(config: BenchConfig) -> dict:
    """Create the world's communicator (and one on a group of its own per transport
    suffix); returns {suffix: communicator}."""
    if all(name == TORCH_ALGORITHM for name in config.algorithms):
        return {}

    # the world's communicator, with the argument check asked for (the default, in-band,
    # is what users run; --check off times the bare messages)
    tuner = topology = profile = None
    if config.profile_path is not None:
        profile = load_profile(config.profile_path)
        if profile is None:
            raise ValueError(f"no calibration profile at {config.profile_path}")
        tuner = tuner_from_profile(profile, source=config.profile_path)
    if config.topology_path is not None:
        topology = load_topology(config.topology_path)
        tuner = topology_tuner(topology, profile, config.topology_path)
    base = comm.CommConfig(timeout_s=config.timeout_s, check=config.arg_check, tuner=tuner, topology=topology,
                           transport=config.transport)
    communicators = {None: comm.init_communicator(None, base)}
    for transport in sorted({split_transport(name)[1] for name in config.algorithms} - {None}):
        group = dist.new_group(list(range(dist.get_world_size())))
        communicators[transport] = comm.init_communicator(group, base.replace(transport=transport))
    return communicators


def topology_tuner(topology, profile, source: str) -> Tuner:
    """auto on a topology: every candidate simulated on its links, plus the profile's
    fixed call overhead when there is a profile."""
    return Tuner(None, topology=topology, call_overhead_s=profile.call_overhead_s if profile else 0.0,
                 source=f"topology {source}")


def measure_one(config: BenchConfig, algorithm: str, count: int, size_bytes: int, *,
                group=None, device: torch.device, communicators: dict | None = None) -> BenchRow:
    """Check (optional), warm up, choose iters and time one (algorithm, size) on all ranks."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    dtype = parse_dtype(config.dtype)
    row = BenchRow(collective=config.collective, algorithm=algorithm, nprocs=world_size,
                   size_bytes=size_bytes, count=count, dtype=config.dtype,
                   op=config.reported_op, root=config.reported_root)
    buffers: Buffers = make_buffers(config.collective, count, dtype, device, rank, world_size,
                                    config.root)
    call = _make_call(config, algorithm, buffers, group, communicators or {})

    if config.check:
        fill_inputs(buffers, config.collective, rank, world_size, count, config.seed)
        call()
        _synchronize(device)
        local_wrong = count_wrong(buffers, config.collective, config.op, rank, world_size,
                                  config.root, count, config.seed)
        row.wrong = int(_allreduce_scalar(local_wrong, dist.ReduceOp.SUM, device, group))
        # Timing runs on zeros: repeated in-place sums/products of zeros never overflow
        # or go denormal, which would change the speed of the reduction arithmetic.
        buffers.zero_()

    iters, warmup_left = config.iters, config.warmup
    if config.warmup >= 1:
        probes = min(config.warmup, 2)  # the 1st call pays one-time set-up; time the 2nd
        probe_s = 0.0
        for _ in range(probes):
            probe_s = _timed_calls(call, 1, device)
        per_call_s = _allreduce_scalar(probe_s, dist.ReduceOp.MAX, device, group)
        iters, warmup_left = choose_iteration_counts(per_call_s, config.iters,
                                                     config.warmup - probes, config.time_budget_s)
    for _ in range(warmup_left):
        call()
    _synchronize(device)
    dist.barrier(group=group)
    elapsed_s = _timed_calls(call, iters, device)
    time_s = _allreduce_scalar(elapsed_s / iters, dist.ReduceOp.MAX, device, group)

    row.iters = iters
    row.time_us = time_s * 1e6
    row.algbw_gbps = size_bytes / time_s / 1e9 if time_s > 0 else 0.0
    row.busbw_gbps = row.algbw_gbps * busbw_factor(config.collective, world_size)
    return row


def run_benchmark(config: BenchConfig, *, group=None, device: torch.device | None = None,
                  emit: Callable[[str, object], None] | None = None) -> list[BenchRow]:
    """Run every (algorithm, size) of `config` on all ranks of `group`; returns the
    rows (identical on every rank). emit(kind, payload) is called as results arrive:
    ("progress", text) while measuring, then per algorithm ("begin", algorithm),
    ("row", BenchRow) ..., ("end", algorithm)."""
    device = device or torch.device("cpu")
    group = process_group(group)  # a Communicator's or a 1-D torch DeviceMesh's process group
    world_size = dist.get_world_size(group)
    if config.root >= world_size:
        raise ValueError(f"root({config.root}) must be < world size({world_size})")
    communicators = _configure_plait(config)
    element_size = parse_dtype(config.dtype).itemsize
    plans: list[tuple[int, int]] = []
    if config.collective == "barrier":
        plans = [(0, 0)]
    else:
        for nbytes in message_sizes(config.min_nbytes, config.max_nbytes, config.factor):
            count, size_bytes = buffer_plan(config.collective, nbytes, world_size, element_size)
            if count > 0 and (count, size_bytes) not in plans:
                plans.append((count, size_bytes))
    emit = emit or (lambda kind, payload: None)
    # Size-major, all algorithms back to back at each size, and the whole sweep
    # repeated `rounds` times: the machine's drift then hits every algorithm alike,
    # and the reported row is the median over rounds.
    measured: dict[tuple[str, int], list[BenchRow]] = {}
    abandoned: set[str] = set()
    for round_index in range(config.rounds):
        for plan_index, (count, size_bytes) in enumerate(plans):
            emit("progress", f"round {round_index + 1}/{config.rounds}, size {size_bytes} B "
                             f"({plan_index + 1}/{len(plans)})")
            for algorithm in config.algorithms:
                if algorithm in abandoned:
                    continue
                row = _measure_or_error(config, algorithm, count, size_bytes, group, device, communicators)
                measured.setdefault((algorithm, size_bytes), []).append(row)
                if row.extra.get("abandon_algorithm"):
                    abandoned.add(algorithm)
    rows: list[BenchRow] = []
    for algorithm in config.algorithms:
        emit("begin", algorithm)
        for _, size_bytes in plans:
            samples = measured.get((algorithm, size_bytes))
            if not samples:
                continue
            row = median_row(samples)
            rows.append(row)
            emit("row", row)
        emit("end", algorithm)
    return rows


def median_row(samples: list[BenchRow]) -> BenchRow:
    """The round with the median time (an error row if any round failed)."""
    failed = [row for row in samples if row.error]
    if failed:
        return failed[0]
    ordered = sorted(samples, key=lambda row: row.time_us)
    return ordered[(len(ordered) - 1) // 2]


def _measure_or_error(config: BenchConfig, algorithm: str, count: int, size_bytes: int,
                      group, device: torch.device, communicators: dict | None = None) -> BenchRow:
    """measure_one, turning an exception on any rank into an error row on all ranks."""
    world_size = dist.get_world_size(group)
    try:
        row, local_error = measure_one(config, algorithm, count, size_bytes, group=group, device=device,
                                       communicators=communicators), None
    except Exception as error:  # reported in the algorithm's block, then we go on
        row, local_error = None, f"{type(error).__name__}: {error}"
    failed = _allreduce_scalar(0.0 if local_error is None else 1.0, dist.ReduceOp.SUM, device, group)
    if failed == 0:
        return row
    messages: list[str | None] = [None] * world_size
    dist.all_gather_object(messages, local_error, group=group)
    distinct = sorted({message for message in messages if message is not None})
    if len(distinct) == 1 and failed == world_size:
        text = distinct[0]
    else:
        text = "; ".join(f"rank {rank}: {message}" for rank, message in enumerate(messages)
                         if message is not None)
    row = BenchRow(collective=config.collective, algorithm=algorithm, nprocs=world_size,
                   size_bytes=size_bytes, count=count, dtype=config.dtype,
                   op=config.reported_op, root=config.reported_root, error=text)
    if failed != world_size:
        # Not every rank failed: peers may have timed out mid-exchange, so messages of
        # this algorithm may still be in flight. Skip its remaining sizes.
        row.extra["abandon_algorithm"] = True
        row.error = text + " (not all ranks failed: skipping this algorithm's larger sizes)"
    return row


def _make_call(config: BenchConfig, algorithm: str, buffers: Buffers, group,
               communicators: dict) -> Callable[[], None]:
    """A no-argument closure running the collective once on `buffers`."""
    collective, root = config.collective, config.root
    algorithm, transport = split_transport(algorithm)
    if transport is not None:
        group = communicators[transport]
    reduce_op = OPS[config.op]
    if algorithm == TORCH_ALGORITHM:
        module, kwargs = dist, {}
        # newer torch renamed reduce_scatter_tensor / all_gather_into_tensor to *_single.
        single = hasattr(dist, "reduce_scatter_single")
        names = {"reduce_scatter": "reduce_scatter_single" if single else "reduce_scatter_tensor",
                 "all_gather": "all_gather_single" if single else "all_gather_into_tensor",
                 "all_to_all": "all_to_all_single"}
    else:
        import plait.comm as module

        kwargs = {"algorithm": algorithm}
        if collective == "barrier" and buffers.tensor.device.type != "cpu":
            kwargs["device"] = buffers.tensor.device  # plait's barrier exchanges a token tensor
        names = {"reduce_scatter": "reduce_scatter_single", "all_gather": "all_gather_single",
                 "all_to_all": "all_to_all_single"}
    function = getattr(module, names.get(collective, collective))
    tensor, output, chunks = buffers.tensor, buffers.output, buffers.chunks
    calls: dict[str, Callable[[], None]] = {
        "all_reduce": lambda: function(tensor, op=reduce_op, group=group, **kwargs),
        "reduce_scatter": lambda: function(output, tensor, op=reduce_op, group=group, **kwargs),
        "all_gather": lambda: function(output, tensor, group=group, **kwargs),
        "all_to_all": lambda: function(output, tensor, group=group, **kwargs),
        "broadcast": lambda: function(tensor, src=root, group=group, **kwargs),
        "reduce": lambda: function(tensor, dst=root, op=reduce_op, group=group, **kwargs),
        "gather": lambda: function(tensor, chunks, dst=root, group=group, **kwargs),
        "scatter": lambda: function(tensor, chunks, src=root, group=group, **kwargs),
        "barrier": lambda: function(group=group, **kwargs),
    }
    return calls[collective]

