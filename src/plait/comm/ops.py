"""Reduction ops and applying a step's receives: shared by both executors, so the
virtual executor and real ranks produce the same bits."""

from __future__ import annotations

from typing import Callable

import torch

from plait.comm.schedule import Transfer
from plait.names.collectives import BITWISE_OPS, REDUCE_OPS
from plait.names.wire import BY_CODE, COMPLEX, DTYPES, FLOATING, INTEGER, OP_FAMILIES, dtype_name, wire_dtype

OP_NAMES = REDUCE_OPS
# the wire table's reducible dtypes, in its order (torch dtypes: plait.names is torch-free)
FLOATING_DTYPES = tuple(getattr(torch, entry.name) for entry in DTYPES if entry.family == FLOATING)
INTEGER_DTYPES = tuple(getattr(torch, entry.name) for entry in DTYPES if entry.family == INTEGER)
COMPLEX_DTYPES = tuple(getattr(torch, entry.name) for entry in DTYPES if entry.family == COMPLEX)
REDUCING_DTYPES = tuple(getattr(torch, entry.name) for entry in DTYPES if entry.family is not None)

# what each op may reduce (plait.names.wire.OP_FAMILIES), as torch dtypes in the table's order
ALLOWED_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    op: tuple(getattr(torch, entry.name) for entry in DTYPES if entry.family in families)
    for op, families in OP_FAMILIES.items()
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
    return ", ".join(dtype_name(d) for d in dtypes)


def dtype_from_code(code: int) -> torch.dtype:
    """The torch dtype a received wire code names (plait.names.wire)."""
    entry = BY_CODE.get(code)
    if entry is None:
        raise ValueError(f"dtype code {code} is not in plait's wire table (plait.names.wire): the sender runs "
                         "another plait version, or the message is not a plait header")
    return getattr(torch, entry.name)


def check_carried(dtype: torch.dtype, collective: str, torch_gloo: bool = False) -> None:
    """Refuse, before any message, a dtype plait's collectives cannot carry (a quantized
    or sub-byte dtype, or one the wire table lacks), naming it and the fix.
    ``torch_gloo``: the call runs gloo's own collective (``algorithm="torch"``), which
    takes fewer dtypes than plait's algorithms (gloo's send/recv carry any)."""
    entry = wire_dtype(dtype, collective)
    if torch_gloo and not entry.torch_gloo:
        carried = ", ".join(item.name for item in DTYPES if item.torch_gloo)
        raise TypeError(f"{collective}(algorithm='torch') over gloo cannot carry dtype {entry.name}: gloo's own "
                        f"collectives take {carried}; use a plait algorithm (algorithm='auto' or e.g. 'tree'), "
                        f"which carries any whole-byte dtype")


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
