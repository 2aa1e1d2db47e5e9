"""The layout changes of an auto-parallel plan on one mesh axis, as autograd functions
on plait's collectives, each with the backward dual that keeps the gradient
convention (``plait.names.placements``): the gradient of an R tensor is whole and
equal on every rank of the axis, of an S<d> tensor sharded alike, of a P tensor
replicated. For a tensor of n elements (the whole along this axis) on p ranks, ring
costs per rank:

    step          forward                           backward
    P -> R        all-reduce, 2(p-1)/p n            identity
    P -> S<d>     reduce-scatter, (p-1)/p n         all-gather, (p-1)/p n
    S<d> -> R     all-gather, (p-1)/p n             keep own slice
    R -> S<d>     keep own slice                    all-gather, (p-1)/p n
    S<d> -> S<e>  all-to-all, (p-1)/p² n *          all-to-all back
    R -> P        coordinate 0 keeps, others zero   identity
    wrap (R)      identity                          all-reduce, 2(p-1)/p n

(* an all-to-all sends p-1 of this rank's p chunks: (p-1)/p of its n/p elements.)
``wrap`` is Megatron's copy_to_region: an R input of an operator that splits its
work along the axis gets only this rank's part of its gradient; the all-reduce sums
the parts. A group of one runs no collective. Steps of several axes come from
``plait.parallel.auto.reshard_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait import comm
from plait.names.placements import PARTIAL, REPLICATE, is_shard, shard_dim
from plait.parallel.auto.reshard_steps import reshard_steps

__all__ = ["AxisComm", "all_reduce_partial", "reduce_scatter_partial", "gather_shards", "slice_shard",
           "all_to_all_shards", "partial_from_replicated", "wrap_replicated", "wrap_replicated_many", "reshard_step",
           "reshard"]


@dataclass(frozen=True)
class AxisComm:
    """One mesh axis as this rank sees it: the process group (or plait Communicator) of
    its line of ranks, the group's ``size`` and this rank's ``coord`` on the axis, and
    the plait.comm ``algorithm`` its collectives run ("auto": plait's choice)."""

    group: object
    size: int
    coord: int
    algorithm: str = "auto"


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy we may overwrite (plait's collectives work in place)."""
    out = tensor.contiguous()
    return out.clone() if out is tensor else out


def _check_divides(tensor: torch.Tensor, dim: int, axis: AxisComm, what: str) -> None:
    if tensor.shape[dim] % axis.size:
        raise ValueError(f"{what}: dim {dim} of a local tensor of shape {tuple(tensor.shape)} does not split into "
                         f"{axis.size} equal parts; choose a layout whose sharded dims divide by the axis size")


def _all_reduce(tensor: torch.Tensor, axis: AxisComm) -> torch.Tensor:
    out = _fresh(tensor)
    comm.all_reduce(out, comm.ReduceOp.SUM, group=axis.group, algorithm=axis.algorithm)
    return out


def _gather(tensor: torch.Tensor, axis: AxisComm, dim: int) -> torch.Tensor:
    """(.., n/p @dim, ..) on each rank -> (.., n @dim, ..), blocks in coordinate order."""
    local = tensor.contiguous()
    out = torch.empty((axis.size, *local.shape), dtype=local.dtype, device=local.device)
    comm.all_gather_single(out, local, group=axis.group, algorithm=axis.algorithm)
    return torch.cat(out.unbind(0), dim=dim)


def _slice(tensor: torch.Tensor, axis: AxisComm, dim: int) -> torch.Tensor:
    _check_divides(tensor, dim, axis, "slice to a shard")
    return tensor.chunk(axis.size, dim=dim)[axis.coord].contiguous()


def _reduce_scatter(tensor: torch.Tensor, axis: AxisComm, dim: int) -> torch.Tensor:
    """(.., n @dim, ..) summands -> this coordinate's block of the sum, (.., n/p @dim, ..)."""
    _check_divides(tensor, dim, axis, "reduce-scatter")
    rows_first = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((rows_first.shape[0] // axis.size, *rows_first.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    comm.reduce_scatter_single(out, rows_first, group=axis.group, algorithm=axis.algorithm)
    return out.movedim(0, dim)


def _all_to_all(tensor: torch.Tensor, axis: AxisComm, src_dim: int, dst_dim: int) -> torch.Tensor:
    """Sharded on ``src_dim`` -> sharded on ``dst_dim``: block j of ``dst_dim`` goes to
    coordinate j, the blocks received are put together along ``src_dim`` in coordinate
    order."""
    _check_divides(tensor, dst_dim, axis, "all-to-all")
    send = torch.stack(tensor.chunk(axis.size, dim=dst_dim), dim=0).contiguous()
    received = torch.empty_like(send)
    comm.all_to_all_single(received, send, group=axis.group, algorithm=axis.algorithm)
    return torch.cat(received.unbind(0), dim=src_dim)


class _AllReducePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad.view_as(grad), None


class _ReduceScatterPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return _reduce_scatter(x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.axis, ctx.dim), None, None


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return _gather(x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.axis, ctx.dim), None, None


class _SliceShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return _slice(x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.axis, ctx.dim), None, None


class _AllToAllShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, src_dim, dst_dim):
        ctx.axis, ctx.src_dim, ctx.dst_dim = axis, src_dim, dst_dim
        return _all_to_all(x, axis, src_dim, dst_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.axis, ctx.dst_dim, ctx.src_dim), None, None, None


class _PartialFromReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return x.clone() if axis.coord == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.view_as(grad), None


class _WrapReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.axis), None


class _WrapReplicatedMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx, axis, *tensors):
        ctx.axis = axis
        ctx.shapes = [tensor.shape for tensor in tensors]
        ctx.dtype, ctx.device = tensors[0].dtype, tensors[0].device
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads):
        filled = [torch.zeros(shape, dtype=ctx.dtype, device=ctx.device) if grad is None else grad
                  for grad, shape in zip(grads, ctx.shapes)]
        flat = _all_reduce(torch.cat([grad.reshape(-1) for grad in filled]), ctx.axis)
        return (None, *[piece.view(shape) for piece, shape in zip(flat.split([s.numel() for s in ctx.shapes]),
                                                                  ctx.shapes)])


def all_reduce_partial(x: torch.Tensor, axis: AxisComm) -> torch.Tensor:
    """P -> R: the sum of the summands (backward: identity, the gradient of P is R)."""
    return x if axis.size == 1 else _AllReducePartial.apply(x, axis)


def reduce_scatter_partial(x: torch.Tensor, axis: AxisComm, dim: int) -> torch.Tensor:
    """P -> S<dim>: this coordinate's block of the sum (backward: all-gather)."""
    return x if axis.size == 1 else _ReduceScatterPartial.apply(x, axis, dim)


def gather_shards(x: torch.Tensor, axis: AxisComm, dim: int) -> torch.Tensor:
    """S<dim> -> R: all-gather (backward: keep this coordinate's slice of the R gradient)."""
    return x if axis.size == 1 else _GatherShards.apply(x, axis, dim)


def slice_shard(x: torch.Tensor, axis: AxisComm, dim: int) -> torch.Tensor:
    """R -> S<dim>: keep this coordinate's slice (backward: all-gather the sharded gradient)."""
    return x if axis.size == 1 else _SliceShard.apply(x, axis, dim)


def all_to_all_shards(x: torch.Tensor, axis: AxisComm, src_dim: int, dst_dim: int) -> torch.Tensor:
    """S<src_dim> -> S<dst_dim>: all-to-all (backward: the all-to-all back)."""
    return x if axis.size == 1 else _AllToAllShards.apply(x, axis, src_dim, dst_dim)


def partial_from_replicated(x: torch.Tensor, axis: AxisComm) -> torch.Tensor:
    """R -> P: coordinate 0 holds the value, the others zeros (backward: identity)."""
    return x if axis.size == 1 else _PartialFromReplicated.apply(x, axis)


def wrap_replicated(x: torch.Tensor, axis: AxisComm) -> torch.Tensor:
    """Identity on an R input of an operator that splits its work along the axis;
    backward all-reduces its gradient's parts (Megatron's copy_to_region; for a
    parameter under batch sharding, data parallelism's gradient all-reduce)."""
    return x if axis.size == 1 else _WrapReplicated.apply(x, axis)


def wrap_replicated_many(tensors, axis: AxisComm) -> tuple:
    """``wrap_replicated`` of several tensors of one dtype at once: their gradients summed
    in ONE all-reduce (a node's weight and bias under batch sharding: one message)."""
    tensors = tuple(tensors)
    if axis.size == 1 or not tensors:
        return tensors
    if len(tensors) == 1 or len({tensor.dtype for tensor in tensors}) > 1:
        return tuple(wrap_replicated(tensor, axis) for tensor in tensors)
    return _WrapReplicatedMany.apply(axis, *tensors)


def reshard_step(x: torch.Tensor, axis: AxisComm, src: str, dst: str) -> torch.Tensor:
    """One single-axis change ``src`` -> ``dst`` (see reshard_steps.single_axis_steps)."""
    if src == dst:
        return x
    if src == PARTIAL and dst == REPLICATE:
        return all_reduce_partial(x, axis)
    if src == PARTIAL and is_shard(dst):
        return reduce_scatter_partial(x, axis, shard_dim(dst))
    if is_shard(src) and dst == REPLICATE:
        return gather_shards(x, axis, shard_dim(src))
    if src == REPLICATE and is_shard(dst):
        return slice_shard(x, axis, shard_dim(dst))
    if is_shard(src) and is_shard(dst):
        return all_to_all_shards(x, axis, shard_dim(src), shard_dim(dst))
    if src == REPLICATE and dst == PARTIAL:
        return partial_from_replicated(x, axis)
    raise ValueError(f"reshard step {src} -> {dst} is not a single-axis step: split it with reshard_steps")


def reshard(x: torch.Tensor, src, dst, axes) -> torch.Tensor:
    """Layout ``src`` -> ``dst`` on the mesh whose axes are ``axes`` (AxisComm per axis),
    one axis at a time in reshard_steps' order."""
    for axis, before, after in reshard_steps(src, dst):
        x = reshard_step(x, axes[axis], before, after)
    return x
