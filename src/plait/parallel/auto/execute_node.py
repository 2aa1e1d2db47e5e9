"""One node of an auto-parallel plan run on this rank's local shards: its fx members in
graph order, each on local tensors, with the local rules that keep the result exact
(``plait.parallel.auto.execute`` prepares the inputs and checks the layouts first):

- a view/reshape/expand that gives the node's value takes the LOCAL target shape (the
  global shape of its fx meta with the sharded dims divided);
- a linear runs as x @ W^T (or x @ W for a (in, out) weight, HF's Conv1D) on whatever
  leading dims x has (its flatten/unflatten views are absorbed);
- a conv or linear whose output is P gets a bias that is P already (coordinate 0
  holds it), so the bias is counted once;
- an embedding with a vocabulary-sharded table looks up only the ids in its rows
  (the others read zeros): the output is P;
- a reduce (sum, mean) over a sharded dim gives P; mean is the local sum over the
  GLOBAL count of the reduced elements;
- a batch-sharded loss with mean reduction is local_sum / global_count (P); for
  cross_entropy / nll the count of targets not equal to ignore_index is summed over
  the sharded axes (one scalar all-reduce per axis);
- constants run whole, on global shapes.
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx.node import map_arg

from plait import comm
from plait.names.placements import PARTIAL, is_shard, local_shape, shard_dim

__all__ = ["NodeContext", "run_members", "VIEW_TARGETS", "block_index"]

_SHAPE_OPS = ("view", "reshape", "_unsafe_view", "expand")
VIEW_TARGETS = ("view", "reshape", "_unsafe_view", "flatten", "unflatten")
_REDUCTION_CODES = {"none": 0, "mean": 1, "sum": 2}


def _op_name(fx_node) -> str:
    """aten.view.default -> "view"; operator.getitem -> "getitem"."""
    target = fx_node.target
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def block_index(layout, dim: int, coords, mesh_shape) -> tuple[int, int]:
    """(this rank's block, number of blocks) along ``dim`` under ``layout``: axis 0
    outer, axis 1 inner (DTensor's nesting)."""
    index, count = 0, 1
    for placement, coord, size in zip(layout, coords, mesh_shape):
        if shard_dim(placement) == dim:
            index, count = index * size + coord, count * size
    return index, count


class NodeContext:
    """What running one node needs: the node, its NodeLayout, the fx nodes by name,
    their order, this rank's mesh coordinates and per-axis AxisComms."""

    def __init__(self, node, layout, fx_nodes, order, coords, mesh_shape, axes, *, inputs=(), input_shapes=(),
                 params=None, fused_divisor: int = 1, members=None):
        self.node, self.layout = node, layout
        self.fx_nodes, self.order = fx_nodes, order
        self.coords, self.mesh_shape, self.axes = coords, mesh_shape, axes
        self.inputs = list(inputs)  # local tensors, one per node.inputs entry (resharded, wrapped)
        self.input_shapes = list(input_shapes)  # their global shapes
        self.params = dict(params or {})  # name -> local tensor as this node reads it
        self.fused_divisor = fused_divisor  # a fused slice of a blocked shard: its bounds divided by this
        self.members = members  # the node's fx members in graph order (None: sorted here)

    def local_target(self, fx_node) -> list[int]:
        return list(local_shape(tuple(fx_node.meta["val"].shape), self.layout.output, self.mesh_shape))


def _is_param_view(fx_node, member_names) -> bool:
    """A folded parameter view: its tensor inputs are get_attr nodes or other such views."""
    sources = list(fx_node.all_input_nodes)
    return bool(sources) and all(s.op == "get_attr" or (s.name in member_names and _is_param_view(s, member_names))
                                 for s in sources)


def run_members(ctx: NodeContext, lookup, *, whole: bool = False):
    """Evaluate ``ctx.node``'s members in graph order on local tensors; ``lookup(fx
    node)`` gives values from outside the node (inputs resharded, parameters).
    ``whole``: a constant, run on global shapes unchanged. Returns the node's value."""
    node = ctx.node
    members = ctx.members or sorted(node.members or (node.name,), key=ctx.order.__getitem__)
    member_names = set(members)
    env: dict[str, object] = {}

    def read(arg):
        return env[arg.name] if arg.name in env else lookup(arg)

    for name in members:
        fx_node = ctx.fx_nodes[name]
        if whole:
            env[name] = fx_node.target(*map_arg(fx_node.args, read), **map_arg(fx_node.kwargs, read))
            continue
        if node.kind == "linear" and name != node.name:
            if _is_param_view(fx_node, member_names):
                continue
            if _op_name(fx_node) in VIEW_TARGETS:
                source = fx_node.args[0]
                if source.name in env:
                    env[name] = env[source.name]  # the unflatten view: the linear already kept the leading dims
                continue  # the flatten view before it: the linear takes x's own dims
        if name == node.name:
            env[name] = _principal(ctx, fx_node, read)
        else:
            env[name] = _generic(ctx, fx_node, read, is_value=(name == members[-1]))
    return env[members[-1]]


def _generic(ctx: NodeContext, fx_node, read, *, is_value: bool):
    args = list(map_arg(fx_node.args, read))
    kwargs = dict(map_arg(fx_node.kwargs, read))
    op = _op_name(fx_node)
    if op in _SHAPE_OPS and (is_value or tuple(fx_node.meta["val"].shape) == tuple(ctx.node.shape)):
        args[1] = ctx.local_target(fx_node)  # the node's value, or a shape-preserving chain (alias, to) follows
    elif op in _SHAPE_OPS and fx_node.args[0].op != "get_attr" and not _is_param_view(fx_node, set(ctx.node.members)):
        source_shape = tuple(fx_node.args[0].meta["val"].shape)
        if tuple(args[0].shape) != source_shape:
            raise ValueError(f"node {ctx.node.name!r}: member {fx_node.name} ({op}) reshapes a sharded intermediate; "
                             "only the node's value may be reshaped (split the node)")
    if op in ("slice", "narrow") and ctx.fused_divisor > 1 and fx_node.name == ctx.node.name:
        start, end = ctx.node.attr("start"), ctx.node.attr("end")  # part j of the blocked local output
        args[2] = start // ctx.fused_divisor
        args[3] = (end if op == "slice" else end - start) // ctx.fused_divisor
    if op in ("add", "sub") and PARTIAL in _placements(ctx.layout.output):
        numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool) and a != 0]
        if numbers:
            raise ValueError(f"node {ctx.node.name!r}: {op} of a partial sum and the number {numbers[0]} would add it "
                             "on every rank; lay the output out replicated (reshard the partial sum to R first)")
    return fx_node.target(*args, **kwargs)


def _placements(layout):
    return tuple(layout)


def _principal(ctx: NodeContext, fx_node, read):
    kind = ctx.node.kind
    if kind == "linear":
        return _linear(ctx, read)
    if kind == "embedding":
        return _embedding(ctx, fx_node, read)
    if kind == "reduce":
        return _reduce(ctx, fx_node, read)
    if kind == "loss":
        return _loss(ctx, fx_node, read)
    last = ctx.members[-1] if ctx.members else max(ctx.node.members or (ctx.node.name,), key=ctx.order.__getitem__)
    return _generic(ctx, fx_node, read, is_value=(fx_node.name == last))


def _linear(ctx: NodeContext, read):
    x = ctx.inputs[0]
    weight = ctx.params[ctx.node.attr("weight")]
    bias = ctx.params.get(ctx.node.attr("bias")) if ctx.node.attr("bias") else None
    if ctx.node.attr("weight_out_dim", 0) == 1:
        y = torch.matmul(x, weight)
        return y if bias is None else y + bias
    return torch.nn.functional.linear(x, weight, bias)


def _embedding(ctx: NodeContext, fx_node, read):
    args = list(map_arg(fx_node.args, read))
    table, ids = args[0], args[1]
    table_layout = dict(ctx.layout.params)[ctx.node.attr("weight")]
    index, count = block_index(table_layout, 0, ctx.coords, ctx.mesh_shape)
    if count == 1:
        return fx_node.target(*args)
    rows = table.shape[0]
    local_ids = ids - index * rows
    inside = (local_ids >= 0) & (local_ids < rows)
    args[1] = torch.where(inside, local_ids, torch.zeros_like(local_ids))
    padding = args[2] if len(args) > 2 else -1
    if padding is not None and padding >= 0:
        padding -= index * rows
        args[2] = padding if 0 <= padding < rows else -1
    return fx_node.target(*args) * inside.unsqueeze(-1).to(table.dtype)


def _sharded_reduced(ctx: NodeContext, input_layout, dims) -> tuple[int, int]:
    """(local, global) element counts of the reduced dims of the node's input."""
    shape = ctx.input_shapes[0]
    local = local_shape(shape, input_layout, ctx.mesh_shape)
    return math.prod(local[d] for d in dims), math.prod(shape[d] for d in dims)


def _reduce(ctx: NodeContext, fx_node, read):
    value = _generic(ctx, fx_node, read, is_value=False)
    if ctx.node.attr("op") != "mean":
        return value
    dims = ctx.node.attr("dims") or tuple(range(len(ctx.input_shapes[0])))
    local, whole = _sharded_reduced(ctx, ctx.layout.inputs[0], dims)
    return value if local == whole else value * (local / whole)


def _reduction_position(op: str) -> int:
    return {"cross_entropy": 3, "nll": 3, "mse": 2}[op]


def _loss(ctx: NodeContext, fx_node, read):
    op, reduction = ctx.node.attr("op"), ctx.node.attr("reduction", "mean")
    sharded_axes = [axis for axis, placement in enumerate(ctx.layout.inputs[0]) if is_shard(placement)]
    args = list(map_arg(fx_node.args, read))
    kwargs = dict(map_arg(fx_node.kwargs, read))
    if reduction != "mean" or not sharded_axes:
        return fx_node.target(*args, **kwargs)
    if op in ("cross_entropy", "nll") and (args[2] if len(args) > 2 else kwargs.get("weight")) is not None:
        raise ValueError(f"node {ctx.node.name!r}: a class-weighted {op} loss sharded by batch is not supported: "
                         "replicate the loss, or drop weight=")
    position = _reduction_position(op)
    while len(args) <= position and "reduction" not in kwargs:
        args.append(None)
    if "reduction" in kwargs:
        kwargs["reduction"] = _REDUCTION_CODES["sum"]
    else:
        args[position] = _REDUCTION_CODES["sum"]
    total = fx_node.target(*args, **kwargs)
    if op == "mse":
        return total / math.prod(ctx.input_shapes[0])
    target = args[1]
    ignore = ctx.node.attr("ignore_index", -100)
    count = (target != ignore).sum().to(total.dtype).reshape(1)
    for axis in sharded_axes:  # the count of the whole batch: no gradient flows through it
        if ctx.axes[axis].size > 1:
            comm.all_reduce(count, comm.ReduceOp.SUM, group=ctx.axes[axis].group, algorithm=ctx.axes[axis].algorithm)
    return total / count[0]
