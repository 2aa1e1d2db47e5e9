"""`plait bench pp --vs-torch`: plait's PipelineEngine against
``torch.distributed.pipelining`` on the same model, split, batch and world.

For each pipeline size p (one fresh world of p gloo processes, 1 thread each) and
each schedule both have, every rank builds the bench's MLP twice from the same seed
(``plait.bench.pp``: ``layers`` x Linear(width, width)+Tanh, cut into p·v chunks
of equal parameters by ``split_layers``), hands one copy's chunks to plait's
``PipelineEngine`` and the other's to torch's ``PipelineStage`` (chunk s is stage s
on both sides, on the same rank), each with its own SGD. Schedule pairs:

- gpipe            -> ``ScheduleGPipe``
- 1f1b             -> ``Schedule1F1B``
- interleaved_1f1b -> ``ScheduleInterleaved1F1B`` (v chunks per rank, chunk c of
  rank r is stage c·p + r on both sides)
- zero_bubble      -> ``ScheduleInterleavedZeroBubble`` with one stage per rank:
  torch's ZB1P, the ZB-H1 family plait's zero_bubble belongs to (backward split
  into an input-gradient and a weight-gradient half, W deferred into the bubbles,
  stage s on rank s). ``ScheduleZBVZeroBubble`` is not the match: it needs two
  stages per rank in a V (stages r and 2p-1-r on rank r), another split of the
  model. The two orders of F/B/W differ in detail (plait's is list-scheduled).

Chimera has no torch counterpart and is left out.

Transports: torch's stages always message over gloo; plait's engine runs once per
``transports`` entry, the world's communicator made with that ``CommConfig.transport``
before the engines: ``gloo`` (plait's messages through gloo too: the engines alone
differ) and ``shm`` (plait on its best transport, shared memory between the
processes of this host). Each is its own row, against torch timed in the same rounds.

Where the time goes: each row carries plait's compute per rank (median over the
timed steps of the engine's forward/backward/weight intervals) and ``ceiling``:
torch's step over the slowest rank's compute, the ratio an engine that hid every
bubble and message behind the same computations would reach. With more ranks than
cores neither is given (None): a computation's wall time then includes the other
ranks' turns on its core.

Timing: ``warmup`` untimed steps per side (both sides settle shapes in their first
step), then ``rounds`` rounds; in each round both sides run ``steps`` steps, plait
first in even rounds and torch first in odd ones, so a slow spell of the shared
machine hits both sides alike. A step is timed on every rank from a barrier to its
return and counted as the slowest rank's time. It is the whole training step:
zeroing the gradients, the schedule, the optimiser step (plait's ``train_step`` also
all-reduces the loss to every rank; torch is asked for no merged outputs). Per
round: each side's median step; reported: the median over rounds of those, and the
ratio torch/plait (> 1: plait faster) as the median over rounds of the per-round
ratios, with their min and max.

Losses: both sides start from the same weights and data, so step k's mean loss over
the micro-batches must agree. The forwards are the same float32 operations, so
the first step's losses are bitwise equal. Later steps may differ by rounding:
plait scales each micro-batch loss by 1/m before its backward, torch scales the
accumulated gradients by 1/m after (exact when m is a power of two), and the split
backward of zero bubble sums weight gradients through a different autograd path.
A few float32 ulps per step, compounded over the steps: agreement is a relative
difference of at most ``LOSS_RTOL`` = 1e-5 (about 80 float32 ulps) on every step.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from plait.bench.pp import PpBenchConfig, _mlp, _mse
from plait.comm.communicator import init_communicator
from plait.comm.config import CommConfig
from plait.names.transports import GLOO, SHM
from plait.names.schedules import GPIPE, INTERLEAVED_1F1B, ONE_F_ONE_B, ZERO_BUBBLE
from plait.parallel.pipeline import build
from plait.parallel.pipeline.engine import PipelineEngine
from plait.parallel.pipeline.partition import build_stage, split_layers

VS_TORCH_SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, ZERO_BUBBLE)
# plait's schedule -> torch.distributed.pipelining's class (torch's names, not a second plait vocabulary)
TORCH_SCHEDULES = {GPIPE: "ScheduleGPipe", ONE_F_ONE_B: "Schedule1F1B", INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
                   ZERO_BUBBLE: "ScheduleInterleavedZeroBubble"}
VS_TORCH_TRANSPORTS = (GLOO, SHM)  # plait's side; torch's stages always use gloo
LOSS_RTOL = 1e-5
_LEARNING_RATE = 1e-3


@dataclass(frozen=True, kw_only=True)
class PpVsTorchConfig(PpBenchConfig):
    """Flags of `plait bench pp --vs-torch`: `plait bench pp`'s (the same model, batch,
    steps and checks), the schedules torch has too, and the rounds to alternate."""

    schedules: tuple[str, ...] = VS_TORCH_SCHEDULES
    rounds: int = 5
    transports: tuple[str, ...] = VS_TORCH_TRANSPORTS

    def __post_init__(self):
        problems = []
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            problems.append(f"rounds={self.rounds!r} must be an int >= 1")
        missing = [name for name in self.schedules if name not in VS_TORCH_SCHEDULES]
        if missing or not self.schedules:
            problems.append(f"--vs-torch: torch.distributed.pipelining has no counterpart of {missing}; "
                            f"choose from {list(VS_TORCH_SCHEDULES)}")
        if not self.transports or any(name not in VS_TORCH_TRANSPORTS for name in self.transports):
            problems.append(f"transports={list(self.transports)}: choose from {list(VS_TORCH_TRANSPORTS)}, "
                            "e.g. --transports gloo,shm")
        known = tuple(name for name in self.schedules if name in VS_TORCH_SCHEDULES) or VS_TORCH_SCHEDULES
        try:  # `plait bench pp`'s checks of the rest, over the schedules torch has (every problem at once)
            PpBenchConfig(**{**{spec.name: getattr(self, spec.name) for spec in fields(PpBenchConfig)},
                             "schedules": known})
        except ValueError as error:
            problems.append(str(error))
        if problems:
            raise ValueError("; ".join(problems))


class _PlaitSide:
    def __init__(self, schedule, layers, chunks, stage_ids, config):
        modules = {s: build_stage(layers, chunks[s]) for s in stage_ids}
        self.engine = PipelineEngine(schedule, modules, _mse, timeout_s=config.timeout_s)
        self.optimizer = torch.optim.SGD(self.engine.parameters(), lr=_LEARNING_RATE)

    def step(self, inputs, targets) -> float:
        return self.engine.train_step(inputs, targets, self.optimizer)


class _TorchSide:
    def __init__(self, name, layers, chunks, stage_ids, config, device):
        stages = [pipelining.PipelineStage(build_stage(layers, chunks[s]), s, len(chunks), device)
                  for s in stage_ids]
        self.first, self.last = 0 in stage_ids, len(chunks) - 1 in stage_ids
        self.microbatches = config.microbatches
        params = [param for stage in stages for param in stage.submod.parameters()]
        self.optimizer = torch.optim.SGD(params, lr=_LEARNING_RATE)
        schedule_class = getattr(pipelining, TORCH_SCHEDULES[name])
        if name in (GPIPE, ONE_F_ONE_B):
            self.schedule = schedule_class(stages[0], config.microbatches, loss_fn=_mse)
        else:
            self.schedule = schedule_class(stages, config.microbatches, loss_fn=_mse)

    def step(self, inputs, targets) -> float | None:
        """The mean micro-batch loss on the rank holding the last stage, else None."""
        self.optimizer.zero_grad(set_to_none=True)
        losses: list = []
        self.schedule.step(*((inputs,) if self.first else ()), target=targets if self.last else None,
                           losses=losses if self.last else None, return_outputs=False)
        self.optimizer.step()
        return sum(float(loss.detach()) for loss in losses) / self.microbatches if self.last else None


def _timed(side, inputs, targets, count: int, times: list, losses: list) -> None:
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        loss = side.step(inputs, targets)
        times.append(time.perf_counter() - start)
        losses.append(loss)


def compare_schedule(config: PpVsTorchConfig, name: str, device=None, transport: str = SHM) -> dict | None:
    """One schedule on both sides in the current world; the row on rank 0, None elsewhere."""
    rank, p = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if device is None else device
    v = config.virtual if name == INTERLEAVED_1F1B else 1
    schedule = build(name, p, config.microbatches, v if name == INTERLEAVED_1F1B else None)
    plait_layers, torch_layers = _mlp(config), _mlp(config)  # the same seed: equal weights
    chunks = split_layers(plait_layers, p, virtual=v)
    stage_ids = [s for _, s in schedule.stages_of(rank)]
    sides = {"plait": _PlaitSide(schedule, plait_layers, chunks, stage_ids, config),
             "torch": _TorchSide(name, torch_layers, chunks, stage_ids, config, device)}
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(config.batch, config.width, generator=generator)
    targets = torch.randn(config.batch, config.width, generator=generator)
    times = {"plait": [], "torch": []}
    losses = {"plait": [], "torch": []}
    for label, side in sides.items():
        _timed(side, inputs, targets, config.warmup, [], losses[label])
    for round_index in range(config.rounds):
        order = ("plait", "torch") if round_index % 2 == 0 else ("torch", "plait")
        for label in order:
            _timed(sides[label], inputs, targets, config.steps, times[label], losses[label])
    timed = list(sides["plait"].engine.history)[-config.rounds * config.steps:]
    compute_s = statistics.median(sum(record.stage_busy_s.values()) for record in timed)
    everyone: list = [None] * p
    dist.all_gather_object(everyone, (times, losses, compute_s))
    if rank != 0:
        return None
    row = summarise(name, p, config, [entry[0] for entry in everyone], [entry[1] for entry in everyone])
    compute_ms = [1e3 * entry[2] for entry in everyone]
    # with more ranks than cores an interval's wall time includes the other rank's turns on the core: no floor
    floor_ms = max(compute_ms) if p <= (os.cpu_count() or 1) else None
    return {**row, "transport": transport, "plait_compute_ms": compute_ms, "compute_floor_ms": floor_ms,
            "ceiling": None if floor_ms is None else row["torch_ms"] / floor_ms}


def summarise(name: str, p: int, config: PpVsTorchConfig, rank_times: list[dict], rank_losses: list[dict]) -> dict:
    """Per round each side's median step (slowest rank per step), the per-round
    ratios, and the loss comparison (plait's loss from rank 0, torch's from the rank
    that reported one: the last stage's)."""
    per_round = {}
    for label in ("plait", "torch"):
        slowest = [max(times[label][k] for times in rank_times) for k in range(len(rank_times[0][label]))]
        per_round[label] = [statistics.median(slowest[r * config.steps:(r + 1) * config.steps])
                            for r in range(config.rounds)]
    ratios = [t / q for t, q in zip(per_round["torch"], per_round["plait"])]
    plait_losses = rank_losses[0]["plait"]
    torch_losses = next(losses["torch"] for losses in rank_losses if losses["torch"][0] is not None)
    differences = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(plait_losses, torch_losses)]
    return {
        "schedule": name, "torch_schedule": TORCH_SCHEDULES[name], "p": p, "m": config.microbatches,
        "v": config.virtual if name == INTERLEAVED_1F1B else 1, "rounds": config.rounds, "steps": config.steps,
        "plait_ms": 1e3 * statistics.median(per_round["plait"]),
        "torch_ms": 1e3 * statistics.median(per_round["torch"]),
        "plait_ms_per_round": [1e3 * value for value in per_round["plait"]],
        "torch_ms_per_round": [1e3 * value for value in per_round["torch"]],
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios,
        "plait_losses": plait_losses, "torch_losses": torch_losses,
        "loss_max_rel_diff": max(differences), "loss_rtol": LOSS_RTOL,
        "losses_agree": max(differences) <= LOSS_RTOL,
    }


def run_pp_vs_torch(config: PpVsTorchConfig, *, device=None, emit=None) -> list[dict]:
    """Every transport and schedule at p = world size; rank 0 emits ("row", dict) per row."""
    torch.set_num_threads(1)
    rows = []
    for transport in config.transports:
        init_communicator(None, CommConfig(transport=transport))  # plait's messages (torch's stay on gloo)
        for name in config.schedules:
            row = compare_schedule(config, name, device, transport)
            if row is not None:
                rows.append(row)
                if emit:
                    emit("row", row)
    return rows
