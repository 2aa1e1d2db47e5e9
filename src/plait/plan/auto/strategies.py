"""Every sharding strategy of an operator on a 1-D or 2-D mesh, with its costs (the
choices the intra-operator ILP picks from, Alpa's sharding specs).

Per mesh axis an operator has 1-D options (``strategies_options`` has the table per
kind: replicated, batch, sequence, column, row, ...; ``strategies_products`` builds
those of linear, matmul, attention, conv and embedding, ``strategies_axis`` holds the
shared vocabulary); a strategy is one option per axis, the cartesian product over
axes, less the combinations that shard one tensor dim on both axes when it does not
divide by the product of their sizes (such a dim is split axis 0 outer, axis 1 inner,
as DTensor does), and less duplicate layouts. The all-replicated strategy
("replicated") always exists and comes first, so a plan always exists.

Names: ``"<style>@<axis>"`` for every axis not replicated, joined by "," in axis order:
"column@0" on a 1-D mesh, "batch@0,column@1" on a 2-D one, "replicated" when no axis
splits anything.

Costs per device and per training step (forward + backward):

- ``compute_s`` = Σ over forward and backward of ``device.time_s(flops, nbytes, kernels,
  dtype, matmuls)`` on the local shards (``strategies_work``);
- ``comm_s`` = Σ over axes a, over the replicated inputs/parameters whose gradient the
  option on a makes partial (and that have a gradient: parameters always, activations
  downstream of a parameter), of ``cluster.collective_time_s("all_reduce", local grad
  bytes, size(a), stride(a))`` (the backward all-reduce of Megatron's copy_to_region,
  or data parallelism's gradient all-reduce for a parameter), plus, for a mean
  cross-entropy / nll split over the batch, the all-reduce of its 8-byte target count;
- ``memory_bytes`` = Σ local parameter elements x (2 itemsize (parameter + gradient) +
  ``optimizer_state_bytes_per_param``, by default Adam's two states in the parameter's
  dtype: 2 itemsize) + the bytes saved for backward on this device (``strategies_work``).

What resharding between operators costs is on the edges (``reshard_cost``), not here.
"""

from __future__ import annotations

import itertools
import math

from plait.names.placements import PARTIAL, local_shape
from plait.plan.auto.strategies_axis import local_operand
from plait.plan.auto.strategies_options import REPLICATED_STYLE, Shapes, axis_options
from plait.plan.auto.strategies_work import is_floating, local_work, saved_bytes
from plait.plan.auto.strategy import Strategy

__all__ = ["node_strategies", "graph_strategies", "grad_nodes", "fused_part_dim"]

_SLICES = ("slice", "narrow")
# the executor's all-reduced target count of a batch-split mean classification loss (one int64)
_COUNT_BYTES = 8


def grad_nodes(graph) -> frozenset[str]:
    """Names of the nodes whose output carries a gradient: floating, and reading a
    parameter or a node that carries one (user inputs and constants do not)."""
    found: set[str] = set()
    for node in graph.nodes:
        if node.kind in ("input", "constant") or not is_floating(node.dtype):
            continue
        if node.params or any(name in found for name in node.inputs):
            found.add(node.name)
    return frozenset(found)


def fused_part_dim(node, graph) -> int | None:
    """The dim d when ``node`` is one of k slices (attrs start, step 1) of equal length L
    along the last dim d of a linear's output that tile it ([0, L), [L, 2L), ...) and
    are all that linear's consumers (HF GPT-2's q, k, v split of c_attn); else None."""
    if node.kind != "view" or node.attr("op") not in _SLICES or len(node.inputs) != 1:
        return None
    producer = graph.node(node.inputs[0])
    d = len(producer.shape) - 1
    if producer.kind != "linear" or len(node.shape) != len(producer.shape):
        return None
    parts = graph.consumers(producer.name)
    if any(part.kind != "view" or part.attr("op") not in _SLICES or tuple(part.attr("sliced_dims", ()) or ()) != (d,)
           or part.attr("start") is None or part.attr("step", 1) != 1 or len(part.shape) != len(node.shape)
           or part.shape[:d] != node.shape[:d] for part in parts):
        return None
    length = node.shape[d]
    starts = sorted(int(part.attr("start")) for part in parts)
    if any(part.shape[d] != length for part in parts) or starts != [i * length for i in range(len(parts))] \
            or len(parts) * length != producer.shape[d] or len(parts) < 2:
        return None
    return d


def graph_strategies(graph, mesh, cluster, *, dtype: str | None = None,
                     optimizer_state_bytes_per_param: float | None = None) -> dict[str, list[Strategy]]:
    """``node_strategies`` of every node of ``graph``, by node name."""
    grads = grad_nodes(graph)
    return {node.name: node_strategies(node, graph, mesh, cluster, dtype=dtype, grad_nodes=grads,
                                       optimizer_state_bytes_per_param=optimizer_state_bytes_per_param)
            for node in graph.nodes}


def _check(mesh, cluster, optimizer_state_bytes_per_param) -> None:
    if mesh.first_rank + mesh.size > cluster.world_size:
        raise ValueError(f"mesh {mesh.text()} from rank {mesh.first_rank} needs {mesh.first_rank + mesh.size} ranks; "
                         f"cluster {cluster.name!r} has {cluster.world_size}: use a smaller mesh")
    value = optimizer_state_bytes_per_param
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value < 0):
        raise ValueError(f"optimizer_state_bytes_per_param={value!r} must be a finite number >= 0 (Adam in the "
                         "parameter's dtype: 2 x its itemsize, the default; fp32 master + Adam: 12; SGD: 0)")


def _compute_dtype(node, graph, cluster, dtype: str | None) -> str:
    """The dtype compute is priced at: ``dtype`` when given, else the node's when it is
    floating, else the graph's first floating parameter's, else the device's first
    (an integer op moves bytes only); refused by name when the device has no peak for it."""
    peaks = dict(cluster.device.peak_flops_per_s)
    if dtype is None and not is_floating(node.dtype):
        floating = [param.dtype for param in graph.params if is_floating(param.dtype)]
        dtype = floating[0] if floating else cluster.device.peak_flops_per_s[0][0]
    chosen = node.dtype if dtype is None else dtype
    if chosen not in peaks:
        raise ValueError(f"node {node.name!r} computes in {chosen}, which device {cluster.device.name!r} has no peak "
                         f"for (it has {', '.join(peaks)}): pass dtype= one of those to price the model as if in it, "
                         "or use a device profile measured in that dtype")
    return chosen


def node_strategies(node, graph, mesh, cluster, *, dtype: str | None = None,
                    optimizer_state_bytes_per_param: float | None = None,
                    grad_nodes: frozenset | None = None) -> list[Strategy]:
    """The strategies of ``node`` (an OpNode of ``graph``) on ``mesh`` (AutoMesh) priced
    on ``cluster``; never empty, the all-replicated one first. ``grad_nodes``: the names
    of the nodes carrying a gradient (``grad_nodes(graph)``; computed when None: pass it
    when enumerating a whole graph, or use ``graph_strategies``)."""
    _check(mesh, cluster, optimizer_state_bytes_per_param)
    grads = _grad_nodes(graph) if grad_nodes is None else grad_nodes
    producers = [graph.node(name) for name in node.inputs]
    params = [graph.param(name) for name in node.params]
    shapes = Shapes(out=tuple(node.shape), inputs=tuple(tuple(p.shape) for p in producers),
                    params=tuple((param.name, tuple(param.shape)) for param in params),
                    fused_dim=fused_part_dim(node, graph))
    per_axis = [axis_options(node, shapes, mesh.axis_size(axis)) for axis in range(mesh.ndim)]
    compute_dtype = _compute_dtype(node, graph, cluster, dtype)
    found, seen = [], set()
    for combo in itertools.product(*per_axis):
        output = tuple(option.output for option in combo)
        inputs = tuple(tuple(option.inputs[i] for option in combo) for i in range(len(producers)))
        param_layouts = tuple(tuple(option.params[i] for option in combo) for i in range(len(params)))
        key = (output, inputs, param_layouts)
        if key in seen:
            continue
        try:  # a dim sharded on both axes must divide by the product of their sizes
            out_local = local_shape(node.shape, output, mesh.shape)
            in_local = [local_shape(p.shape, layout, mesh.shape) for p, layout in zip(producers, inputs)]
            param_local = [local_shape(p.shape, layout, mesh.shape) for p, layout in zip(params, param_layouts)]
        except ValueError:
            continue
        seen.add(key)
        name = ",".join(f"{option.style}@{axis}" for axis, option in enumerate(combo)
                        if option.style != REPLICATED_STYLE) or REPLICATED_STYLE
        in_work, in_sizes = list(in_local), [p.itemsize for p in producers]
        if node.kind == "matmul" and node.attr("param_side") is not None:  # the parameter is an operand
            in_work.insert(node.attr("param_side"), local_operand(node, params[0].name, params[0].shape, param_local[0]))
            in_sizes.insert(node.attr("param_side"), params[0].itemsize)
        forward, backward = local_work(node, in_work, in_sizes, param_local, [p.itemsize for p in params], out_local)
        compute_s = forward.time_s(cluster.device, compute_dtype) + backward.time_s(cluster.device, compute_dtype)
        comm_s = _gradient_all_reduce_s(node, combo, producers, in_local, params, param_local, grads, mesh, cluster)
        memory = saved_bytes(node, in_local, [p.itemsize for p in producers], [p.dtype for p in producers], out_local)
        for param, shape in zip(params, param_local):
            state = 2 * param.itemsize if optimizer_state_bytes_per_param is None else optimizer_state_bytes_per_param
            memory += math.prod(shape) * (2 * param.itemsize + state)
        found.append(Strategy(name=name, output=output, inputs=inputs,
                              params=tuple((p.name, layout) for p, layout in zip(params, param_layouts)),
                              compute_s=compute_s, comm_s=comm_s, memory_bytes=float(memory)))
    return found


_grad_nodes = grad_nodes  # node_strategies' keyword of the same name shadows the function


def _gradient_all_reduce_s(node, combo, producers, in_local, params, param_local, grads, mesh, cluster) -> float:
    """Σ over axes of the backward all-reduces of the partial gradients the axis's option
    makes (inputs with a gradient, every parameter), at their local size."""
    seconds = 0.0
    param_index = {param.name: i for i, param in enumerate(params)}
    for axis, option in enumerate(combo):
        size, stride = mesh.axis_size(axis), mesh.axis_stride(axis)
        if size == 1:
            continue
        tensors = [(in_local[i], producers[i].itemsize) for i in option.partial_inputs if producers[i].name in grads]
        tensors += [(param_local[param_index[name]], params[param_index[name]].itemsize)
                    for name in option.partial_params]
        for shape, itemsize in tensors:
            seconds += cluster.collective_time_s("all_reduce", math.prod(shape) * itemsize, size, stride)[0]
        if _counts_targets(node) and option.output == PARTIAL:
            seconds += cluster.collective_time_s("all_reduce", _COUNT_BYTES, size, stride)[0]
    return seconds


def _counts_targets(node) -> bool:
    """A classification loss averaged over its targets: split over the batch, the ranks
    first all-reduce how many targets count (ignore_index excluded) to divide by it."""
    return node.kind == "loss" and node.attr("op") in ("cross_entropy", "nll") and node.attr("reduction") == "mean"
