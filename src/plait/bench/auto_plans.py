"""The plans ``plait bench auto`` measures side by side, each priced by plait's cost
model before it runs (plait.bench.auto runs them).

For one model (``model(*inputs)`` -> scalar loss) on a cluster of p processes:

- ``auto``: plait's auto-parallel planner (``plait.plan.auto.planner.auto_plan``): the
  intra-operator ILP on every mesh shape of p devices ((p,) and each (a, b)), the
  fastest predicted; run by plait's auto executor (``plait.parallel.auto.execute``).
- ``data-parallel``: the same ILP on the (p,) mesh restricted to the strategies that
  keep every parameter replicated and, for a heavy operator, split its activations
  (batch, or another dim of them): the batch split, the parameters' gradients
  all-reduced, no operator computed whole on every device; run by the auto executor.
- ``single:<style>``: the best "every operator of one family" plan: for each style a
  heavy operator (linear, matmul, conv, embedding) offers on the (p,) mesh (``batch``,
  ``column``, ``row``, ``batch0`` of a batched matmul, ...), every heavy operator that
  offers it is held to it (one that does not keeps all its strategies), the other
  operators chosen by the ILP around them; the style whose plan is predicted fastest.
  Run by the auto executor.
- ``knob``: plait's knob search (``plait.plan.search``, what ``plait plan --module``
  runs) over dp x pp x micro-batch for the model traced layer by layer
  (``pipeline_layers()``, ``plait.plan.trace.describe_layers``), ZeRO 0, no
  recomputation, tp = 1 (a traced module has no tensor-parallel split). Its best plan
  at pp = 1 runs as plait's ``DataParallel`` with its micro-batches accumulated; a
  better plan at pp > 1, if the search finds one, is reported with its prediction,
  not run (a pipeline of these models is not wired into this benchmark).

Predicted step time: the auto planner's objective (compute + the strategies'
collectives + the reshards on the edges, forward and backward) for the first three;
the knob search's step time (compute, dp all-reduce, optimizer) for the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from plait.names.placements import REPLICATE
from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.trace import trace_graph
from plait.plan import ModuleModel, PlanError, PlanRequest, search
from plait.plan.auto.ilp import solve
from plait.plan.auto.planner import auto_plan, node_layouts, plan_cost
from plait.plan.auto.strategies import node_strategies
from plait.plan.trace import describe_layers

__all__ = ["AUTO", "DATA_PARALLEL", "SINGLE", "KNOB", "RUN_AUTO", "RUN_DP", "HEAVY_KINDS", "PlannedSide",
           "plan_sides", "matmul_shapes"]

AUTO, DATA_PARALLEL, SINGLE, KNOB = "auto", "data-parallel", "single", "knob"
RUN_AUTO = "auto-executor"  # plait.parallel.auto.execute.AutoParallelModule on the side's layouts
RUN_DP = "plait-dp"  # plait.parallel.DataParallel, micro-batches accumulated
HEAVY_KINDS = ("linear", "matmul", "conv", "embedding")
SINGLE_PREFIX = "single:"


@dataclass(frozen=True)
class PlannedSide:
    """One plan of one model: ``name`` (auto, data-parallel, single:<style>, knob),
    ``plan`` (which comparison: AUTO, DATA_PARALLEL, SINGLE, KNOB), ``runner`` (RUN_AUTO,
    RUN_DP, or None: priced, not run), its ``mesh_shape``, the executor's ``layouts``
    (node name -> NodeLayout; RUN_AUTO only), ``micro_batches`` (RUN_DP: accumulated
    per step), ``predicted_s`` (per step) with its ``breakdown`` (seconds and bytes) and
    ``detail`` (what it chose)."""

    model: str
    name: str
    plan: str
    runner: str | None
    mesh_shape: tuple[int, ...]
    predicted_s: float
    detail: str
    layouts: dict | None = None
    micro_batches: int = 1
    breakdown: dict = field(default_factory=dict)


def styles(strategy_name: str) -> tuple[str, ...]:
    """"batch@0,column@1" -> ("batch", "column"); "replicated" -> ()."""
    return tuple(part.split("@")[0] for part in strategy_name.split(",") if "@" in part)


def _params_replicated(strategy) -> bool:
    return all(placement == REPLICATE for _, layout in strategy.params for placement in layout)


def matmul_shapes(graph, world_size: int, most: int = 24) -> list[tuple[int, int, int]]:
    """The (m, n, k) products of the graph's linear and matmul nodes, whole and with each
    of m, n, k split p ways (what their shards run): the shapes this CPU's rate is
    measured at (``plait.plan.device.measure_device``), at most ``most``."""
    shapes = []
    for node in graph.nodes:
        if node.kind not in ("linear", "matmul") or len(node.shape) < 2 or not node.inputs:
            continue
        m = math.prod(node.shape[-2 if node.kind == "matmul" else 0:-1])
        n = node.shape[-1]
        k = graph.node(node.inputs[0]).shape[-1]
        for shape in ((m, n, k), (m // world_size, n, k), (m, n // world_size, k), (m, n, k // world_size)):
            if min(shape) >= 1 and shape not in shapes:
                shapes.append(shape)
    return shapes[:most]


def _cost_dict(cost) -> dict:
    return {"compute_s": cost.compute_s, "comm_s": cost.comm_s, "reshard_s": cost.reshard_s,
            "memory_bytes": cost.memory_bytes}


def _solve_side(model_name, name, plan, graph, strategies, mesh, cluster, detail, time_limit_s):
    """The ILP over ``strategies``, as a side run by the auto executor (None when no
    choice is feasible)."""
    result = solve(graph, strategies, mesh, cluster, memory_limit_bytes=None, time_limit_s=time_limit_s)
    if len(result.choice) != len(graph.nodes):
        return None
    cost = plan_cost(graph, result.choice, mesh, cluster)
    if not math.isfinite(cost.step_time_s):
        return None
    heavy = sorted({result.choice[node.name].name for node in graph.nodes if node.kind in HEAVY_KINDS})
    return PlannedSide(model=model_name, name=name, plan=plan, runner=RUN_AUTO, mesh_shape=mesh.shape,
                       predicted_s=cost.step_time_s, layouts=node_layouts(result.choice), breakdown=_cost_dict(cost),
                       detail=f"{detail}; heavy ops: {', '.join(heavy) or '-'}")


def single_strategy_sides(model_name, graph, mesh, cluster, strategies, time_limit_s) -> list[PlannedSide]:
    """One side per style some heavy operator offers (see the module doc), best first."""
    heavy = [node.name for node in graph.nodes if node.kind in HEAVY_KINDS]
    offered = sorted({style for name in heavy for strategy in strategies[name]
                      for style in styles(strategy.name) if len(styles(strategy.name)) == 1})
    sides = []
    for style in offered:
        held = dict(strategies)
        for name in heavy:
            own = [strategy for strategy in strategies[name] if styles(strategy.name) == (style,)]
            held[name] = own or strategies[name]
        side = _solve_side(model_name, SINGLE_PREFIX + style, SINGLE, graph, held, mesh, cluster,
                           f"every heavy op '{style}' where it can be", time_limit_s)
        if side is not None:
            sides.append(side)
    return sorted(sides, key=lambda side: side.predicted_s)


def knob_sides(model_name, model, inputs, cluster) -> list[PlannedSide]:
    """plait.plan.search's best dp x pp x micro-batch plan (ZeRO 0, no recomputation,
    fp32) for the model's pipeline layers: run as DataParallel when pp = 1; a better
    pp > 1 plan is listed first, priced only."""
    sample = inputs[0]
    batch = int(sample.shape[0])
    layers = describe_layers(model.pipeline_layers(), sample)
    itemsize = next(model.parameters()).element_size()
    traced = ModuleModel(name=model_name, layers=tuple(layers), traced_batch=batch, traced_element_bytes=itemsize)

    def best(**fixed):
        try:
            return search(traced, cluster, PlanRequest(global_batch=batch, tp=1, zero_stage=0, recompute="none",
                                                       precision="fp32", accounting="plait", top=1,
                                                       max_micro_batch=batch, **fixed)).best
        except PlanError:
            return None

    def side(estimate, runner):
        layout = estimate.layout
        return PlannedSide(model=model_name, name=KNOB if runner else f"{KNOB}:pp{layout.pp}", plan=KNOB,
                           runner=runner, mesh_shape=(cluster.world_size,), predicted_s=estimate.step_time_s,
                           micro_batches=layout.num_microbatches, breakdown=dict(estimate.time_s),
                           detail=f"dp {layout.dp} x pp {layout.pp}, micro-batch {layout.micro_batch} x "
                                  f"{layout.num_microbatches}, schedule {layout.schedule}")

    overall, flat = best(), best(pp=1)
    sides = [] if flat is None else [side(flat, RUN_DP)]
    if overall is not None and overall.layout.pp > 1:
        sides.insert(0, side(overall, None))
    return sides


def plan_sides(model_name: str, model, inputs, cluster, *, time_limit_s: float = 30.0,
               traced=None) -> list[PlannedSide]:
    """The sides of one model on ``cluster`` (its world size p): auto, data-parallel, the
    best single-strategy plan, the knob search's (see the module doc)."""
    traced = trace_graph(model, inputs) if traced is None else traced
    plan = auto_plan(model, inputs, cluster, traced=traced, time_limit_s=time_limit_s, max_resolves=0)
    meshes = ", ".join(f"{'x'.join(map(str, outcome.mesh_shape))}: "
                       + ("-" if outcome.cost is None else f"{outcome.cost.step_time_s * 1e3:.1f} ms")
                       for outcome in plan.meshes)
    heavy = sorted({plan.choice[node.name].name for node in plan.graph.nodes if node.kind in HEAVY_KINDS})
    sides = [PlannedSide(model=model_name, name=AUTO, plan=AUTO, runner=RUN_AUTO, mesh_shape=plan.mesh.shape,
                         predicted_s=plan.cost.step_time_s, layouts=dict(plan.layouts), breakdown=_cost_dict(plan.cost),
                         detail=f"meshes {meshes}; solve {plan.total_solve_s:.2f} s, gap {plan.gap:.1e}; heavy ops: "
                                f"{', '.join(heavy) or '-'}")]
    graph = plan.graph
    mesh = AutoMesh((cluster.world_size,))
    strategies = {node.name: node_strategies(node, graph, mesh, cluster) for node in graph.nodes}
    replicated = {}
    for node in graph.nodes:
        options = [s for s in strategies[node.name] if _params_replicated(s)]
        split = [s for s in options if styles(s.name)] if node.kind in HEAVY_KINDS else options
        replicated[node.name] = split or options
    dp = _solve_side(model_name, DATA_PARALLEL, DATA_PARALLEL, graph, replicated, mesh, cluster,
                     "every parameter replicated, every heavy op split over its activations", time_limit_s)
    sides += [dp] if dp is not None else []
    sides += single_strategy_sides(model_name, graph, mesh, cluster, strategies, time_limit_s)[:1]
    sides += knob_sides(model_name, model, inputs, cluster)
    return sides
