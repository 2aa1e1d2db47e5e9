"""The conjugate mappings of Megatron-LM tensor parallelism, as autograd functions.

Each is a named ``torch.autograd.Function`` (CopyToRegion, ReduceFromRegion,
ScatterToRegion, GatherFromRegion, ScatterToSequence, GatherFromSequence,
ReduceScatterToSequence, GatherToReplicated) called through the function of the same name in snake
case. Each is a pair (forward collective, backward collective) whose two halves are
adjoint, so gradients of a sharded model equal the unsharded model's:

  copy_to_region          f: forward identity,            backward all-reduce
  reduce_from_region      g: forward all-reduce,          backward identity
  scatter_to_region          forward split last dim,      backward all-gather last dim
  gather_from_region         forward all-gather last dim, backward split last dim
  scatter_to_sequence        forward split dim 0,         backward all-gather dim 0
  gather_from_sequence       forward all-gather dim 0,    backward reduce-scatter dim 0
  reduce_scatter_to_sequence forward reduce-scatter dim 0, backward all-gather dim 0
  gather_to_replicated       forward all-gather dim 0,    backward split dim 0

Hidden states are laid out (sequence, batch, hidden), so the sequence-parallel
mappings work on dim 0 and their buffers are contiguous slabs. For a tensor of n
elements and p ranks, a ring all-reduce sends 2(p-1)/p n per rank and a ring
all-gather or reduce-scatter (p-1)/p n, so with the ring the sequence-parallel
pair costs what the one all-reduce did (other algorithms differ: a star
all-gather plus reduce-scatter sends more than a star all-reduce).
A group of one runs no collective.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.parallel.tensor.group import TensorParallel


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor we may overwrite (collectives work in place)."""
    out = tensor.contiguous()
    return out.clone() if out is tensor else out


def all_reduced_copy(tensor: torch.Tensor, tp: TensorParallel, op: str = "sum") -> torch.Tensor:
    """A copy of ``tensor`` all-reduced over the tensor-parallel group (the input is left as it was)."""
    return all_reduce_owned(_fresh(tensor), tp, op)


def all_reduce_owned(tensor: torch.Tensor, tp: TensorParallel, op: str = "sum") -> torch.Tensor:
    """``tensor`` all-reduced in place over the tensor-parallel group and returned: for a
    contiguous tensor the caller just made and nothing else holds (no copy, unlike
    ``all_reduced_copy``)."""
    if tp.size > 1:
        reduce_op = {"sum": comm.ReduceOp.SUM, "max": comm.ReduceOp.MAX}[op]
        comm.all_reduce(tensor, reduce_op, group=tp.group, algorithm=tp.algorithm)
    return tensor


def all_gather_dim0(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(n, ...) on each rank -> (p*n, ...) in rank order: an all-gather over the
    tensor-parallel group along dim 0, not differentiable (the mappings and
    ``sharding.gather_tensor`` build on it)."""
    local = tensor.contiguous()
    out = torch.empty((tp.size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    comm.all_gather_single(out, local, group=tp.group, algorithm=tp.algorithm)
    return out


def reduce_scatter_dim0(tensor: torch.Tensor, tp: TensorParallel, async_op: bool = False):
    """(p*n, ...) on each rank -> (the sum over ranks of rows [r*n, (r+1)*n), the
    collective's handle): with ``async_op`` the output is complete once the handle is
    waited for (else the handle is None)."""
    full = tensor.contiguous()
    rows = full.shape[0]
    if rows % tp.size:
        raise ValueError(f"sequence length {rows} is not divisible by tp={tp.size}: with sequence parallelism "
                         f"use a sequence length that is a multiple of {tp.size}")
    out = torch.empty((rows // tp.size, *full.shape[1:]), dtype=full.dtype, device=full.device)
    handle = comm.reduce_scatter_single(out, full, group=tp.group, async_op=async_op, algorithm=tp.algorithm)
    return out, handle


def _reduce_scatter_dim0(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return reduce_scatter_dim0(tensor, tp)[0]


def _split(tensor: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    size = tensor.shape[dim]
    if size % tp.size:
        what = "sequence length" if dim == 0 else f"size of dim {dim}"
        raise ValueError(f"{what} {size} is not divisible by tp={tp.size}; use a multiple of {tp.size}")
    return tensor.chunk(tp.size, dim=dim)[tp.rank].contiguous()


def _gather_last(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(..., n) on each rank -> (..., p*n) in rank order."""
    gathered = all_gather_dim0(tensor.unsqueeze(0), tp)  # (p, ..., n)
    return torch.cat(gathered.unbind(0), dim=-1)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.view_as(x)  # a new tensor object, as an autograd function's output must be


class CopyToRegion(torch.autograd.Function):
    """Megatron's f, at the input of a column-parallel region: every rank uses the
    same X, and each rank's part of the loss depends on it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """Y = X on every rank; no communication."""
        ctx.tp = tp
        return _identity(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """dX = sum over ranks r of dY_r: one all-reduce (sum) of the whole gradient,
        2(p-1)/p n elements sent per rank with a ring."""
        return all_reduced_copy(grad, ctx.tp), None


class ReduceFromRegion(torch.autograd.Function):
    """Megatron's g, at the output of a row-parallel region: each rank holds a
    partial sum of Y."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """Y = sum over ranks r of X_r: one all-reduce (sum)."""
        return all_reduced_copy(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """dX_r = dY (the same on every rank, as Y is); no communication."""
        return _identity(grad), None


class ScatterToRegion(torch.autograd.Function):
    """Split the last dim: (..., n) replicated -> this rank's (..., n/p)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """Y_r = X[..., r n/p : (r+1) n/p]; no communication."""
        ctx.tp = tp
        return _split(x, tp, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """dX = concat over r of dY_r along the last dim: one all-gather, (p-1)/p n
        elements received per rank with a ring."""
        return _gather_last(grad, ctx.tp), None


class GatherFromRegion(torch.autograd.Function):
    """Concatenate the last dim: (..., n/p) on each rank -> (..., n) on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """Y = concat over r of X_r along the last dim: one all-gather."""
        ctx.tp = tp
        return _gather_last(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """dX_r = dY[..., r n/p : (r+1) n/p] (dY is the same on every rank); no
        communication."""
        return _split(grad, ctx.tp, -1), None


class ScatterToSequence(torch.autograd.Function):
    """Split dim 0 (the sequence): (s, ...) replicated -> this rank's (s/p, ...)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """Y_r = X[r s/p : (r+1) s/p]; no communication."""
        ctx.tp = tp
        return _split(x, tp, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """dX = concat over r of dY_r along dim 0: one all-gather."""
        return all_gather_dim0(grad, ctx.tp), None


class GatherFromSequence(torch.autograd.Function):
    """Sequence parallelism's all-gather, at the input of a column-parallel layer:
    (s/p, ...) shards -> the full (s, ...) on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """Y = concat over r of X_r along dim 0: one all-gather, (p-1)/p s·b·h
        elements received per rank with a ring."""
        ctx.tp = tp
        return all_gather_dim0(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """dX_r = sum over ranks q of dY_q[r s/p : (r+1) s/p] (each rank's loss part
        depends on all of Y): one reduce-scatter along dim 0."""
        return _reduce_scatter_dim0(grad, ctx.tp), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's reduce-scatter, at the output of a row-parallel layer:
    (s, ...) partial sums -> this rank's (s/p, ...) of the total."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """Y_r = sum over ranks q of X_q[r s/p : (r+1) s/p]: one reduce-scatter along
        dim 0, (p-1)/p s·b·h elements sent per rank with a ring."""
        ctx.tp = tp
        return _reduce_scatter_dim0(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """dX_q = concat over r of dY_r along dim 0 (the same on every rank q): one
        all-gather."""
        return all_gather_dim0(grad, ctx.tp), None


class GatherToReplicated(torch.autograd.Function):
    """Leave sequence parallelism for a replicated consumer: (s/p, ...) shards -> the
    full (s, ...) on every rank, used the same way on every rank (a loss, a layer
    outside the tensor-parallel region). Unlike GatherFromSequence, whose consumer is
    a column-parallel layer (each rank's loss part depends on all of Y, so backward
    sums), the gradient arriving here is the same on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """Y = concat over r of X_r along dim 0: one all-gather."""
        ctx.tp = tp
        return all_gather_dim0(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """dX_r = dY[r s/p : (r+1) s/p] (dY replicated); no communication."""
        return _split(grad, ctx.tp, 0), None


class _SumGradsInBackward(torch.autograd.Function):
    """Identity on parameters whose gradient each rank computes only in part (those
    used on a sequence shard); backward sums their gradients over the group in one
    coalesced all-reduce. Returning the summed increment (rather than all-reducing
    .grad afterwards) keeps gradient accumulation exact."""

    @staticmethod
    def forward(ctx, tp, *params):
        ctx.tp = tp
        ctx.shapes = [param.shape for param in params]
        ctx.dtype, ctx.device = params[0].dtype, params[0].device
        return tuple(param.view_as(param) for param in params)

    @staticmethod
    def backward(ctx, *grads):
        filled = [torch.zeros(shape, dtype=ctx.dtype, device=ctx.device) if grad is None else grad
                  for grad, shape in zip(grads, ctx.shapes)]
        flat = all_reduce_owned(torch.cat([grad.reshape(-1) for grad in filled]), ctx.tp)  # cat: a new tensor
        pieces = flat.split([shape.numel() for shape in ctx.shapes])
        return (None, *[piece.view(shape) for piece, shape in zip(pieces, ctx.shapes)])


def _apply(function, x, tp: TensorParallel):
    return x if tp.size == 1 else function.apply(x, tp)


def copy_to_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Megatron's f: the input of a column-parallel region (backward all-reduces)."""
    return _apply(CopyToRegion, x, tp)


def reduce_from_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Megatron's g: the output of a row-parallel region (forward all-reduces)."""
    return _apply(ReduceFromRegion, x, tp)


def scatter_to_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Keep this rank's 1/p slice of the last dim (backward all-gathers it)."""
    return _apply(ScatterToRegion, x, tp)


def gather_from_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Concatenate every rank's last-dim slice (backward keeps this rank's slice)."""
    return _apply(GatherFromRegion, x, tp)


def scatter_to_sequence(x: torch.Tensor, tp: TensorParallel, seq_dim: int = 0) -> torch.Tensor:
    """A replicated tensor whose sequence is dim ``seq_dim`` -> this rank's
    sequence-first slice (s/p, ...) (backward all-gathers): ``seq_dim=1`` takes a
    batch-first (b, s, h) to (s/p, b, h), what sequence-parallel layers expect."""
    return _apply(ScatterToSequence, _sequence_first(x, seq_dim), tp)


def gather_from_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(s/p, ...) -> (s, ...) by all-gather (backward reduce-scatters): the input of a
    column-parallel layer under sequence parallelism."""
    return _apply(GatherFromSequence, x, tp)


def gather_to_replicated(x: torch.Tensor, tp: TensorParallel, seq_dim: int = 0) -> torch.Tensor:
    """This rank's sequence-first (s/p, ...) -> the whole sequence on every rank, put
    back at dim ``seq_dim`` (1: (b, s, h)); backward keeps this rank's slice of the
    (replicated) gradient. The inverse of ``scatter_to_sequence``."""
    return _apply(GatherToReplicated, x, tp).movedim(0, check_seq_dim(x, seq_dim))


def check_seq_dim(x: torch.Tensor, seq_dim) -> int:
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"seq_dim must be an int (the dim holding the sequence), got {seq_dim!r}")
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim} is not a dim of a tensor of shape {tuple(x.shape)}")
    return seq_dim


def _sequence_first(x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    return x.movedim(check_seq_dim(x, seq_dim), 0)


def reduce_scatter_to_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(s, ...) partial sums -> this rank's (s/p, ...) of the total (backward
    all-gathers): the output of a row-parallel layer under sequence parallelism."""
    return _apply(ReduceScatterToSequence, x, tp)


def sum_grads_in_backward(tp: TensorParallel, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of ``params`` whose gradients are summed over the group in backward
    (one all-reduce for all of them): for replicated parameters used in a
    sequence-parallel region. Without sequence parallelism the parameters come back
    unchanged (their gradients are already identical on every rank)."""
    if tp.size == 1 or not tp.sequence_parallel:
        return params
    return _SumGradsInBackward.apply(tp, *params)
