"""The wait for the slowest rank at a synchronising call, measured in every rank at once.

On a host with more runnable threads than cores (``plait train``'s 4 ranks on 2 cores)
the scheduler time-slices the ranks, so after the same amount of work they reach a
collective at different times and the group waits for the last one. This benchmark
reproduces a training step's rhythm on ``group``: every rank repeats

    segment of work (``d`` CPU-seconds of one-thread matmuls)  ->  all-reduce of 4 bytes

and records, per repetition, the segment's wall time ``work_s`` (what the rank's
compute took with the sharing: what a compute profile measured with all ranks at once
prices) and its CPU time ``work_cpu_s`` (the work itself: the same when run alone),
and ``blocked_s``, the wall time from entering the collective to leaving it.

Work is defined by CPU time, not wall time: each rank counts how many matmuls fill one
CPU-second (``time.thread_time``, which only advances while the thread runs), so the
calibration is valid although all ranks calibrate at once on shared cores, and a
segment of ``d`` is the same work on every rank whatever the sharing.

Since every rank of a group leaves a collective at (nearly) the same time, a rank's
iteration ``work_s + blocked_s`` is the group's period, and

    mean over ranks (blocked_s) = period − mean work_s = wait + latency

where ``latency`` is the tiny collective's own cost. ``plait.plan.host.fit_sync_wait``
takes the blocked time at ``d = 0`` (back-to-back calls, as ``plait calibrate`` prices
the link) as the latency and fits ``wait = a + b · work_s`` to the rest.

Cost: repeats × Σ_d (d · sharing + a few ms) seconds per call; segments are
interleaved within each repetition (the same order on every rank) so a change of the
machine's background load spreads over all ``d`` alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait import comm
from plait.bench.launch import Job, spawn_and_run
from plait.comm.communicator import group_ranks, process_group
from plait.plan.host import fit_sync_wait, sharing

__all__ = ["DEFAULT_SEGMENTS_S", "MATMUL_SIZE", "SyncDriftConfig", "measure_sync_wait", "matmuls_per_cpu_second",
           "sync_drift_job"]

# CPU-seconds of work between two synchronising calls: none (the link's own price), then
# 1-30 ms, the compute between a training step's collectives on this machine's tiny models
DEFAULT_SEGMENTS_S = (0.0, 1e-3, 3e-3, 1e-2, 3e-2)
# the work kernel: a (96, 96) @ (96, 96) float32 matmul, ~1.8 MFLOP, ~0.1 ms at one thread:
# fine enough for a 1 ms segment, the kind of GEMM a rank of a small model runs
MATMUL_SIZE = 96
_CALIBRATE_CPU_S = 0.02  # CPU time each calibration pass runs the kernel for (~200 matmuls)
_WARMUP_REPEATS = 2


def _matmuls(left: torch.Tensor, right: torch.Tensor, out: torch.Tensor, count: int) -> None:
    for _ in range(count):
        torch.mm(left, right, out=out)


def matmuls_per_cpu_second(left: torch.Tensor, right: torch.Tensor, out: torch.Tensor) -> float:
    """Matmuls of the kernel that fill one CPU-second of this thread: the best of three
    passes of ~``_CALIBRATE_CPU_S`` CPU time each (thread CPU time does not advance while
    the rank is descheduled, so the rate is the one-rank-alone rate under sharing too)."""
    best = 0.0
    for _ in range(3):
        count, start = 0, time.thread_time()
        while (elapsed := time.thread_time() - start) < _CALIBRATE_CPU_S:
            _matmuls(left, right, out, 8)
            count += 8
        best = max(best, count / elapsed)
    return best


def measure_sync_wait(group=None, *, segments_s=DEFAULT_SEGMENTS_S, repeats: int = 30,
                      seed: int = 0) -> list[dict]:
    """Run the work/sync rhythm on ``group`` (None: the world; every rank of the group
    calls it at once) and return the rows of every rank of the group (the same list on
    each): one per (rank, segment) with

    - ``group_size``, ``group_ranks`` (global ranks), ``world_size``, ``rank`` (global),
      ``threads`` (torch's intra-op threads of the rank), ``repeats``;
    - ``segment_s``: the segment's work in CPU-seconds (its duration alone);
    - ``work_s``, ``work_cpu_s``: mean wall and CPU time of the segment;
    - ``blocked_s``: mean wall time inside the collective, ``blocked_median_s`` its median.

    ``plait.plan.host.fit_sync_wait(rows)`` turns them into the host's wait model."""
    segments = tuple(float(d) for d in segments_s)
    if not segments or any(not (d >= 0.0 and d < 10.0) for d in segments):
        raise ValueError(f"segments_s={segments_s!r} must be CPU-seconds in [0, 10), at least one")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a whole number >= 1")
    torch_group = process_group(group)
    ranks = group_ranks(dist.group.WORLD if torch_group is None else torch_group)
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    left, right = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=generator) for _ in range(2))
    out = torch.empty(MATMUL_SIZE, MATMUL_SIZE)
    token = torch.zeros(1)  # 4 bytes: the collective's own cost is latency only
    rate_per_cpu_s = matmuls_per_cpu_second(left, right, out)
    counts = {d: round(d * rate_per_cpu_s) for d in segments}
    order = random.Random(seed)  # the same interleaving on every rank of the group
    samples = {d: {"work_s": [], "work_cpu_s": [], "blocked_s": []} for d in segments}
    comm.all_reduce(token, group=group)  # start together
    for repeat in range(_WARMUP_REPEATS + repeats):
        sequence = list(segments)
        order.shuffle(sequence)
        for d in sequence:
            start_s, start_cpu_s = time.perf_counter(), time.thread_time()
            _matmuls(left, right, out, counts[d])
            end_s, end_cpu_s = time.perf_counter(), time.thread_time()
            comm.all_reduce(token, group=group)
            left_s = time.perf_counter()
            if repeat >= _WARMUP_REPEATS:
                samples[d]["work_s"].append(end_s - start_s)
                samples[d]["work_cpu_s"].append(end_cpu_s - start_cpu_s)
                samples[d]["blocked_s"].append(left_s - end_s)
    mine = [{"group_size": len(ranks), "group_ranks": list(ranks), "world_size": dist.get_world_size(),
             "rank": dist.get_rank(), "threads": torch.get_num_threads(), "repeats": repeats, "segment_s": d,
             "work_s": statistics.fmean(samples[d]["work_s"]),
             "work_cpu_s": statistics.fmean(samples[d]["work_cpu_s"]),
             "blocked_s": statistics.fmean(samples[d]["blocked_s"]),
             "blocked_median_s": statistics.median(samples[d]["blocked_s"])} for d in segments]
    gathered: list = [None] * len(ranks)
    dist.all_gather_object(gathered, mine, group=torch_group)
    return [row for rows in gathered for row in rows]


@dataclass(frozen=True, kw_only=True)
class SyncDriftConfig:
    """One sync-drift run: ``segments_s`` as in ``measure_sync_wait``, ``repeats`` per
    (group size, segment) in all; ``group_sizes``: the groups measured, each size g tiling
    the world as consecutive ranks (g = 2 in a world of 4: {0,1} and {2,3} at once, as
    tp=2 forms them), alternated over ``rounds`` rounds of repeats / rounds each (a
    change in the machine's background load then falls on every size alike);
    ``transport``: the measured communicators' CommConfig.transport (None: each group's
    communicator as the program configured it)."""

    segments_s: tuple[float, ...] = DEFAULT_SEGMENTS_S
    repeats: int = 30
    rounds: int = 3
    group_sizes: tuple[int, ...] = ()  # () : the world only
    transport: str | None = "auto"
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or not 1 <= self.rounds <= self.repeats:
            raise ValueError(f"rounds={self.rounds!r} must be a whole number in [1, repeats={self.repeats}]")


def sync_drift_job(config: SyncDriftConfig, *, device=None, emit=None) -> list[dict]:
    """Every rank: ``measure_sync_wait`` on each tiling of ``group_sizes`` (default: the
    world), the sizes alternated round by round; the rows of all ranks, one per (rank,
    size, segment) over all rounds (means of the rounds' equal-count means; the median is
    the median of the rounds' medians). Rank 0 emits them as ("row", row) events."""
    world_size = dist.get_world_size()
    sizes = config.group_sizes or (world_size,)
    bad = [size for size in sizes if size < 2 or world_size % size]
    if bad:
        raise ValueError(f"group_sizes={bad} must divide world_size={world_size} and be >= 2")
    mine = {}
    for size in sizes:
        groups = [None] if size == world_size else \
            [dist.new_group(list(range(base, base + size))) for base in range(0, world_size, size)]
        mine[size] = groups[0] if size == world_size else groups[dist.get_rank() // size]
        if config.transport is not None:
            comm.init_communicator(mine[size], comm.CommConfig(timeout_s=config.timeout_s, transport=config.transport))
    found: dict[tuple, list[dict]] = {}
    for round_index in range(config.rounds):
        repeats = config.repeats // config.rounds + (round_index < config.repeats % config.rounds)
        for size in sizes[round_index % len(sizes):] + sizes[:round_index % len(sizes)]:
            for row in measure_sync_wait(mine[size], segments_s=config.segments_s, repeats=repeats,
                                         seed=round_index):
                found.setdefault((row["rank"], size, row["segment_s"]), []).append(row)
    merged = [_merged(parts) for parts in found.values()]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, merged)  # the other groups' rows too
    rows, seen = [], set()
    for row in (row for rows_of_rank in everyone for row in rows_of_rank):
        key = (row["rank"], row["group_size"], row["segment_s"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    if emit is not None:
        for row in rows:
            emit("row", row)
    return rows


def _merged(parts: list[dict]) -> dict:
    """One row from the rounds' rows of one (rank, size, segment): means weighted by repeats."""
    repeats = sum(part["repeats"] for part in parts)

    def mean(key: str) -> float:
        return sum(part[key] * part["repeats"] for part in parts) / repeats

    return {**parts[0], "repeats": repeats, "work_s": mean("work_s"), "work_cpu_s": mean("work_cpu_s"),
            "blocked_s": mean("blocked_s"),
            "blocked_median_s": statistics.median(part["blocked_median_s"] for part in parts)}


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.sync_drift --nprocs 4 --group-sizes 2,4``: measure, fit, print
    the fit and the rows as JSON lines (``--out FILE`` keeps them)."""
    parser = argparse.ArgumentParser(prog="python -m plait.bench.sync_drift", description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--segments-ms", default="0,1,3,10,30")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group-sizes", default="", help="e.g. 2,4 (default: the world only)")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    config = SyncDriftConfig(segments_s=tuple(float(ms) * 1e-3 for ms in args.segments_ms.split(",")),
                             repeats=args.repeats, rounds=args.rounds, transport=args.transport,
                             group_sizes=tuple(int(size) for size in args.group_sizes.split(",") if size))
    rows = spawn_and_run(Job(sync_drift_job, config), args.nprocs, "gloo", lambda kind, payload: None,
                         label="sync drift")
    if args.out:
        with open(args.out, "w") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
    fit = fit_sync_wait(rows)
    print(fit.describe())
    cores = len(os.sched_getaffinity(0))
    expected = 1 / sharing(args.nprocs, cores, fit.threads_per_rank)
    longest = fit.slowdown[max(fit.slowdown)]
    print(f"sharing: the longest segment ran {longest:.2f}x its CPU time; {args.nprocs} ranks x "
          f"{fit.threads_per_rank} thread(s) on {cores} cores alone would be {expected:.2f}x"
          + (": the machine had other load, rerun it quiet" if longest > 1.15 * expected else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
