"""Alpa's inter-operator pass (OSDI '22, §5.2): cut a model's layers into pipeline
stages, give each stage a sub-mesh of the cluster and a logical mesh shape, and price
each (slice, sub-mesh) by the intra-operator ILP's optimum.

For L layers, m micro-batches and D devices, choose slices [i_s, j_s) covering the
layers in order and a sub-mesh per slice (its size n_s from ``submesh_options``, the
sizes summing to D; its logical shape (n,) or (a, b), a·b = n) minimising the
pipeline latency

    T = sum_s t_s + (m - 1) · max_s t_s,
    t_s = min over shapes of  ilp(slice_s, shape) + p2p_s,

where ilp(...) is ``plait.plan.auto.ilp.solve``'s objective for the slice's sub-graph
(``stage_graph.slice_graph``) traced on one micro-batch (per device, forward +
backward), and p2p_s prices the messages the stage sends: its output activations
forward and its input's gradient backward (``stage_graph.boundary_bytes``), split over
its n devices and sent in parallel (Alpa's cross-mesh resharding at its best), each a
``Cluster.p2p_time_s`` over the inter-node link when the sub-mesh fills whole nodes,
else the intra-node one. The DP is ``plait.plan.stages.alpa_partition`` (Alpa's caps,
exact on the table of t); with a memory limit it runs by depth: a stage with s stages
from it to the last keeps min(s, m) micro-batches of activations under 1F1B, so its ILP
runs with each operator's saved bytes counted min(s, m) times (parameters, gradients
and optimizer state once) against ``memory_limit_bytes``.

Sub-meshes (Alpa): 1, 2, 4, ... devices up to one node (a power of two dividing the
node; and the node itself), then k whole nodes, k = 1..nodes; on these sizes every set
summing to D tiles the cluster. Logical shapes of n devices: (n,) and each (a, n/a),
a, n/a >= 2.

What is approximated, to keep the slices cheap (L(L+1)/2 slices x shapes):
- each distinct slice is priced once: slices equal up to renaming (identical blocks:
  ``stage_graph.slice_signature``) share one ILP per (shape, in-flight count);
- ``exact=False`` (the default above ``EXACT_LAYERS`` layers) prices a slice as the sum
  of its layers' own ILP optima (so L ILPs per shape, or one per distinct layer): the
  reshards between two layers of a stage are left out (nil when consecutive blocks
  agree on the layout between them, as Megatron's replicated residual does), and the
  memory limit is checked on the sum of the layers' chosen plans instead of being a
  constraint of one ILP (a slice that would fit by trading time for memory is refused);
- boundary inputs arrive as the model's inputs do (batch dim 0 split or replicated),
  and a parameter two stages read (a tied embedding and head) is counted in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from plait.names.placements import local_shape
from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.opgraph import OpGraph
from plait.plan.auto.ilp import solve
from plait.plan.auto.stage_graph import (FIRST_LAYER, LAST_LAYER, Layer, boundary_bytes, graph_layers, slice_graph,
                                         slice_signature)
from plait.plan.auto.strategies import grad_nodes, node_strategies
from plait.plan.auto.strategies_work import saved_bytes
from plait.plan.stages import StagePlan, alpa_partition

__all__ = ["Stage", "StageSearch", "submesh_options", "logical_shapes", "stage_search", "auto_stages",
           "EXACT_LAYERS"]

EXACT_LAYERS = 8  # above this many layers a slice is priced as the sum of its layers (module docstring)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: layers [start, end) (``layer_names``), on a sub-mesh of
    ``devices`` devices laid out as ``mesh_shape``, taking ``time_s`` per micro-batch;
    ``memory_bytes`` per device (the ILP's sum, activations of its in-flight
    micro-batches included; None for a given price function)."""

    start: int
    end: int
    layer_names: tuple[str, ...]
    devices: int
    mesh_shape: tuple[int, ...]
    time_s: float
    memory_bytes: float | None = None


@dataclass(frozen=True)
class StageSearch:
    """The chosen stages, the pipeline latency T of ``microbatches`` micro-batches, and
    the best single-stage plan on all devices (pp = 1) for comparison (None when no
    shape of all devices is feasible); ``ilp_solves``: the ILPs solved (one per distinct
    slice, shape and in-flight count; 0 for a given price function)."""

    stages: tuple[Stage, ...]
    latency_s: float
    microbatches: int
    single_stage_latency_s: float | None
    plan: StagePlan
    ilp_solves: int = 0

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers per stage, in order (``stage_graph.graph_layers``' layers: the first and
        last layer count, as in ``plait.parallel.pipeline.split_layers(balance=...)``)."""
        return tuple(stage.end - stage.start for stage in self.stages)

    @property
    def stage_blocks(self) -> tuple[int, ...]:
        """Blocks per stage, the first and last layer (what runs before and after the
        blocks) not counted: plait train's --stage-layers for a transformer, when every
        stage holds a block and the stages' sub-meshes are equal (plait train runs one
        dp x tp grid per stage)."""
        return tuple(sum(name not in (FIRST_LAYER, LAST_LAYER) for name in stage.layer_names) for stage in self.stages)

    def describe(self) -> str:
        lines = [f"{len(self.stages)} stage(s), {self.microbatches} micro-batches: T = {self.latency_s:.6g} s"
                 + (f" (one stage on every device: {self.single_stage_latency_s:.6g} s)"
                    if self.single_stage_latency_s is not None else "")]
        for index, stage in enumerate(self.stages):
            names = stage.layer_names[0] if len(stage.layer_names) == 1 else \
                f"{stage.layer_names[0]}..{stage.layer_names[-1]}"
            lines.append(f"  stage {index}: layers {stage.start}..{stage.end - 1} ({names}) on "
                         f"{'x'.join(map(str, stage.mesh_shape))} devices: {stage.time_s:.6g} s per micro-batch")
        return "\n".join(lines)


def logical_shapes(devices: int) -> tuple[tuple[int, ...], ...]:
    """(n,) and every (a, n/a) with a, n/a >= 2, a ascending."""
    return ((devices,),) + tuple((a, devices // a) for a in range(2, devices) if devices % a == 0
                                 and devices // a >= 2)


def submesh_options(cluster) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Sub-mesh size -> its logical shapes, for Alpa's sub-meshes of ``cluster`` (module
    docstring): powers of two dividing a node, the node, then whole nodes."""
    per_node, nodes = cluster.devices_per_node, cluster.nodes
    sizes = {1 << k for k in range(per_node.bit_length()) if per_node % (1 << k) == 0}
    sizes |= {k * per_node for k in range(1, nodes + 1)}
    return {size: logical_shapes(size) for size in sorted(sizes)}


def _check_options(options: dict) -> dict[int, tuple[tuple[int, ...], ...]]:
    checked = {}
    for size, shapes in dict(options).items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"sub-mesh size {size!r} must be an int >= 1")
        shapes = tuple(tuple(shape) for shape in shapes)
        bad = [shape for shape in shapes if math.prod(shape) != size or not 1 <= len(shape) <= 2]
        if not shapes or bad:
            raise ValueError(f"sub-mesh size {size}: shapes {list(shapes)} must be non-empty, each of 1 or 2 axes "
                             f"whose product is {size}" + (f" (not {bad})" if bad else ""))
        checked[size] = shapes
    if not checked:
        raise ValueError("no sub-mesh sizes given: pass {size: ((size,), ...)} or submesh_options(cluster)")
    return checked


def stage_search(num_layers: int, devices: int, options: dict, microbatches: int,
                 slice_time_s: Callable[..., float], *, by_depth: bool = False, max_stages: int | None = None,
                 layer_names=None) -> StageSearch:
    """The stages, sub-meshes and shapes minimising T (module docstring) for any slice
    price: ``slice_time_s(i, j, shape)`` seconds per micro-batch of layers i..j-1 on a
    sub-mesh laid out as ``shape`` (math.inf: infeasible), or with ``by_depth``
    ``slice_time_s(i, j, shape, depth)`` (depth: stages from this one to the last).
    ``options``: sub-mesh size -> its shapes (``submesh_options``). Each (slice, size)
    takes its best shape; ``alpa_partition`` chooses the slices and sizes."""
    options = _check_options(options)
    best_shape: dict[tuple, tuple[int, ...]] = {}

    def size_time_s(i: int, j: int, size: int, *depth) -> float:
        times = [(slice_time_s(i, j, shape, *depth), position) for position, shape in enumerate(options[size])]
        best_s, position = min(times)
        best_shape[(i, j, size, *depth)] = options[size][position]
        return best_s

    plan = alpa_partition(num_layers, devices, sorted(options), microbatches, size_time_s, max_stages=max_stages,
                          by_depth=by_depth)
    names = tuple(layer_names) if layer_names is not None else tuple(str(k) for k in range(num_layers))
    stages, depth = [], plan.num_stages
    for (start, end), size, time_s in zip(plan.slices, plan.submesh_sizes, plan.stage_times_s):
        key = (start, end, size, depth) if by_depth else (start, end, size)
        stages.append(Stage(start=start, end=end, layer_names=names[start:end], devices=size,
                            mesh_shape=best_shape[key], time_s=time_s))
        depth -= 1
    single = None
    if devices in options:
        whole_s = min(slice_time_s(0, num_layers, shape, *((1,) if by_depth else ())) for shape in options[devices])
        single = microbatches * whole_s if math.isfinite(whole_s) else None
    return StageSearch(stages=tuple(stages), latency_s=plan.latency_s, microbatches=microbatches,
                       single_stage_latency_s=single, plan=plan)


class _SlicePricer:
    """ILP prices of slices on logical meshes, cached by (slice signature, shape,
    in-flight count): see the module docstring."""

    def __init__(self, graph: OpGraph, layers: list[Layer], cluster, *, memory_limit_bytes, exact: bool,
                 microbatches: int, time_limit_s: float, dtype: str | None,
                 optimizer_state_bytes_per_param: float | None):
        self.graph, self.layers, self.cluster = graph, layers, cluster
        self.memory_limit_bytes, self.exact, self.microbatches = memory_limit_bytes, exact, microbatches
        self.time_limit_s, self.dtype = time_limit_s, dtype
        self.optimizer_state_bytes_per_param = optimizer_state_bytes_per_param
        self.grads = grad_nodes(graph)
        self.cache: dict[tuple, tuple[float, float]] = {}
        self.signatures: dict[tuple[int, int], int] = {}  # slice -> the id of its signature (hashed once)
        self.signature_ids: dict[tuple, int] = {}
        self.boundaries = [boundary_bytes(graph, layers, cut, self.grads) for cut in range(len(layers) + 1)]
        self.solves = 0

    def ilp(self, start: int, end: int, shape: tuple[int, ...], in_flight: int) -> tuple[float, float]:
        """(seconds, memory bytes) of the slice's best plan on ``shape`` with activations
        counted ``in_flight`` times, or (inf, inf) when none fits the memory limit.

        In-flight micro-batches only add memory, so the plan for one micro-batch stays
        optimal for k whenever it still fits with its own activations counted k times
        (memory + (k - 1) · saved <= limit): then no other ILP is solved."""
        if (start, end) not in self.signatures:
            signature = slice_signature(self.graph, self.layers, start, end, self.grads)
            self.signatures[start, end] = self.signature_ids.setdefault(signature, len(self.signature_ids))
        single = (self.signatures[start, end], shape, 1)
        if single not in self.cache:
            self.cache[single] = self._solve(start, end, shape, 1)
        seconds, memory, saved = self.cache[single]
        grown = memory + (in_flight - 1) * saved
        limit = self.memory_limit_bytes if self.exact else None
        if in_flight == 1 or not math.isfinite(seconds) or limit is None or grown <= limit:
            return seconds, grown
        key = (self.signatures[start, end], shape, in_flight)
        if key not in self.cache:
            self.cache[key] = self._solve(start, end, shape, in_flight)
        return self.cache[key][:2]

    def _solve(self, start: int, end: int, shape: tuple[int, ...], in_flight: int) -> tuple[float, float, float]:
        """(seconds, memory bytes, saved activation bytes of one micro-batch) of the ILP's plan."""
        sub = slice_graph(self.graph, self.layers, start, end)
        mesh = AutoMesh(shape)
        strategies = {}
        for node in sub.nodes:
            found = node_strategies(node, sub, mesh, self.cluster, dtype=self.dtype, grad_nodes=self.grads,
                                    optimizer_state_bytes_per_param=self.optimizer_state_bytes_per_param)
            if in_flight > 1:  # 1F1B: this stage's saved activations of in_flight micro-batches
                found = [replace(strategy, memory_bytes=strategy.memory_bytes
                                 + (in_flight - 1) * _saved_bytes(node, sub, strategy, shape)) for strategy in found]
            strategies[node.name] = found
        self.solves += 1
        limit = self.memory_limit_bytes if self.exact else None
        try:
            result = solve(sub, strategies, mesh, self.cluster, memory_limit_bytes=limit,
                           time_limit_s=self.time_limit_s)
        except ValueError as error:
            if limit is not None and "memory limit" in str(error):
                return math.inf, math.inf, math.inf
            raise
        saved = sum(_saved_bytes(node, sub, result.choice[node.name], shape) for node in sub.nodes)
        return result.objective_s, result.memory_bytes, saved

    def plan(self, start: int, end: int, shape: tuple[int, ...], depth: int = 1) -> tuple[float, float]:
        """(ILP seconds, memory bytes) of the slice at ``depth`` (exact, or summed over its layers)."""
        in_flight = min(depth, self.microbatches) if self.memory_limit_bytes is not None else 1
        if self.exact:
            return self.ilp(start, end, shape, in_flight)
        parts = [self.ilp(layer, layer + 1, shape, in_flight) for layer in range(start, end)]
        seconds, memory = sum(part[0] for part in parts), sum(part[1] for part in parts)
        if self.memory_limit_bytes is not None and memory > self.memory_limit_bytes:
            seconds = math.inf
        return seconds, memory

    def time_s(self, start: int, end: int, shape: tuple[int, ...], depth: int = 1) -> float:
        return self.plan(start, end, shape, depth)[0] + self.p2p_s(start, end, shape)

    def p2p_s(self, start: int, end: int, shape: tuple[int, ...]) -> float:
        """The stage's sends: activations forward at ``end``, gradients backward at ``start``."""
        devices = math.prod(shape)
        crosses = self.cluster.nodes > 1 and devices >= self.cluster.devices_per_node
        forward_bytes = self.boundaries[end][0] if end < len(self.layers) else 0
        backward_bytes = self.boundaries[start][1] if start > 0 else 0
        return sum(self.cluster.p2p_time_s(nbytes / devices, crosses) for nbytes in (forward_bytes, backward_bytes))


def _saved_bytes(node, graph: OpGraph, strategy, shape: tuple[int, ...]) -> float:
    """Bytes ``node`` saves for its backward on one device under ``strategy``."""
    producers = [graph.node(name) for name in node.inputs]
    inputs = [local_shape(p.shape, layout, shape) for p, layout in zip(producers, strategy.inputs)]
    return saved_bytes(node, inputs, [p.itemsize for p in producers], [p.dtype for p in producers],
                       local_shape(node.shape, strategy.output, shape))


def auto_stages(graph: OpGraph, cluster, *, microbatches: int, memory_limit_bytes: float | None = None,
                options: dict | None = None, devices: int | None = None, max_stages: int | None = None,
                exact: bool | None = None, time_limit_s: float = 10.0, dtype: str | None = None,
                layers: list[Layer] | None = None,
                optimizer_state_bytes_per_param: float | None = None) -> StageSearch:
    """Alpa's stage/sub-mesh search over ``graph`` (one micro-batch's training step,
    traced and simplified) on ``cluster``: layers from ``stage_graph.graph_layers``
    (or ``layers``), sub-meshes from ``submesh_options(cluster)`` (or ``options``),
    every device used (``devices``: default the cluster's), each (slice, shape) priced
    by the ILP (module docstring; ``exact`` None: exact up to EXACT_LAYERS layers).
    ``dtype`` and ``optimizer_state_bytes_per_param`` go to each node's strategies
    (``strategies.node_strategies``), as the planner's intra-operator pass gives them."""
    layers = graph_layers(graph) if layers is None else list(layers)
    devices = cluster.world_size if devices is None else devices
    options = submesh_options(cluster) if options is None else options
    options = {size: shapes for size, shapes in _check_options(options).items() if size <= devices}
    pricer = _SlicePricer(graph, layers, cluster, memory_limit_bytes=memory_limit_bytes,
                          exact=len(layers) <= EXACT_LAYERS if exact is None else exact, microbatches=microbatches,
                          time_limit_s=time_limit_s, dtype=dtype,
                          optimizer_state_bytes_per_param=optimizer_state_bytes_per_param)
    found = stage_search(len(layers), devices, options, microbatches, pricer.time_s,
                         by_depth=memory_limit_bytes is not None, max_stages=max_stages,
                         layer_names=[layer.name for layer in layers])
    depths = range(len(found.stages), 0, -1)
    stages = tuple(replace(stage, memory_bytes=pricer.plan(stage.start, stage.end, stage.mesh_shape, depth)[1])
                   for stage, depth in zip(found.stages, depths))  # cached: no new ILP
    return replace(found, stages=stages, ilp_solves=pricer.solves)
