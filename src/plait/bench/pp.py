"""`plait bench pp`: pipeline schedules on real processes, their measured bubble and
activation memory against the theory.

For each pipeline size p (a fresh world of p processes) and each schedule, every
rank trains an MLP of ``layers`` Linear+Tanh layers of ``width`` units, split into
p·v chunks with equal parameters, with ``PipelineEngine`` for ``warmup`` + ``steps``
SGD steps on batches of ``batch`` rows in m micro-batches. Reported per schedule:

- step time (median) and samples/s;
- bubble: measured = mean over ranks of 1 - busy/makespan on the gathered timeline
  of the median step (busy = time inside forward and backward computations; the
  rest is waiting and messaging), against the unit-cost replay of the same
  schedule (forward 1, backward 2) and the closed form: (p-1)/(m+p-1) for GPipe and
  1F1B, ((p-1)/v)/(m+(p-1)/v) interleaved, (p-2)/(2m+p-2) Chimera, (p-1)/(3m+p-1)
  zero bubble (its unit replay splits the backward into B and W of 1 each);
- activation memory, measured: in one extra step, the peak over the step of the
  bytes of distinct storages autograd holds for backward, alive at once
  (``plait.memory.saved_memory``: saved-tensor hooks around every stage and the
  loss, a weakref.finalize per saved tensor; parameters and the batch excluded).
  Nothing in it knows the schedule or reads the engine's bookkeeping;
- predicted: walk the rank's compute order adding each forward's per-micro-batch
  bytes (the engine's count at that forward) and removing them at its backward (at
  W when split); ``engine_bytes`` is the engine's own running peak of the same
  bookkeeping; and the in-flight count formula (GPipe m, 1F1B p - r on rank r).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.memory.saved_memory import SavedTensorMeter
from plait.names.schedules import CHIMERA, GPIPE, INTERLEAVED_1F1B, ONE_F_ONE_B, PIPELINE_SCHEDULES, ZERO_BUBBLE
from plait.parallel.pipeline import build, peak_in_flight, replay
from plait.parallel.pipeline.engine import PipelineEngine, gather_timeline
from plait.parallel.pipeline.partition import build_stage, split_layers
from plait.parallel.pipeline.schedules import BACKWARD, FORWARD, WEIGHT

SCHEDULE_NAMES = PIPELINE_SCHEDULES  # plait.names.schedules


@dataclass(frozen=True, kw_only=True)
class PpBenchConfig:
    """Flags of `plait bench pp` (one field per flag)."""

    stages: tuple[int, ...] = (2, 4)
    schedules: tuple[str, ...] = SCHEDULE_NAMES
    microbatches: int = 8
    virtual: int = 2
    layers: int = 16
    width: int = 512
    batch: int = 1024
    steps: int = 3
    warmup: int = 1
    timeout_s: float = 300.0

    def __post_init__(self):
        problems = []
        for name in ("microbatches", "virtual", "layers", "width", "batch", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be an int >= 1")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            problems.append(f"warmup={self.warmup!r} must be an int >= 0")
        unknown = [name for name in self.schedules if name not in SCHEDULE_NAMES]
        if unknown or not self.schedules:
            problems.append(f"schedules {list(self.schedules)}: choose from {list(SCHEDULE_NAMES)}")
        if not self.stages or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in self.stages):
            problems.append(f"stages={self.stages!r} must be ints >= 1, e.g. --stages 2,4")
        if not problems:
            for p in self.stages:
                for name in self.schedules:
                    try:
                        build(name, p, self.microbatches, self.virtual if name == INTERLEAVED_1F1B else None)
                    except ValueError as error:
                        problems.append(f"--stages {p}: {error}")
                if self.layers < p * self.virtual:
                    problems.append(f"layers={self.layers} cannot fill {p} stages x {self.virtual} virtual chunks: "
                                    f"use --layers >= {p * self.virtual}")
            if self.batch % self.microbatches:
                problems.append(f"batch={self.batch} does not split into {self.microbatches} micro-batches: "
                                f"use a multiple of {self.microbatches}")
        if problems:
            raise ValueError("; ".join(problems))


def formula_bubble(name: str, p: int, m: int, v: int) -> float:
    if name == INTERLEAVED_1F1B:
        return ((p - 1) / v) / (m + (p - 1) / v)
    if name == CHIMERA:
        return (p - 2) / (2 * m + p - 2)
    if name == ZERO_BUBBLE:
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def formula_in_flight(name: str, p: int, m: int, rank: int) -> int | None:
    return {GPIPE: m, ONE_F_ONE_B: min(p - rank, m), ZERO_BUBBLE: min(2 * p - rank - 1, m)}.get(name)


def predicted_peak_bytes(schedule, rank: int, stage_bytes: dict) -> int:
    """Walk the rank's compute order: + a forward's bytes, - at its backward (at W
    when the backward is split)."""
    freed_by = WEIGHT if schedule.split_backward else BACKWARD
    alive = peak = 0
    for action in schedule.compute_order(rank):
        if action.kind in (FORWARD, freed_by):
            alive += stage_bytes[action.stage] * (1 if action.kind == FORWARD else -1)
        peak = max(peak, alive)
    return peak


def _mlp(config: PpBenchConfig) -> list[nn.Module]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(config.layers):
        layers += [nn.Sequential(nn.Linear(config.width, config.width), nn.Tanh())]
    return layers


def _mse(out, target):
    return F.mse_loss(out, target)


def _one_schedule(config: PpBenchConfig, name: str, rank: int, p: int, layers: list[nn.Module] | None = None) -> dict:
    """``layers``: the model's layers (default the config's MLP), each mapping (b, width) to (b, width)."""
    v = config.virtual if name == INTERLEAVED_1F1B else 1
    schedule = build(name, p, config.microbatches, v if name == INTERLEAVED_1F1B else None)
    layers = _mlp(config) if layers is None else layers
    chunks = split_layers(layers, p, virtual=v)
    meter = SavedTensorMeter()
    modules = {s: meter.wrap(build_stage(layers, chunks[s])) for _, s in schedule.stages_of(rank)}
    engine = PipelineEngine(schedule, modules, meter.wrap(_mse), timeout_s=config.timeout_s)
    optimizer = torch.optim.SGD(engine.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(config.batch, config.width, generator=generator)
    targets = torch.randn(config.batch, config.width, generator=generator)
    times = []
    for step in range(config.warmup + config.steps):
        dist.barrier()
        engine.train_step(inputs, targets, optimizer)
        times.append(engine.history[-1].step_time_s)
    every_rank: list = [None] * p
    dist.all_gather_object(every_rank, times)  # the same median step on every rank
    slowest = [max(rank_times[step] for rank_times in every_rank) for step in range(config.warmup, len(times))]
    median_step = config.warmup + slowest.index(sorted(slowest)[len(slowest) // 2])
    timeline = gather_timeline(engine, median_step)
    record = engine.history[median_step]
    # one more step, metered (the meter's hooks hide the stages from the engine's own)
    dist.barrier()
    meter.reset(exclude=[*engine.parameters(), inputs, targets])
    meter.enabled = True
    try:
        engine.train_step(inputs, targets, optimizer)
    finally:
        meter.enabled = False
    mine = {"engine_bytes": record.peak_activation_bytes, "measured_bytes": meter.peak_bytes,
            "predicted_bytes": predicted_peak_bytes(schedule, rank, record.stage_activation_bytes),
            "step_s": record.step_time_s}
    everyone: list = [None] * p
    dist.all_gather_object(everyone, mine)
    unit = replay(schedule)
    return {
        "schedule": name, "p": p, "m": config.microbatches, "v": v,
        "step_ms": 1e3 * statistics.mean(row["step_s"] for row in everyone),
        "samples_per_s": config.batch / statistics.mean(row["step_s"] for row in everyone),
        "bubble_measured": timeline.bubble_fraction(),
        "bubble_per_rank": [timeline.bubble_fraction(r) for r in range(p)],
        "bubble_unit_replay": unit.bubble_fraction(),
        "bubble_formula": formula_bubble(name, p, config.microbatches, v),
        "measured_bytes": [row["measured_bytes"] for row in everyone],
        "engine_bytes": [row["engine_bytes"] for row in everyone],
        "predicted_bytes": [row["predicted_bytes"] for row in everyone],
        "in_flight": peak_in_flight(schedule),
        "in_flight_formula": [formula_in_flight(name, p, config.microbatches, r) for r in range(p)],
        "timeline": [(i.rank, i.label, i.kind, i.microbatch, i.start_s, i.end_s) for i in timeline.intervals],
    }


def run_pp_bench(config: PpBenchConfig, *, device=None, emit=None) -> list[dict]:
    """Every schedule at p = world size; rank 0 emits ("row", dict) per schedule."""
    del device  # CPU / gloo here
    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    rows = []
    for name in config.schedules:
        row = _one_schedule(config, name, rank, p)
        rows.append(row)
        if rank == 0 and emit:
            emit("row", row)
    return rows
