"""The auto-parallel planner (Alpa's intra-operator pass): trace the training step,
enumerate every operator's sharding strategies on each candidate device mesh, solve the
ILP per mesh, keep the fastest plan that fits, and say why (the alternatives' costs).

    traced = trace_graph(model, example_inputs); graph = simplify(traced.graph)
    for mesh in meshes:   strategies_v = node_strategies(v, graph, mesh, cluster)
                          c*(mesh) = argmin_c T(c)  s.t.  sum_v memory(c_v) <= limit   (ilp.solve)
    plan = argmin_mesh T(c*(mesh))

T(c) is ``plan_cost``'s sum: compute + the operators' own collectives + the reshards on
every edge (the ILP's objective, recomputed here from the strategies so the two are
checked against each other). The default meshes are every 1-D and 2-D factorisation of
the cluster: (p,) and (a, b) with a·b = p, a, b >= 2 (axis 1 the inner one: consecutive
ranks, inside a node when it fits). A mesh smaller than the cluster is refused (plan a
smaller cluster instead).

The alternatives: the best plan on every other mesh; two baselines priced by the same
model, "all replicated" (every operator unsharded on every device: one device's step)
and "data parallel" (the best plan on the 1-D mesh with every parameter replicated:
batch-sharded activations, gradients all-reduced); and per operator group its deciding
node (the one of most compute with a choice) re-solved without its chosen strategy:
the runner-up and how much slower it is (after ``max_resolves`` groups or
RESOLVE_BUDGET_S seconds of re-solves, the cheaper "others held" bound: only that node
changed; a group repeating an earlier one up to layer numbers with the same choice is
counted on the earlier one's entry, not solved again).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from plait.names.placements import REPLICATE
from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.node_layout import NodeLayout
from plait.parallel.auto.opgraph import OpGraph
from plait.parallel.auto.trace import simplify as simplify_graph, trace_graph
from plait.plan.auto.auto_plan import AutoPlan, Baseline, EdgeReshard, MeshOutcome, name_pattern, operator_groups, \
    PlanCost, RunnerUp
from plait.plan.auto.ilp import plan_objective, solve
from plait.plan.auto.reshard_cost import FORWARD, reshard_steps, reshard_time_s
from plait.plan.auto.stages import auto_stages
from plait.plan.auto.strategies import graph_strategies
from plait.plan.auto.strategy import Strategy

__all__ = ["auto_plan", "micro_batch", "plan_cost", "edge_reshards", "default_mesh_shapes", "node_layouts",
           "ALL_REPLICATED", "DATA_PARALLEL"]

ALL_REPLICATED = "all replicated"
DATA_PARALLEL = "data parallel"
DEFAULT_TIME_LIMIT_S = 60.0
RESOLVE_TIME_LIMIT_S = 10.0  # per runner-up re-solve
MAX_RESOLVES = 24  # groups whose runner-up is re-solved; the rest get the "others held" bound
RESOLVE_BUDGET_S = 20.0  # seconds of runner-up re-solves in all, then the "others held" bound


def default_mesh_shapes(world_size: int) -> list[tuple[int, ...]]:
    """(p,) then every (a, b), a·b = p, a, b >= 2, a ascending."""
    shapes: list[tuple[int, ...]] = [(world_size,)]
    shapes += [(a, world_size // a) for a in range(2, world_size) if world_size % a == 0 and world_size // a >= 2]
    return shapes


def _check_mesh_shapes(mesh_shapes, world_size: int) -> list[tuple[int, ...]]:
    shapes = [tuple(shape) for shape in mesh_shapes]
    if not shapes:
        raise ValueError("mesh_shapes is empty: give at least one, e.g. [(4,)] or [(2, 2)]")
    for shape in shapes:
        mesh = AutoMesh(shape)  # checks 1 or 2 whole numbers
        if mesh.size != world_size:
            raise ValueError(f"mesh {mesh.text()} has {mesh.size} devices; the cluster has {world_size}: give a mesh "
                             f"of {world_size} devices (or plan a cluster of {mesh.size})")
    return shapes


def plan_cost(graph: OpGraph, choice: dict[str, Strategy], mesh: AutoMesh, cluster) -> PlanCost:
    """T(c) split into compute, the strategies' own collectives and the reshards on every
    edge (math.inf where a reshard is impossible), and memory = sum of the strategies'
    (``plait.plan.auto.ilp.plan_objective``: the ILP's objective, one definition)."""
    missing = [node.name for node in graph.nodes if node.name not in choice]
    if missing:
        raise ValueError(f"the choice has no strategy for nodes {missing[:5]}")
    compute_s, comm_s, reshard_s, memory_bytes = plan_objective(graph, choice, mesh, cluster)
    return PlanCost(compute_s=compute_s, comm_s=comm_s, reshard_s=reshard_s, memory_bytes=memory_bytes)


def edge_reshards(graph: OpGraph, choice: dict[str, Strategy], mesh: AutoMesh, cluster) -> tuple[EdgeReshard, ...]:
    """Every edge's reshard under ``choice``: seconds and forward collectives ("all_gather@1")."""
    found = []
    for source, target, position in graph.edges():
        produced = graph.node(source)
        src, dst = choice[source].output, choice[target].inputs[position]
        seconds = reshard_time_s(src, dst, produced.shape, produced.itemsize, mesh, cluster)
        collectives = ()
        if src != dst and math.isfinite(seconds):
            steps = reshard_steps(src, dst, produced.shape, produced.itemsize, mesh, cluster)
            collectives = tuple(f"{step.collective}@{step.axis}" for step in steps if step.direction == FORWARD)
        found.append(EdgeReshard(source, target, position, seconds, collectives))
    return tuple(found)


def node_layouts(choice: dict[str, Strategy]) -> dict[str, NodeLayout]:
    """The executor's layouts of a choice: per node its inputs', output's and parameters' layouts."""
    return {name: NodeLayout(inputs=strategy.inputs, output=strategy.output, params=strategy.params)
            for name, strategy in choice.items()}


def _all_replicated(strategy: Strategy) -> bool:
    layouts = [strategy.output, *strategy.inputs, *(layout for _, layout in strategy.params)]
    return all(placement == REPLICATE for layout in layouts for placement in layout)


def _params_replicated(strategy: Strategy) -> bool:
    return all(placement == REPLICATE for _, layout in strategy.params for placement in layout)


def _solved_cost(graph, result, mesh, cluster) -> PlanCost | None:
    if len(result.choice) != len(graph.nodes):  # infeasible or no solution in the time limit
        return None
    return plan_cost(graph, result.choice, mesh, cluster)


def _baselines(graph, cluster, time_limit_s: float, pricing: dict) -> tuple[Baseline, ...]:
    """All replicated (each node's cheapest all-"R" strategy) and data parallel (the
    ILP on (p,) over the strategies whose parameters are replicated), unconstrained in
    memory (the report sets their memory against the limit)."""
    mesh = AutoMesh((cluster.world_size,))
    strategies = graph_strategies(graph, mesh, cluster, **pricing)
    replicated = {}
    for name, options in strategies.items():
        candidates = [s for s in options if _all_replicated(s)]
        if not candidates:
            raise AssertionError(f"node {name!r} has no all-replicated strategy (node_strategies must give one)")
        replicated[name] = min(candidates, key=lambda s: s.compute_s + s.comm_s)
    baselines = [Baseline(ALL_REPLICATED, "every operator unsharded on every device", mesh.shape,
                          plan_cost(graph, replicated, mesh, cluster))]
    dp_strategies = {name: [s for s in options if _params_replicated(s)] for name, options in strategies.items()}
    result = solve(graph, dp_strategies, mesh, cluster, memory_limit_bytes=None, time_limit_s=time_limit_s)
    description = f"every parameter replicated, the best activation layouts on the {mesh.text()} mesh"
    baselines.append(Baseline(DATA_PARALLEL, description, mesh.shape, _solved_cost(graph, result, mesh, cluster)))
    return tuple(baselines)


def _deciding_node(graph, names, choice, strategies) -> str | None:
    """The node of the group with a choice (several strategies) and the most compute."""
    options = [name for name in names if len(strategies[name]) > 1]
    return max(options, key=lambda name: choice[name].compute_s, default=None)


def _runner_ups(graph, choice, strategies, mesh, cluster, best: PlanCost, limit, *, max_resolves: int,
                time_limit_s: float, budget_s: float) -> tuple[RunnerUp, ...]:
    """Per operator group, its deciding node re-solved without its chosen strategy (at
    most ``max_resolves`` solves and ``budget_s`` seconds of them; then "others held");
    a group named like an earlier one up to numbers, its node choosing alike, is counted
    on the earlier one's entry (``alike``) instead."""
    found: list[RunnerUp] = []
    seen: dict[tuple[str, str], int] = {}
    resolved, started = 0, time.perf_counter()
    for group, names in operator_groups(graph):
        node = _deciding_node(graph, names, choice, strategies)
        if node is None:
            continue
        chosen = choice[node]
        pattern = (name_pattern(group), name_pattern(node), graph.node(node).kind, chosen.name)
        if pattern in seen:
            index = seen[pattern]
            found[index] = replace(found[index], alike=found[index].alike + 1)
            continue
        seen[pattern] = len(found)
        others = [s for s in strategies[node] if s != chosen]
        if resolved < max_resolves and time.perf_counter() - started < budget_s:
            resolved += 1
            try:
                result = solve(graph, {**strategies, node: others}, mesh, cluster, memory_limit_bytes=limit,
                               time_limit_s=time_limit_s)
                cost = _solved_cost(graph, result, mesh, cluster)
            except ValueError:  # no plan without the chosen strategy fits the memory limit
                cost = None
            if cost is None:
                found.append(RunnerUp(group, node, chosen.name, None, None, "re-solved"))
            else:
                found.append(RunnerUp(group, node, chosen.name, result.choice[node].name,
                                      cost.step_time_s - best.step_time_s, "re-solved"))
            continue
        priced = [(plan_cost(graph, {**choice, node: other}, mesh, cluster), other) for other in others]
        fitting = [(cost, other) for cost, other in priced if limit is None or cost.memory_bytes <= limit]
        if not fitting:
            found.append(RunnerUp(group, node, chosen.name, None, None, "others held"))
            continue
        cost, other = min(fitting, key=lambda item: item[0].step_time_s)
        found.append(RunnerUp(group, node, chosen.name, other.name, cost.step_time_s - best.step_time_s,
                              "others held"))
    return tuple(found)


def micro_batch(example_inputs: tuple, microbatches: int) -> tuple:
    """The first of ``microbatches`` equal slices of the inputs' batch (dim 0)."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be a whole number >= 1")
    batch = example_inputs[0].shape[0]
    if batch % microbatches:
        raise ValueError(f"microbatches={microbatches} does not divide the batch of {batch}: give a divisor of "
                         f"{batch} (or a batch divisible by {microbatches})")
    size = batch // microbatches
    return tuple(t[:size] if t.dim() >= 1 and t.shape[0] == batch else t for t in example_inputs)


def auto_plan(model, example_inputs, cluster, *, mesh_shapes=None, memory_limit_bytes: float | None = None,
              simplify: bool = True, time_limit_s: float = DEFAULT_TIME_LIMIT_S, max_resolves: int = MAX_RESOLVES,
              microbatches: int | None = None, dtype: str | None = None,
              optimizer_state_bytes_per_param: float | None = None, traced=None) -> AutoPlan:
    """Plan ``model`` (``model(*example_inputs)`` returns the scalar loss; dim 0 of the
    inputs is the batch) on ``cluster``: see the module doc. ``memory_limit_bytes``
    defaults to the cluster device's memory; ``time_limit_s`` bounds each mesh's solve.
    ``traced``: an already traced graph (``trace_graph``'s result) to skip the trace.
    ``microbatches``: also run Alpa's inter-operator pass (``plait.plan.auto.stages``:
    pipeline stages on sub-meshes, each priced by the ILP) on the step traced on one of
    that many micro-batches; its StageSearch is ``AutoPlan.stages``, apart from the
    intra-operator plan (whose layouts are the ones executed). ``dtype`` (the compute
    dtype priced; default each node's) and ``optimizer_state_bytes_per_param`` (default
    Adam's 2 states in the parameter's dtype; 12 for mixed precision, 0 for SGD) go to
    ``plait.plan.auto.strategies.graph_strategies``."""
    pricing = {"dtype": dtype, "optimizer_state_bytes_per_param": optimizer_state_bytes_per_param}
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    shapes = _check_mesh_shapes(mesh_shapes if mesh_shapes is not None else default_mesh_shapes(cluster.world_size),
                                cluster.world_size)
    limit = cluster.device.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
    if not (isinstance(limit, (int, float)) and limit > 0):
        raise ValueError(f"memory_limit_bytes={memory_limit_bytes!r} must be a number > 0 (bytes per device)")
    micro = None if microbatches is None else micro_batch(example_inputs, microbatches)  # checked before tracing
    traced = trace_graph(model, example_inputs) if traced is None else traced
    graph = simplify_graph(traced.graph) if simplify else traced.graph
    outcomes, solved, strategies_by_mesh = [], {}, {}
    for shape in shapes:
        mesh = AutoMesh(shape)
        strategies = graph_strategies(graph, mesh, cluster, **pricing)
        strategies_by_mesh[shape] = strategies
        started = time.perf_counter()
        try:
            result = solve(graph, strategies, mesh, cluster, memory_limit_bytes=limit, time_limit_s=time_limit_s)
        except ValueError as error:  # the ILP says why no plan fits (memory) on this mesh
            outcomes.append(MeshOutcome(shape, None, time.perf_counter() - started, math.inf, str(error)))
            continue
        cost = _solved_cost(graph, result, mesh, cluster)
        outcomes.append(MeshOutcome(shape, cost, result.solve_s, result.gap, result.status))
        if cost is not None and math.isfinite(cost.step_time_s):
            solved[shape] = (result, cost)
    if not solved:
        raise ValueError("no plan on any mesh: " + "; ".join(f"{AutoMesh(o.mesh_shape).text()}: {o.status}"
                                                              for o in outcomes))
    best_shape = min(solved, key=lambda shape: solved[shape][1].step_time_s)
    result, cost = solved[best_shape]
    mesh = AutoMesh(best_shape)
    outcome = next(o for o in outcomes if o.mesh_shape == best_shape)
    choice = dict(result.choice)
    runner_ups = _runner_ups(graph, choice, strategies_by_mesh[best_shape], mesh, cluster, cost, limit,
                             max_resolves=max_resolves, time_limit_s=min(time_limit_s, RESOLVE_TIME_LIMIT_S),
                             budget_s=RESOLVE_BUDGET_S)
    stages = None
    if microbatches is not None:
        micro_graph = trace_graph(model, micro).graph
        stages = auto_stages(simplify_graph(micro_graph) if simplify else micro_graph, cluster,
                             microbatches=microbatches, memory_limit_bytes=limit, dtype=dtype,
                             time_limit_s=min(time_limit_s, RESOLVE_TIME_LIMIT_S))
    return AutoPlan(graph=graph, mesh=mesh, stages=stages, choice=choice, layouts=node_layouts(choice), cost=cost,
                    edges=edge_reshards(graph, choice, mesh, cluster), simplified=simplify,
                    solve_s=outcome.solve_s, gap=outcome.gap, status=outcome.status, meshes=tuple(outcomes),
                    baselines=_baselines(graph, cluster, time_limit_s, pricing), runner_ups=runner_ups,
                    cluster_description=cluster.describe(), memory_limit_bytes=limit,
                    model_description=f"{type(model).__name__}: {len(traced.graph.nodes)} operators traced, "
                                      f"{len(graph.nodes)} after simplification")
