"""torch's gradient-norm idioms over tensor-parallel shards under DataParallel.

A model built from plait's tensor-parallel layers keeps, on each tp rank, its slice of
every sharded weight (``param.tp_shard``, set by ``plait.parallel.tensor``), and after
DataParallel's all-reduce its ``.grad`` is that slice of the averaged gradient. torch's
``clip_grad_norm_(model.parameters(), max_norm)`` would then take each rank's local norm.
DataParallel therefore exposes such a gradient as a ``TensorParallelGrad``: the local
slice itself for every op (an optimizer's update, accumulation into it, ``clone``: all
run on the slice and give plain tensors), except the norms torch's clipping takes —
``torch._foreach_norm`` and ``torch.linalg.vector_norm`` of the whole tensor — which
are the norm of the *full* gradient: Σ|x|^p over the slice, all-reduced over the
layer's tp group (max for p = inf), one all-reduce of a float64 vector per call.
tp-replicated parameters stay plain tensors (their norm is whole on every rank), so
every rank gets the total one process gets. Every tp rank must make the same calls.

The tp group is the one of the layer holding the parameter (its ``.tp``, a
``TensorParallel``: read by its attributes, as ``tp_shard`` is, so that this layer
does not import ``plait.parallel.tensor``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._pytree import tree_map

from plait import comm

_aten = torch.ops.aten
NORMS = (_aten._foreach_norm.Scalar, _aten.linalg_vector_norm.default)


def tp_groups_of(module: nn.Module) -> dict[int, object]:
    """id(parameter) -> the Communicator of its layer's tp group, for every parameter
    marked tensor-parallel sharded (``tp_shard``) whose holder has a ``.tp`` of size > 1."""
    found = {}
    for sub in module.modules():
        tp = getattr(sub, "tp", None)
        if tp is None or not hasattr(tp, "group") or getattr(tp, "size", 1) <= 1:
            continue
        for param in sub.parameters(recurse=False):
            if getattr(param, "tp_shard", None) is not None:
                found[id(param)] = comm.communicator_for(tp.group)
    return found


class TensorParallelGrad(torch.Tensor):
    """A tp-sharded parameter's gradient: the local slice, whose norms are the full
    gradient's (see the module docstring)."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, group):
        grad = torch.Tensor._make_wrapper_subclass(cls, local.shape, strides=local.stride(), dtype=local.dtype,
                                                   device=local.device, requires_grad=False)
        grad.local, grad.group = local, group
        return grad

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"TensorParallelGrad(local slice {tuple(self.shape)}, norms over its tp group)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in NORMS and (func is not _aten.linalg_vector_norm.default or whole_tensor_norm(args, kwargs)):
            return tp_norms(func, args, kwargs)
        result = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        schema = func._schema
        if schema.arguments and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write:
            return args[0] if isinstance(args[0], torch.Tensor) else result  # in place: the view itself stays
        return result


def unwrap(value):
    return value.local if isinstance(value, TensorParallelGrad) else value


def tp_grad(grad: torch.Tensor, group) -> torch.Tensor:
    """``grad`` exposed for torch's norms over ``group`` (None: a replicated parameter, as is)."""
    return grad if group is None else TensorParallelGrad(grad, group)


def whole_tensor_norm(args, kwargs) -> bool:
    dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
    return dim is None and not kwargs.get("keepdim", args[3] if len(args) > 3 else False)


def norm_arguments(func, args, kwargs) -> tuple[list, float, torch.dtype | None, bool]:
    """(tensors, p, dtype, single) of a ``torch._foreach_norm`` or ``linalg.vector_norm`` call."""
    single = func is _aten.linalg_vector_norm.default
    tensors = [args[0]] if single else list(args[0])
    order = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = kwargs.get("dtype", args[4] if single and len(args) > 4 else args[2] if not single and len(args) > 2
                       else None)
    return tensors, order, dtype, single


def tp_norms(func, args, kwargs):
    tensors, order, dtype, single = norm_arguments(func, args, kwargs)
    if not order > 0:
        raise RuntimeError(f"norm_type={order} of a tensor-parallel sharded gradient is refused: the norms reduced "
                           "over the tp ranks are p > 0 and inf")
    powers = torch.stack([local_power(unwrap(tensor), order) for tensor in tensors])
    groups = [(tensor.group,) if isinstance(tensor, TensorParallelGrad) else () for tensor in tensors]
    totals = reduce_powers(powers, groups, order)
    norms = totals if math.isinf(order) else totals.pow(1.0 / order)
    results = [norms[index].to(dtype or tensor.dtype).to(tensor.device) for index, tensor in enumerate(tensors)]
    return results[0] if single else results


def local_power(piece: torch.Tensor | None, order: float) -> torch.Tensor:
    """Σ|x|^p of ``piece`` (max |x| for p = inf), float64 on the CPU."""
    if piece is None or piece.numel() == 0:
        return torch.zeros((), dtype=torch.float64)
    values = piece.detach().to(torch.float64).abs()
    if math.isinf(order):
        return values.max().cpu()
    return (values.square() if order == 2 else values.pow(order)).sum().cpu()


def reduce_powers(powers: torch.Tensor, groups: list[tuple], order: float) -> torch.Tensor:
    """Each entry summed (max for p = inf) over each of its groups: one all-reduce per
    distinct group (first-seen order, the same on every rank), the others masked out."""
    distinct = {}
    for entry in groups:
        for group in entry:
            distinct.setdefault(id(group), group)
    op = comm.ReduceOp.MAX if math.isinf(order) else comm.ReduceOp.SUM
    for key, group in distinct.items():
        mask = torch.tensor([any(id(member) == key for member in entry) for entry in groups])
        sent = torch.where(mask, powers, torch.zeros_like(powers)).to(comm.default_device(group))
        comm.all_reduce(sent, op=op, group=group)
        powers = torch.where(mask, sent.cpu(), powers)
    return powers
