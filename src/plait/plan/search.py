"""The search: every valid layout of a model on a cluster, priced, filtered by memory,
ranked by step time, and the reasons.

Enumerated: tp and pp over the divisors of the device count (dp = devices / (tp·pp)),
the micro-batch b over the divisors of B/dp up to ``max_micro_batch`` (m = B/(dp·b)),
the schedule (none at pp = 1; gpipe, 1f1b, interleaved_1f1b with v in ``virtual_choices``,
zero_bubble and chimera otherwise, each priced from plait's own schedule replayed:
``plait.plan.pipeline``), sequence parallelism (tp > 1), full recomputation, ZeRO stage (0 at dp = 1;
0-1 with pp > 1; 0-3 otherwise). Any of them may be fixed (``PlanRequest``); the rest
are searched under that constraint. Every layout breaking a rule or the memory limit
is counted against each of its values, so the explanation can say, for each choice
of the winner, what the best alternative value costs or which constraint removed it.

Stages: a transformer's blocks are alike, so its chunks are the min-max split of the
layer times; an uneven model (a traced module) with one chunk per rank is split by
Alpa's DP on the very objective the estimate prices, Σ t_s + (m-1)·max t_s.

Bounds: the grid of (tp, pp) families and their micro-batch sizes is counted before
anything is priced; beyond ``max_layouts`` priced layouts ``plait.plan.grid`` thins
it in a fixed order and ``PlanResult.pruning`` says what went and how many layouts
were not priced. Only the ``top`` best plans are held (a heap), with the tallies (one
per value of each dimension); the caches live per tp. One layout's price is bounded
by the model's layers (pipeline time in closed form, collectives priced per group
footprint, never per rank), not by the micro-batch count or the device count.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from plait.names.schedules import INTERLEAVED_1F1B, NO_PIPELINE, ONE_F_ONE_B, PIPELINE_SCHEDULES
from plait.plan.cluster import MAX_DEVICES, Cluster
from plait.plan.estimate import Estimate, alpa_split, combine, estimate, split_groups, summarize
from plait.plan.layout import MESH_ORDERS, SCHEDULES, Layout, layout_problems
from plait.plan.precision import PRECISIONS, precision_for
from plait.plan.grid import (DEFAULT_MAX_LAYOUTS, Family, Pruning, divisors, enumerate_families, fit_budget,
                             variant_choices)
from plait.names.axes import DEFAULT_ORDER
from plait.names.precision import BF16_MIXED
from plait.plan.layers import RECOMPUTE_MODES
from plait.plan.transformer import ACCOUNTINGS

__all__ = ["PlanRequest", "PlanResult", "PlanError", "search", "DIMENSIONS"]

GIB = 1 << 30
# Beyond these a request is a mistake, not a plan: the search enumerates the divisors of
# the global batch, and keeps and prints ``top`` plans.
MAX_GLOBAL_BATCH = 1 << 32
MAX_MICRO_BATCH = 1 << 16
MAX_TOP = 10_000
# The search prices every layer (group) of the model per layout family; real models have a few hundred.
MAX_LAYER_GROUPS = 1 << 16
DIMENSIONS = ("tp", "pp", "dp", "micro_batch", "schedule", "recompute", "zero_stage", "sequence_parallel")


class PlanError(ValueError):
    """No layout can run the request (the message says why and what would)."""


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan: the global batch (sequences per step) and, optionally, fixed
    choices. ``None`` means search it. The memory limit is ``memory_limit_bytes``, by
    default the device's memory less ``memory_reserve_fraction`` (10%: the CUDA
    context, communication buffers, allocator fragmentation and transient tensors the
    accounting leaves out). ``virtual`` alone implies the interleaved_1f1b schedule.
    ``max_layouts`` is the search budget: the most layouts priced (``plait.plan.grid``
    says what is cut beyond it; the default prices every preset search in full)."""

    global_batch: int
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    virtual: int | None = None
    recompute: str | None = None  # none | selective | full; None: searched
    zero_stage: int | None = None
    sequence_parallel: bool | None = None
    precision: str = BF16_MIXED
    accounting: str = "megatron"
    offload: bool = False  # plait train's --offload-activations (fixed, not searched)
    offload_optimizer: bool = False  # plait train's --offload optimizer (fixed, not searched)
    mesh_order: str = DEFAULT_ORDER  # plait train's --mesh-order (fixed, not searched)
    memory_limit_bytes: float | None = None
    memory_reserve_fraction: float = 0.1
    max_micro_batch: int = 32
    virtual_choices: tuple[int, ...] = (2, 4, 8)
    top: int = 5
    max_layouts: int = DEFAULT_MAX_LAYOUTS

    def __post_init__(self) -> None:
        problems = []

        def whole(key, value, allow_none=True, minimum=1):
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                problems.append(f"{key}={value!r} must be a whole number >= {minimum}")

        def at_most(key, value, most, fix):
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                problems.append(f"{key}={value:,} is above the limit of {most:,}: {fix}")

        whole("global_batch", self.global_batch, allow_none=False)
        at_most("global_batch", self.global_batch, MAX_GLOBAL_BATCH,
                "give the sequences per optimizer step (GPT-3 used 1,536)")
        for key in ("tp", "pp", "dp", "micro_batch", "virtual"):
            whole(key, getattr(self, key))
        whole("max_micro_batch", self.max_micro_batch, allow_none=False)
        at_most("max_micro_batch", self.max_micro_batch, MAX_MICRO_BATCH, f"use at most {MAX_MICRO_BATCH:,}")
        whole("top", self.top, allow_none=False)
        at_most("top", self.top, MAX_TOP, f"ask for at most {MAX_TOP:,} plans")
        whole("max_layouts", self.max_layouts, allow_none=False)
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.recompute is not None and (isinstance(self.recompute, bool)
                                           or self.recompute not in RECOMPUTE_MODES):
            problems.append(f"recompute={self.recompute!r} must be one of {', '.join(RECOMPUTE_MODES)} (or None: "
                            "searched)")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            problems.append(f"schedule={self.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision={self.precision!r} must be one of {', '.join(PRECISIONS)}")
        for key in ("offload", "offload_optimizer"):
            if not isinstance(getattr(self, key), bool):
                problems.append(f"{key}={getattr(self, key)!r} must be True or False")
        if self.accounting not in ACCOUNTINGS:
            problems.append(f"accounting={self.accounting!r} must be one of {', '.join(ACCOUNTINGS)}")
        if not (isinstance(self.memory_reserve_fraction, (int, float)) and 0 <= self.memory_reserve_fraction < 1):
            problems.append(f"memory_reserve_fraction={self.memory_reserve_fraction!r} must be in [0, 1)")
        if self.memory_limit_bytes is not None and not (isinstance(self.memory_limit_bytes, (int, float))
                                                        and self.memory_limit_bytes > 0):
            problems.append(f"memory_limit_bytes={self.memory_limit_bytes!r} must be > 0")
        if not self.virtual_choices or any(isinstance(v, bool) or not isinstance(v, int) or v < 2
                                           for v in self.virtual_choices):
            problems.append(f"virtual_choices={self.virtual_choices!r} must be whole numbers >= 2")
        if problems:
            raise ValueError("invalid plan request: " + "; ".join(problems))


@dataclass
class _Tally:
    """What happened to the layouts with one value of one dimension."""

    best: Estimate | None = None
    failures: Counter = field(default_factory=Counter)
    closest: Estimate | None = None  # the least memory among those over the limit


@dataclass
class PlanResult:
    """Ranked plans (best first) and the record of the search."""

    plans: list[Estimate]
    model_description: str
    cluster_description: str
    request: PlanRequest
    memory_limit_bytes: float
    peak_flops_per_s: float
    considered: int
    feasible: int
    eliminated: Counter
    tallies: dict[tuple[str, object], _Tally]
    search_time_s: float
    priced: int = 0                  # layouts priced (feasible + over memory)
    pruning: Pruning | None = None   # what the budget cut (pruning.pruned: something was)

    @property
    def best(self) -> Estimate:
        return self.plans[0]

    def as_json(self) -> list[dict]:
        """The stable list: one dict per plan, best first (keys in docs/plan.md)."""
        return [{"rank": i + 1, **plan.as_dict()} for i, plan in enumerate(self.plans)]


def dimension_value(layout: Layout, dimension: str):
    if dimension == "schedule":
        return layout.schedule + (f" v={layout.virtual}" if layout.schedule == INTERLEAVED_1F1B else "")
    return getattr(layout, dimension)


def search(model, cluster: Cluster, request: PlanRequest, *, suggest: bool = True) -> PlanResult:
    """Every layout of ``model`` on ``cluster`` for ``request``, ranked (see the module
    docstring), or, beyond ``request.max_layouts``, the thinned grid ``plait.plan.grid``
    chooses (``PlanResult.pruning`` says what was cut). Holds the ``request.top`` best
    plans and, per value of each dimension, its best and closest layout: never every
    priced one. Raises PlanError when none is valid or none fits in memory (with
    ``suggest``, naming the smallest bigger cluster that would fit)."""
    started = time.perf_counter()
    world = cluster.world_size
    precision = precision_for(request.precision, request.accounting)
    limit = request.memory_limit_bytes or cluster.device.memory_bytes * (1 - request.memory_reserve_fraction)
    batch = request.global_batch
    if model.num_groups > MAX_LAYER_GROUPS:
        raise PlanError(f"{model.num_groups:,} layers are above the planner's limit of {MAX_LAYER_GROUPS:,} (it "
                        f"prices every layer of every layout; the model: {model.describe()}): plan a model of at "
                        f"most {MAX_LAYER_GROUPS:,} layers")
    _check_fixed(model, world, request)
    families, pruning = fit_budget(enumerate_families(model, world, request), request.max_layouts)

    tallies: dict[tuple[str, object], _Tally] = {}
    eliminated: Counter = Counter()
    best = _TopPlans(request.top)
    considered = priced = 0

    def tally(layout: Layout, dimensions=DIMENSIONS) -> list[_Tally]:
        return [tallies.setdefault((d, dimension_value(layout, d)), _Tally()) for d in dimensions]

    def reject(layout: Layout, reason: str, dimensions=DIMENSIONS) -> None:
        eliminated[reason] += 1
        for entry in tally(layout, dimensions):
            entry.failures[reason] += 1

    # both keyed by tp first and the families come in tp order: a tp's entries are dropped with it
    groups_cache: dict = {}
    split_cache: dict = {}
    flops = {rc: (model.training_flops(batch, "none"), model.training_flops(batch, rc)) for rc in RECOMPUTE_MODES}

    def price_family(family: Family) -> bool:
        """Price (or reject) every layout of ``family``; False once the budget's stop is reached."""
        nonlocal considered, priced
        tp, pp, dp = family.tp, family.pp, family.dp
        shell = Layout(tp=tp, pp=pp, dp=dp, schedule=NO_PIPELINE if pp == 1 else ONE_F_ONE_B)
        if family.structural is not None:
            considered += 1
            reject(shell, _kind(family.structural), ("tp", "pp", "dp"))
            return True
        per_replica = batch // dp
        for mb in family.micro_batches:
            if per_replica % mb:
                considered += 1
                reject(replace(shell, micro_batch=mb), "micro-batch does not divide the per-replica batch",
                       ("tp", "pp", "dp", "micro_batch"))
                continue
            m = per_replica // mb
            sps, rcs, schedules, zeros = variant_choices(tp, pp, dp, request)
            for sp in sps:
                for rc in rcs:
                    key = (tp, mb, sp)
                    if key not in groups_cache:
                        groups_cache[key] = model.groups(mb, tp, sp, precision, request.accounting)
                    groups = groups_cache[key]
                    algorithms: dict = {}
                    summaries = summarize(groups, tp=tp, recompute=rc, cluster=cluster, dtype=precision.dtype,
                                          algorithms=algorithms)
                    for schedule, virtual in schedules:
                        for zero in zeros:
                            layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, num_microbatches=m,
                                            schedule=schedule, virtual=virtual, recompute=rc, zero_stage=zero,
                                            sequence_parallel=sp, offload=request.offload,
                                            offload_optimizer=request.offload_optimizer,
                                            mesh_order=request.mesh_order)
                            problems = layout_problems(layout, num_groups=model.num_groups, world_size=world,
                                                       global_batch=batch, tp_problem=None,
                                                       seq_len=getattr(model, "seq_len", None))
                            if not problems and pruning.stop_after is not None and priced >= pruning.stop_after:
                                return False
                            considered += 1
                            if problems:
                                reject(layout, _kind(problems[0]))
                                continue
                            priced += 1
                            uneven = getattr(model, "uneven", False) and virtual == 1 and pp > 1
                            split_key = (tp, mb, sp, rc, pp, virtual, m if uneven else None)
                            if split_key not in split_cache:
                                split = (alpa_split(summaries, layout, cluster) if uneven
                                         else split_groups(summaries, pp * virtual, pp))
                                split_cache[split_key] = (split, [combine([summaries[g] for g in indices])
                                                                  for indices in split])
                            result = estimate(groups, layout, cluster, precision, model_flops=flops[rc][0],
                                              hardware_flops=flops[rc][1],
                                              tied_embedding_params=model.tied_embedding_params(tp),
                                              end_modules=model.end_modules, summaries=summaries, split=split_cache[split_key][0],
                                              chunks=split_cache[split_key][1], algorithms=algorithms)
                            if result.memory_per_gpu_bytes > limit:
                                reject(layout, "exceeds memory")
                                for entry in tally(layout):
                                    if entry.closest is None or \
                                            result.memory_per_gpu_bytes < entry.closest.memory_per_gpu_bytes:
                                        entry.closest = result
                                continue
                            best.add(result)
                            for entry in tally(layout):
                                if entry.best is None or result.step_time_s < entry.best.step_time_s:
                                    entry.best = result
        return True

    current_tp = None
    for family in families:
        if family.tp != current_tp:
            groups_cache.clear()
            split_cache.clear()
            current_tp = family.tp
        if not price_family(family):
            break
    elapsed = time.perf_counter() - started
    if not best.count:
        raise PlanError(_no_plan_message(model, cluster, request, tallies, eliminated, limit, considered, suggest,
                                         pruning))
    return PlanResult(plans=best.ranked(), model_description=model.describe(),
                      cluster_description=cluster.describe(), request=request, memory_limit_bytes=limit,
                      peak_flops_per_s=cluster.device.peak(precision.dtype), considered=considered,
                      feasible=best.count, eliminated=eliminated, tallies=tallies, search_time_s=elapsed,
                      priced=priced, pruning=pruning)


class _TopPlans:
    """The ``top`` fastest estimates seen (ties: less memory, then the first seen),
    in a heap of at most ``top``, and how many were offered."""

    def __init__(self, top: int) -> None:
        self.top, self.count, self._heap = top, 0, []

    def add(self, result: Estimate) -> None:
        # the heap's root is the worst kept: the slowest, then the most memory, then the latest
        item = (-result.step_time_s, -result.memory_per_gpu_bytes, -self.count, result)
        self.count += 1
        if len(self._heap) < self.top:
            heapq.heappush(self._heap, item)
        else:
            heapq.heappushpop(self._heap, item)

    def ranked(self) -> list[Estimate]:
        return [item[3] for item in sorted(self._heap, key=lambda item: (-item[0], -item[1], -item[2]))]


def _kind(problem: str) -> str:
    """A problem message without its particular values, to count alike ones together."""
    rules = (("does not divide heads", "tp does not divide the attention heads"),
             ("does not divide ffn", "tp does not divide the MLP width"),
             ("no tensor-parallel split", "traced module has no tensor parallelism"),
             ("exceeds the model", "pp exceeds the layers"),
             ("chunks exceed", "pp x virtual exceeds the layers"),
             ("not divisible by dp", "global batch not divisible by dp"),
             ("multiple of pp", f"{INTERLEAVED_1F1B} needs micro-batches a multiple of pp"),
             ("even number of pipeline ranks", "chimera needs an even pp"),
             ("even number of microbatches", "chimera needs an even number of micro-batches"),
             ("built by list scheduling", "chimera/zero_bubble priced up to pp=8"),
             ("replayed at m itself", "chimera built up to 2·m·pp = 256 computations"),
             ("shards gradients", "ZeRO 2/3 with a pipeline"),
             ("sequence_parallel splits", "seq_len not divisible by tp"))
    for needle, kind in rules:
        if needle in problem:
            return kind
    return problem


def _check_fixed(model, world: int, request: PlanRequest) -> None:
    """Reject fixed degrees that no layout can honour, naming the rule broken."""
    problems = []
    if request.mesh_order not in MESH_ORDERS:
        problems.append(f"mesh_order={request.mesh_order!r} must be one of {', '.join(MESH_ORDERS)} (the plan "
                        "prices tp groups as consecutive ranks)")
    for key in ("tp", "pp", "dp"):
        value = getattr(request, key)
        if value is not None and world % value:
            problems.append(f"{key}={value} does not divide the {world} devices (valid {key}: "
                            f"{', '.join(map(str, divisors(world)))})")
    fixed = {k: getattr(request, k) for k in ("tp", "pp", "dp") if getattr(request, k) is not None}
    product = math.prod(fixed.values())
    if len(fixed) == 3 and product != world:
        problems.append(f"tp({request.tp}) * pp({request.pp}) * dp({request.dp}) = {product} != devices({world})")
    elif len(fixed) == 2 and world % product:
        names = " * ".join(f"{k}({v})" for k, v in fixed.items())
        problems.append(f"{names} = {product} does not divide the {world} devices: the third degree would not be "
                        "a whole number")
    if request.tp is not None:
        problem = model.tensor_parallel_problem(request.tp)
        if problem:
            problems.append(problem)
    if request.pp is not None and request.pp > model.num_groups:
        problems.append(f"pp={request.pp} exceeds the model's {model.num_groups} layers (each stage needs one)")
    if request.dp is not None and request.global_batch % request.dp:
        problems.append(f"global batch {request.global_batch} is not divisible by dp={request.dp}")
    if request.schedule is not None and request.pp is not None:
        if request.pp == 1 and request.schedule != NO_PIPELINE:
            problems.append(f"schedule={request.schedule!r} needs pp > 1")
        if request.pp > 1 and request.schedule == NO_PIPELINE:
            problems.append(f"pp={request.pp} needs a pipeline schedule ({', '.join(PIPELINE_SCHEDULES)})")
    if request.virtual is not None:
        if request.schedule not in (None, INTERLEAVED_1F1B):
            problems.append(f"virtual={request.virtual} is only for --schedule {INTERLEAVED_1F1B}")
        if request.virtual < 2:
            problems.append(f"virtual={request.virtual}: interleaving needs at least 2 model chunks per pipeline "
                            "rank (with 1, use --schedule 1f1b)")
        if request.pp == 1:
            problems.append(f"virtual={request.virtual} interleaves a pipeline; pp=1 has none")
        if request.pp is not None and request.pp * request.virtual > model.num_groups:
            problems.append(f"pp({request.pp}) * virtual({request.virtual}) = {request.pp * request.virtual} chunks "
                            f"exceed the model's {model.num_groups} layers")
    if request.schedule == INTERLEAVED_1F1B and request.pp == 1:
        problems.append(f"schedule={INTERLEAVED_1F1B!r} needs pp > 1")
    if request.micro_batch is not None:
        dps = [request.dp] if request.dp is not None else [d for d in divisors(world)
                                                         if request.global_batch % d == 0]
        if not any(request.global_batch % (d * request.micro_batch) == 0 for d in dps):
            valid = sorted({b for d in dps for b in divisors(request.global_batch // d)})
            problems.append(f"micro_batch={request.micro_batch} divides no per-replica batch (global batch "
                            f"{request.global_batch} / dp); valid micro-batches: {', '.join(map(str, valid))}")
    if request.sequence_parallel and request.tp == 1:
        problems.append("sequence parallelism needs tp > 1")
    if problems:
        raise PlanError("; ".join(problems))


def _no_plan_message(model, cluster: Cluster, request: PlanRequest, tallies, eliminated: Counter, limit: float,
                     considered: int, suggest: bool, pruning: Pruning | None = None) -> str:
    if pruning is None or not pruning.pruned:
        return _no_plan_reason(model, cluster, request, tallies, eliminated, limit, considered, suggest)
    # the budget left layouts unpriced: one of them may fit here, so no bigger cluster is suggested
    return (_no_plan_reason(model, cluster, request, tallies, eliminated, limit, considered, False, priced_only=True)
            + f" ({pruning.text()})")


def _no_plan_reason(model, cluster: Cluster, request: PlanRequest, tallies, eliminated: Counter, limit: float,
                    considered: int, suggest: bool, priced_only: bool = False) -> str:
    closest = None
    for entry in tallies.values():
        if entry.closest is not None and (closest is None or
                                          entry.closest.memory_per_gpu_bytes < closest.memory_per_gpu_bytes):
            closest = entry.closest
    head = (f"no {'priced ' if priced_only else ''}layout of {model.describe()} runs on {cluster.describe()} "
            f"with global batch {request.global_batch}")
    if closest is None:
        reasons = "; ".join(f"{count} x {reason}" for reason, count in eliminated.most_common())
        return f"{head}: all {considered} layouts break a rule ({reasons})"
    need = closest.memory_per_gpu_bytes
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in closest.memory_bytes.items())
    message = (f"{head}: the layout needing the least memory ({closest.layout.text()}) needs {need / GIB:.1f} GiB "
               f"per device ({parts} GiB), {(need - limit) / GIB:.1f} GiB more than the {limit / GIB:.1f} GiB "
               f"available")
    suggestion = _what_would_fit(model, cluster, request) if suggest else ""
    return message + ("; " + suggestion if suggestion else "")


def _what_would_fit(model, cluster: Cluster, request: PlanRequest) -> str:
    """The smallest multiple of the node count (doubling, up to 64x) on which some
    layout fits the same global batch."""
    if cluster.name == "local":
        return "give the processes more memory, or a smaller model"
    tried = 1
    for factor in (2, 4, 8, 16, 32, 64):
        if cluster.world_size * factor > MAX_DEVICES:
            break
        tried = factor
        bigger = replace(cluster, nodes=cluster.nodes * factor, _cache={})
        try:
            result = search(model, bigger, replace(request, top=1, dp=None), suggest=False)
        except PlanError:
            continue
        return (f"{bigger.world_size} devices ({bigger.nodes} nodes) would fit it, e.g. "
                f"{result.best.layout.text()} at {result.best.memory_per_gpu_bytes / GIB:.1f} GiB per device")
    if tried == 1:
        return (f"no bigger cluster is within the {MAX_DEVICES:,}-device limit: use a smaller model or devices "
                "with more memory")
    return f"not even {tried}x the devices fit it: use a smaller model or devices with more memory"
