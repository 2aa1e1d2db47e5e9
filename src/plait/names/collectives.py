"""Collective and reduce-op names, as ``torch.distributed`` spells them (lower case
for the ops: ``ReduceOp.PRODUCT`` is "prod")."""

from __future__ import annotations

COLLECTIVES = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "barrier",
)
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")

NO_OP = "none"  # a collective that reduces nothing
REDUCE_OPS = ("sum", "avg", "min", "max", "prod", "band", "bor", "bxor")
BITWISE_OPS = ("band", "bor", "bxor")

__all__ = ["BITWISE_OPS", "COLLECTIVES", "NO_OP", "REDUCE_OPS", "REDUCING", "ROOTED"]
