"""`plait bench auto`: the auto-parallel plan measured against pure data parallelism, the
best single-strategy plan and the best knob-search plan, side by side on this machine,
each next to its predicted step time (plait.bench.auto_plans says what each plan is).

Per world size p (``nprocs``): the parent measures this CPU's compute at the model's
own matmul shapes (``plait.plan.device.measure_device``, p processes sharing the
cores) into a ``Cluster("local")`` with the given link (the calibration profile's, or
plait's placeholder), plans every model (``plan_sides``), then starts p gloo
processes (``plait.bench.launch``) that build every side of a model once (the same
seeded weights, the same batch: the model's example inputs, every step) and measure
them in rounds, the order of the sides rotated each round, so a slow spell of the
shared machine hits each alike.

One step: forward (the model returns its loss), backward, SGD update, zero_grad: the
work the plan prices (the optimizer's update of the local shards is small beside it).
Per round and side: ``warmup`` untimed steps, then ``steps`` steps between two
barriers; the step time is the window's over the slowest rank, divided by ``steps``.
Reported per side: the median over rounds, min-max, the predicted step time and the
prediction error (predicted - measured) / measured.

Sanity: every side of a model starts from the same weights and batch, so the first
step's loss must agree across sides within float32 round-off (``LOSS_TOLERANCE``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.bench.auto_plans import PlannedSide, RUN_AUTO, RUN_DP, matmul_shapes, plan_sides
from plait.models.auto_zoo import TINY, ZOO, build
from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.execute import auto_parallelize
from plait.parallel.auto.trace import trace_graph
from plait.parallel.data.data_parallel import DataParallel
from plait.plan.cluster import cluster_preset, topology_cluster
from plait.plan.device import measure_device

__all__ = ["AutoBenchConfig", "WorldJob", "SIZES", "LOSS_TOLERANCE", "local_cluster", "plan_world", "run_auto_bench",
           "summarize"]

SIZES = ("default", "tiny")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
# a loss of ~2 summed in another order by each side (sharded products, all-reduces):
# ~1e-6 relative in float32; another weight or sample would move it by > 1e-2
LOSS_TOLERANCE = 1e-4


@dataclass(frozen=True, kw_only=True)
class AutoBenchConfig:
    """Flags of `plait bench auto` (one field per flag)."""

    models: tuple[str, ...] = tuple(ZOO)
    nprocs: tuple[int, ...] = (2, 4)
    size: str = "default"
    dtype: str = "float32"
    rounds: int = 5
    warmup: int = 2
    steps: int = 5
    lr: float = 1e-3
    seed: int = 0
    time_limit_s: float = 30.0  # each ILP solve
    # measure this CPU at the model's own (m, n, k) products (else squares 32..512): the
    # fit T = t0 + F/rate over shapes of very different efficiency puts the difference
    # in t0, which then prices every kernel of the step (off by default)
    model_shapes: bool = False
    timeout_s: float = 300.0  # the world's silence limit

    def problems(self) -> list[str]:
        """Every bad value, with the fix."""
        found = []
        unknown = [name for name in self.models if name not in ZOO]
        if unknown or not self.models:
            found.append(f"--models: unknown {', '.join(map(repr, unknown)) or '(none given)'}; valid: "
                         f"{', '.join(ZOO)}")
        if not self.nprocs or any(n < 2 for n in self.nprocs):
            found.append(f"--nprocs {','.join(map(str, self.nprocs)) or '(none)'}: each world needs >= 2 processes")
        if self.size not in SIZES:
            found.append(f"--size {self.size!r}: valid: {', '.join(SIZES)}")
        if self.dtype not in DTYPES:
            found.append(f"--dtype {self.dtype!r}: valid: {', '.join(DTYPES)}")
        for name in ("rounds", "steps"):
            if getattr(self, name) < 1:
                found.append(f"--{name} {getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            found.append(f"--warmup {self.warmup} must be >= 0")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            found.append(f"--lr {self.lr} must be a finite number > 0")
        return found

    def model(self, name: str):
        """(module, example inputs) of ``name`` at this size, seed and dtype."""
        sizes = TINY[name] if self.size == "tiny" else {}
        return build(name, seed=self.seed, dtype=DTYPES[self.dtype], **sizes)


@dataclass(frozen=True)
class WorldJob:
    """What the p processes of one world run: the config and the planned sides."""

    config: AutoBenchConfig
    nprocs: int
    sides: tuple[PlannedSide, ...] = field(default_factory=tuple)

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_s


def local_cluster(nprocs: int, link, *, call_overhead_s: float, link_source: str, shapes, dtype: str, device=None,
                  topology=None):
    """Cluster("local") of ``nprocs`` processes: ``device``, by default this CPU measured
    at ``shapes`` (m, n, k) with ``nprocs`` processes sharing its cores, and ``link``
    (within a host of ``topology`` when given: a testbed's, its hosts' link between)."""
    if device is None:
        device = measure_device(dtype=dtype, processes=nprocs, matmul_shapes=shapes)
    if topology is not None:
        return topology_cluster(topology, nprocs=nprocs, device=device, local_link=link,
                                call_overhead_s=call_overhead_s, link_source=link_source)
    return cluster_preset("local", nprocs=nprocs, device=device, local_link=link, call_overhead_s=call_overhead_s,
                          link_source=link_source)


def plan_world(config: AutoBenchConfig, nprocs: int, link, *, call_overhead_s: float, link_source: str,
               emit=print, device=None, topology=None) -> WorldJob:
    """Every model's sides for a world of ``nprocs``, this CPU measured per model (or
    priced as ``device``, a DeviceSpec, when given), on ``topology``'s hosts if given."""
    sides = []
    for name in config.models:
        model, inputs = config.model(name)
        traced = trace_graph(model, inputs)
        cluster = local_cluster(nprocs, link, call_overhead_s=call_overhead_s, link_source=link_source,
                                shapes=matmul_shapes(traced.graph, nprocs) if config.model_shapes else None,
                                dtype=config.dtype, device=device, topology=topology)
        started_s = time.perf_counter()
        mine = plan_sides(name, model, inputs, cluster, time_limit_s=config.time_limit_s, traced=traced)
        emit(f"# {name} on {nprocs} processes: planned in {time.perf_counter() - started_s:.1f} s; "
             f"{cluster.device.describe()}")
        for side in mine:
            emit(f"#   {side.name:<16} mesh {'x'.join(map(str, side.mesh_shape)):<5} predicted "
                 f"{side.predicted_s * 1e3:8.2f} ms  {side.detail}")
        sides += mine
    return WorldJob(config, nprocs, tuple(sides))


class Runner:
    """One side built on this rank: the wrapped model, its optimizer, its step."""

    def __init__(self, side: PlannedSide, config: AutoBenchConfig):
        self.side = side
        model, self.inputs = config.model(side.model)
        if side.runner == RUN_AUTO:
            self.wrapped = auto_parallelize(model, self.inputs, side.layouts, AutoMesh(side.mesh_shape))
            self.micro_inputs = [self.inputs]
        else:
            rank, world_size = dist.get_rank(), dist.get_world_size()
            self.wrapped = DataParallel(model)
            local = [tensor.tensor_split(world_size)[rank] for tensor in self.inputs]
            self.micro_inputs = list(zip(*(tensor.tensor_split(side.micro_batches) for tensor in local)))
        self.optimizer = torch.optim.SGD(self.wrapped.parameters(), lr=config.lr)
        self.first_loss: float | None = None

    def step(self) -> None:
        total = 0.0
        for index, micro in enumerate(self.micro_inputs):
            last = index == len(self.micro_inputs) - 1
            if self.side.runner == RUN_DP and not last:
                with self.wrapped.no_sync():
                    loss = self.wrapped(*micro) / len(self.micro_inputs)
                    loss.backward()
            else:
                loss = self.wrapped(*micro) / len(self.micro_inputs)
                loss.backward()
            total += float(loss.detach())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.first_loss is None:
            self.first_loss = _global_loss(total, self.side.runner)


def _built(side: PlannedSide, config: AutoBenchConfig):
    """(Runner, None), or (None, the refusal's first line) when the executor refuses the
    plan on any rank (it checks a plan before any traffic, alike on every rank; the
    ranks agree on the outcome before going on, so none waits on a side the others
    skipped)."""
    runner, refusal = None, ""
    try:
        runner = Runner(side, config)
    except (ValueError, TypeError) as error:  # plait refuses a plan it cannot run exactly with these
        refusal = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    built = torch.tensor([1.0 if runner is not None else 0.0])
    dist.all_reduce(built, op=dist.ReduceOp.MIN)
    if float(built) < 1.0:
        return None, refusal or "refused on another rank"
    return runner, None


def _global_loss(local: float, runner: str) -> float:
    """The batch's mean loss: DataParallel's ranks hold equal shares (averaged); the
    auto executor's loss is already the global one (replicated)."""
    if runner != RUN_DP:
        return local
    value = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def _max_over_ranks(value_s: float) -> float:
    value = torch.tensor([value_s], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def run_auto_bench(job: WorldJob, *, device=None, emit=None) -> list[dict]:
    """Every executed side of every model, ``rounds`` rounds, order rotated per round;
    rank 0 emits ("row", dict) per side per round (or once, with "refused", for a side
    the executor refused) and returns the rows."""
    del device  # CPU / gloo here
    torch.set_num_threads(1)
    config, rows = job.config, []
    for name in config.models:
        runners = []
        for side in job.sides:
            if side.model == name and side.runner is not None:
                runner, refusal = _built(side, config)
                if runner is None:
                    row = {"nprocs": job.nprocs, "model": name, "side": side.name, "refused": refusal}
                    rows.append(row)
                    if emit is not None:
                        emit("row", row)
                else:
                    runners.append(runner)
        for runner in runners:  # step 1 on the same weights and batch: the loss check
            runner.step()
        for round_index in range(config.rounds if runners else 0):
            shift = round_index % len(runners)
            for runner in runners[shift:] + runners[:shift]:
                for _ in range(config.warmup):
                    runner.step()
                dist.barrier()
                started_s = time.perf_counter()
                for _ in range(config.steps):
                    runner.step()
                dist.barrier()
                step_s = _max_over_ranks(time.perf_counter() - started_s) / config.steps
                row = {"nprocs": job.nprocs, "model": name, "side": runner.side.name, "round": round_index,
                       "step_s": step_s, "first_loss": runner.first_loss}
                rows.append(row)
                if emit is not None:
                    emit("row", row)
    return rows


def summarize(job: WorldJob, rows: list[dict], *, busy: bool) -> list[dict]:
    """One entry per planned side: predicted, measured median [min-max] over rounds,
    error %, and per model whether the first-step losses agree."""
    table = []
    for name in job.config.models:
        mine = [side for side in job.sides if side.model == name]
        losses = [row["first_loss"] for row in rows if row["model"] == name and "first_loss" in row]
        agree = bool(losses) and max(losses) - min(losses) <= LOSS_TOLERANCE
        for side in mine:
            times = [row["step_s"] for row in rows if row["model"] == name and row["side"] == side.name
                     and "step_s" in row]
            refusals = [row["refused"] for row in rows if row["model"] == name and row["side"] == side.name
                        and "refused" in row]
            measured = statistics.median(times) if times else None
            table.append({"busy": busy, "nprocs": job.nprocs, "model": name, "plan": side.name, "kind": side.plan,
                          "runner": side.runner, "mesh": "x".join(map(str, side.mesh_shape)),
                          "predicted_ms": side.predicted_s * 1e3,
                          "measured_ms": None if measured is None else measured * 1e3,
                          "min_ms": min(times) * 1e3 if times else None, "max_ms": max(times) * 1e3 if times else None,
                          "error_pct": None if measured is None else (side.predicted_s - measured) / measured * 100,
                          "rounds": len(times), "losses_agree": agree, "detail": side.detail,
                          "refused": refusals[0] if refusals else None,
                          "breakdown": side.breakdown})
    return table
