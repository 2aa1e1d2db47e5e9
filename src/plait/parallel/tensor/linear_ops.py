"""Column- and row-parallel linear maps fused with their collective, as single
autograd functions (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication).

Composed from the mappings (``F.linear(copy_to_region(x))``, ``reduce_from_region(
F.linear(x))``), each collective works on a tensor autograd also hands elsewhere, so
it copies first (1 MiB per call at plait bench tp's sizes), and the backward of a
column-parallel layer runs its input-gradient all-reduce only after autograd's linear
node has computed both gradients. Fused, the function owns the tensors it reduces and
orders the backward as Megatron does:

  column-parallel, Y = X Aᵣ + bᵣ (X replicated, or all-gathered from (s/p, b, h) under
  sequence parallelism):
    dX = dY Aᵣ            (N·out/p·in multiply-adds)
    launch all-reduce(dX), async   (reduce-scatter along dim 0 under sequence parallelism)
    dAᵣ = dYᵀ X, dbᵣ = Σ dY   (N·out/p·in multiply-adds: run while the collective moves)
    wait
  (``TensorParallel.async_grad_reduce``; by default async only for accelerator tensors:
  on the CPU plait's async collective runs on its comm thread, whose hand-offs cost
  more there than the overlap hides, so it runs synchronously after dX)
  row-parallel, Y = Σᵣ Xᵣ Bᵣ: the partial product is reduced in place (reduce-scattered
  under sequence parallelism); backward (all-gather of dY under sequence parallelism)
  dXᵣ = dY Bᵣ, dBᵣ = dYᵀ Xᵣ, no communication without sequence parallelism.

The gradients are the very operations autograd runs for ``F.linear`` (its addmm / mm
backward: dX = dY₂ W, dW = dY₂ᵀ X₂, db = Σ₀ dY₂ on the 2-D views, dY₂ = dY.reshape(-1,
out)) and each collective is the mapping's own call on the same tensor, so every
result is bit for bit what the composed mappings give (tests/parallel/test_tp_fused.py).
Where torch would take another path (a non-contiguous input or weight, one feature or
one row, autocast, a trace or compile) ``fusable`` is False and the layers compose the
mappings as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait import comm
from plait.parallel.tensor.group import TensorParallel
from plait.parallel.tensor.mappings import (
    all_gather_dim0,
    copy_to_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_dim0,
    reduce_scatter_to_sequence,
)


def fusable(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> bool:
    """Whether the fused functions give exactly what the composed mappings give: a real
    group, contiguous 2-D-or-more input and weight with more than one row and input
    feature (torch's mm backward then takes the formulas above), no autocast or trace."""
    return (tp.size > 1 and x.dim() >= 2 and x.is_contiguous() and weight.is_contiguous()
            and x.shape[-1] > 1 and x.numel() > x.shape[-1] and x.dtype == weight.dtype
            and not torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling())


def _reduce_in_place(tensor: torch.Tensor, tp: TensorParallel, async_op: bool = False):
    """All-reduce (sum) a contiguous tensor this function owns, in place: no copy."""
    return comm.all_reduce(tensor, comm.ReduceOp.SUM, group=tp.group, async_op=async_op, algorithm=tp.algorithm)


def _weight_grads(ctx, grad_2d: torch.Tensor, total: torch.Tensor):
    """(dW, db) as autograd's addmm/mm backward computes them, None where not needed."""
    grad_weight = grad_2d.t().mm(total.reshape(-1, total.shape[-1])) if ctx.needs_input_grad[1] else None
    grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_weight, grad_bias


class ColumnParallelLinearFunction(torch.autograd.Function):
    """Y = X Aᵣ + bᵣ; backward reduces dX over the group (asynchronously, while dAᵣ and
    dbᵣ are computed, where ``tp.overlaps_grad_reduce``). Under sequence parallelism X
    is this rank's (s/p, b, in) and is all-gathered first; dX is then reduce-scattered
    back to (s/p, b, in)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp: TensorParallel):
        total = all_gather_dim0(x, tp) if tp.sequence_parallel else x  # (s, b, in)
        ctx.save_for_backward(total, weight)
        ctx.tp, ctx.has_bias = tp, bias is not None
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        total, weight = ctx.saved_tensors
        tp = ctx.tp
        grad_2d = grad.reshape(-1, grad.shape[-1])  # (N, out/p)
        grad_x = handle = None
        if ctx.needs_input_grad[0]:
            grad_total = grad_2d.mm(weight).view(total.shape)  # ours: reduced without a copy
            overlap = tp.overlaps_grad_reduce(grad_total.device)  # else the collective is done on return
            if tp.sequence_parallel:
                grad_x, handle = reduce_scatter_dim0(grad_total, tp, async_op=overlap)
            else:
                grad_x, handle = grad_total, _reduce_in_place(grad_total, tp, async_op=overlap)
        grad_weight, grad_bias = _weight_grads(ctx, grad_2d, total)  # while the collective runs
        if handle is not None:
            handle.wait()
        return grad_x, grad_weight, grad_bias, None


class RowParallelLinearFunction(torch.autograd.Function):
    """Y = Σᵣ Xᵣ Bᵣ (no bias: the layer adds the replicated one after the sum): the
    partial product, which nothing else holds, all-reduced in place (reduce-scattered
    along dim 0 under sequence parallelism, whose backward all-gathers dY)."""

    @staticmethod
    def forward(ctx, x, weight, tp: TensorParallel):
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.has_bias = tp, False
        partial = F.linear(x, weight)
        if tp.sequence_parallel:
            return reduce_scatter_dim0(partial, tp)[0]
        _reduce_in_place(partial, tp)
        return partial

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if ctx.tp.sequence_parallel:
            grad = all_gather_dim0(grad, ctx.tp)
        grad_2d = grad.reshape(-1, grad.shape[-1])  # (N, out)
        grad_x = grad_2d.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_weight, _ = _weight_grads(ctx, grad_2d, x)
        return grad_x, grad_weight, None


class ReduceOwned(torch.autograd.Function):
    """reduce_from_region for a tensor nobody else holds (a layer's own partial sum, not
    a view): all-reduced in place (marked dirty, so autograd knows) instead of a copy;
    backward identity."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel):
        _reduce_in_place(x, tp)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias, tp: TensorParallel) -> torch.Tensor:
    """``F.linear(parallel_input(x, tp), weight, bias)``: f (or the sequence all-gather)
    then the local product; fused where ``fusable``."""
    if fusable(x, weight, tp):
        return ColumnParallelLinearFunction.apply(x, weight, bias, tp)
    total = gather_from_sequence(x, tp) if tp.sequence_parallel else copy_to_region(x, tp)
    return F.linear(total, weight, bias)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """``parallel_output(F.linear(x, weight), tp)``: the local partial product summed
    over the group (g, or the sequence reduce-scatter); fused where ``fusable``."""
    if fusable(x, weight, tp):
        return RowParallelLinearFunction.apply(x, weight, tp)
    partial = F.linear(x, weight)
    return reduce_scatter_to_sequence(partial, tp) if tp.sequence_parallel else reduce_from_region(partial, tp)


def reduce_partial(partial: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """``parallel_output(partial, tp)`` for a partial sum the caller just made (not a
    view, nothing else holds it): g all-reduces it in place instead of a copy."""
    if tp.sequence_parallel:
        return reduce_scatter_to_sequence(partial, tp)
    if tp.size > 1 and partial.is_contiguous() and partial._base is None and not torch.compiler.is_compiling():
        return ReduceOwned.apply(partial, tp)
    return reduce_from_region(partial, tp)
