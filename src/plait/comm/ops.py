"""Reduction ops and applying a step's receives: shared by both executors, so the
virtual executor and real ranks produce the same bits."""

from __future__ import annotations

from typing import Callable

import torch

from plait.comm.schedule import Transfer

OP_NAMES = ("sum", "avg", "min", "max", "prod")
REDUCING_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
)

Combine = Callable[[torch.Tensor, torch.Tensor], None]


def _sum(local: torch.Tensor, incoming: torch.Tensor) -> None:
    local.add_(incoming)


def _prod(local: torch.Tensor, incoming: torch.Tensor) -> None:
    local.mul_(incoming)


def _min(local: torch.Tensor, incoming: torch.Tensor) -> None:
    torch.minimum(local, incoming, out=local)


def _max(local: torch.Tensor, incoming: torch.Tensor) -> None:
    torch.maximum(local, incoming, out=local)


# avg reduces with sum; the collective divides by p at the end
COMBINE: dict[str, Combine] = {"sum": _sum, "avg": _sum, "min": _min, "max": _max, "prod": _prod}


def op_name(op) -> str:
    """Normalise a ``torch.distributed.ReduceOp`` (or a name like "sum") to plait's name."""
    if isinstance(op, str):
        name = op.lower()
        name = {"product": "prod", "mean": "avg"}.get(name, name)
    else:
        text = str(getattr(op, "name", None) or op)  # RedOpType.SUM, ReduceOp.SUM or "SUM"
        name = text.rsplit(".", 1)[-1].lower()
        name = {"product": "prod"}.get(name, name)
    if name not in OP_NAMES:
        raise ValueError(
            f"unsupported reduce op {op!r}; valid: ReduceOp.SUM, AVG, MIN, MAX, PRODUCT "
            f"(or the strings {', '.join(OP_NAMES)})"
        )
    return name


def check_reducible(dtype: torch.dtype, op: str, collective: str) -> None:
    """Refuse dtypes that cannot be reduced with ``op``, naming the fix."""
    if dtype not in REDUCING_DTYPES:
        raise TypeError(
            f"{collective} cannot reduce {dtype}; reducible dtypes: "
            f"{', '.join(str(d).replace('torch.', '') for d in REDUCING_DTYPES)}"
        )
    if op == "avg" and not dtype.is_floating_point:
        raise TypeError(
            f"{collective} with op=AVG needs a floating-point dtype, got {dtype}; "
            "use ReduceOp.SUM and divide, or cast to float first"
        )


def apply_receives(
    buffer: torch.Tensor,
    rank: int,
    received: list[tuple[Transfer, torch.Tensor | None]],
    combine: Combine,
) -> None:
    """Land one step's receives into ``buffer`` in the order they are listed.

    ``received`` pairs each incoming transfer with its payload (None when the executor
    already received a copy straight into the buffer). Reducing receives that land on
    the same region in one step (direct, star) are combined with the local value in
    rank order, x_0 op x_1 op ... op x_(p-1), so every rank computes the same bits.
    """
    groups: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
    order: list[tuple[Transfer, torch.Tensor | None]] = []
    for transfer, payload in received:
        if transfer.reduce:
            key = transfer.dst_range
            if key not in groups:
                groups[key] = []
                order.append((transfer, None))
            groups[key].append((transfer.src, payload))
        else:
            order.append((transfer, payload))
    for transfer, payload in order:
        lo, hi = transfer.dst_range
        local = buffer[lo:hi]
        if not transfer.reduce:
            if payload is not None:
                local.copy_(payload)
            continue
        contributions = groups[(lo, hi)]
        if len(contributions) == 1:
            combine(local, contributions[0][1])
            continue
        contributions = sorted(contributions + [(rank, local)], key=lambda item: item[0])
        accumulator = contributions[0][1].clone()
        for _, value in contributions[1:]:
            combine(accumulator, value)
        local.copy_(accumulator)
