"""Explicit conversions into and out of the layout tensor-parallel layers expect.

torch's tensor parallelism says where an activation is replicated and where it is
sharded with ``PrepareModuleInput`` / ``SequenceParallel`` styles; plait says it
with two modules around a tensor-parallel region:

    x (b, s, h), the same on every rank (a Hugging Face block's activations)
      -> SequenceParallelEntry(tp, seq_dim=1) -> (s/p, b, h), this rank's slice
      -> plait layers (ColumnParallelLinear, ..., RowParallelLinear)
      -> SequenceParallelExit(tp, seq_dim=1)  -> (b, s, h), the same on every rank

Both are autograd-correct: the entry's backward all-gathers the slices' gradients
into the replicated input's (one all-gather, (p-1)/p·s·b·h elements received per
rank with a ring), the exit's keeps this rank's slice of the replicated gradient (no
communication). Without sequence parallelism the layers take the replicated
(s, b, h), and the two only move the sequence dim to the front and back (no
communication), so one model runs either way.
"""

from __future__ import annotations

from torch import nn

from plait.parallel.tensor.group import TensorParallel
from plait.parallel.tensor.layout import REPLICATED, SEQUENCE_SHARDED, LayoutCheck
from plait.parallel.tensor.mappings import check_seq_dim, gather_to_replicated, scatter_to_sequence


def _check_arguments(owner: str, tp, seq_dim) -> None:
    if not isinstance(tp, TensorParallel):
        raise TypeError(f"{owner}: tp must be a plait.parallel.tensor.TensorParallel, got {type(tp).__name__}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"{owner}: seq_dim must be an int (1 for a batch-first (b, s, h), 0 for (s, b, h)), "
                        f"got {seq_dim!r}")


class SequenceParallelEntry(nn.Module):
    """Replicated x with its sequence at dim ``seq_dim`` -> the layout tp's layers
    expect: this rank's sequence-first slice (s/p, b, h) under sequence parallelism
    (``scatter_to_sequence``), the replicated (s, b, h) otherwise. Its first forward
    checks (``tp.check_layout``) that x is the same on every rank."""

    def __init__(self, tp: TensorParallel, *, seq_dim: int = 0):
        super().__init__()
        _check_arguments("SequenceParallelEntry", tp, seq_dim)
        self.tp, self.seq_dim = tp, seq_dim
        self.layout_check = LayoutCheck(f"SequenceParallelEntry(seq_dim={seq_dim})", REPLICATED)

    def forward(self, x):  # (..., s at seq_dim, ...) replicated -> (s/p, ...) or (s, ...)
        self.layout_check(x, self.tp)
        if self.tp.sequence_parallel:
            return scatter_to_sequence(x, self.tp, self.seq_dim)
        return x.movedim(check_seq_dim(x, self.seq_dim), 0)

    def extra_repr(self) -> str:
        return f"seq_dim={self.seq_dim}, {self.tp.describe()}"


class SequenceParallelExit(nn.Module):
    """The inverse of SequenceParallelEntry: tp's layers' output (this rank's
    (s/p, b, h) under sequence parallelism, the replicated (s, b, h) otherwise) ->
    the replicated tensor with its sequence back at dim ``seq_dim``
    (``gather_to_replicated``)."""

    def __init__(self, tp: TensorParallel, *, seq_dim: int = 0):
        super().__init__()
        _check_arguments("SequenceParallelExit", tp, seq_dim)
        self.tp, self.seq_dim = tp, seq_dim
        self.layout_check = LayoutCheck(f"SequenceParallelExit(seq_dim={seq_dim})",
                                        SEQUENCE_SHARDED if tp.sequence_parallel else REPLICATED)

    def forward(self, x):  # (s/p, ...) or (s, ...) -> (..., s at seq_dim, ...) replicated
        self.layout_check(x, self.tp)
        if self.tp.sequence_parallel:
            return gather_to_replicated(x, self.tp, self.seq_dim)
        return x.movedim(0, check_seq_dim(x, self.seq_dim))

    def extra_repr(self) -> str:
        return f"seq_dim={self.seq_dim}, {self.tp.describe()}"
