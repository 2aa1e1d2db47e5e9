"""Reduction ops and applying a step's receives: shared by both executors, so the
virtual executor and real ranks produce the same bits."""

from __future__ import annotations

from typing import Callable

import torch

from plait.comm.schedule import Transfer

OP_NAMES = ("sum", "avg", "min", "max", "prod", "band", "bor", "bxor")
BITWISE_OPS = ("band", "bor", "bxor")
FLOATING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)
REDUCING_DTYPES = FLOATING_DTYPES + INTEGER_DTYPES + (torch.bool,) + COMPLEX_DTYPES

# what each op may reduce, as torch.distributed over gloo allows it: bool SUM is OR and
# PRODUCT is AND (torch's own add/mul on bool); bitwise ops take integers and bool;
# complex tensors take SUM and AVG only; AVG needs a floating (or complex) dtype
ALLOWED_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "sum": REDUCING_DTYPES,
    "avg": FLOATING_DTYPES + COMPLEX_DTYPES,
    "min": FLOATING_DTYPES + INTEGER_DTYPES + (torch.bool,),
    "max": FLOATING_DTYPES + INTEGER_DTYPES + (torch.bool,),
    "prod": FLOATING_DTYPES + INTEGER_DTYPES + (torch.bool,),
    "band": INTEGER_DTYPES + (torch.bool,),
    "bor": INTEGER_DTYPES + (torch.bool,),
    "bxor": INTEGER_DTYPES + (torch.bool,),
}

Combine = Callable[[torch.Tensor, torch.Tensor], None]


def _sum(local: torch.Tensor, incoming: torch.Tensor) -> None:
    local.add_(incoming)


def _prod(local: torch.Tensor, incoming: torch.Tensor) -> None:
    local.mul_(incoming)


def _min(local: torch.Tensor, incoming: torch.Tensor) -> None:
    torch.minimum(local, incoming, out=local)


def _max(local: torch.Tensor, incoming: torch.Tensor) -> None:
    torch.maximum(local, incoming, out=local)


def _band(local: torch.Tensor, incoming: torch.Tensor) -> None:
    local.bitwise_and_(incoming)


def _bor(local: torch.Tensor, incoming: torch.Tensor) -> None:
    local.bitwise_or_(incoming)


def _bxor(local: torch.Tensor, incoming: torch.Tensor) -> None:
    local.bitwise_xor_(incoming)


# avg reduces with sum; the collective divides by p at the end
COMBINE: dict[str, Combine] = {"sum": _sum, "avg": _sum, "min": _min, "max": _max, "prod": _prod,
                               "band": _band, "bor": _bor, "bxor": _bxor}


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
            f"unsupported reduce op {op!r}; valid: ReduceOp.SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR "
            f"(or the strings {', '.join(OP_NAMES)})"
        )
    return name


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_reducible(dtype: torch.dtype, op: str, collective: str) -> None:
    """Refuse (dtype, op) pairs torch.distributed refuses, naming the op, the dtype
    and what is allowed."""
    if dtype not in REDUCING_DTYPES:
        raise TypeError(f"{collective} cannot reduce {dtype}; reducible dtypes: {_names(REDUCING_DTYPES)}")
    allowed = ALLOWED_DTYPES[op]
    if dtype in allowed:
        return
    label = f"ReduceOp.{'PRODUCT' if op == 'prod' else op.upper()}"
    ops_for_dtype = ", ".join(
        f"ReduceOp.{'PRODUCT' if name == 'prod' else name.upper()}"
        for name in OP_NAMES if dtype in ALLOWED_DTYPES[name])
    need = {"avg": "a floating-point dtype (or complex)", "band": "an integer or bool dtype",
            "bor": "an integer or bool dtype", "bxor": "an integer or bool dtype"}.get(op, "a non-complex dtype")
    if op == "avg":
        fix = "use ReduceOp.SUM and divide, or cast to a floating dtype first"
    elif op in BITWISE_OPS:
        fix = "view the bits as an integer dtype (tensor.view(torch.int32)) or use another op"
    else:
        fix = "complex tensors have no order: reduce torch.view_as_real(tensor) instead"
    raise TypeError(
        f"{collective} with op={label} needs {need}, got {dtype}: {label} takes {_names(allowed)}; "
        f"{dtype} takes {ops_for_dtype}. Fix: {fix}"
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
