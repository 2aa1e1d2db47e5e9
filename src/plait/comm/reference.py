"""Reference results for collectives, and how far a correct implementation may be
from them: the oracle of the tests and of ``plait bench --check``.

Each rank can rebuild every rank's input from seeds and compute the expected output
locally, in float64 (int64 for integer dtypes).

Error bound. A reduction of p values in a floating dtype with unit roundoff u (2^-11
for float16, 2^-8 for bfloat16, 2^-24 for float32, 2^-53 for float64) done in any
order satisfies |computed - exact| <= (p-1) u sum|x_i| + u |exact| (each of the p-1
additions rounds once, then the value is rounded to the dtype; AVG's division adds
one more u |exact|). The float64 reference has at most (p-1) u64 sum|x_i| error itself.
So we allow 2 (p+1) u sum|x_i| per element for SUM/AVG and 2 (p+1) u |prod x_i| for
PRODUCT; MIN, MAX, integer ops and pure data movement must be exact.

Complex SUM/AVG round the real and imaginary parts separately, each as a real sum of
parts no larger than |x_i|, so each part must lie within the same 2 (p+1) u sum|x_i|
(u of the component dtype). Bool reductions are exact: the reference reduces 0/1 in
int64 and reads any nonzero as True (SUM = OR, PRODUCT = AND, BXOR = parity).
"""

from __future__ import annotations

import torch

from plait.names.collectives import BITWISE_OPS

UNIT_ROUNDOFF = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 2.0**-24,
    torch.float64: 2.0**-53,
    torch.complex64: 2.0**-24,
    torch.complex128: 2.0**-53,
}


def _wide(x: torch.Tensor) -> torch.Tensor:
    if x.dtype.is_complex:
        return x.to(torch.complex128)
    return x.to(torch.float64) if x.dtype.is_floating_point else x.to(torch.int64)


def _fold(stack: torch.Tensor, combine) -> torch.Tensor:
    out = stack[0].clone()
    for row in stack[1:]:
        out = combine(out, row)
    return out


def _reduce(stack: torch.Tensor, op: str) -> torch.Tensor:
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.sum(0) / stack.shape[0]
    if op == "prod":
        return stack.prod(0)
    if op == "min":
        return stack.min(0).values
    if op == "max":
        return stack.max(0).values
    if op == "band":
        return _fold(stack, torch.bitwise_and)
    if op == "bor":
        return _fold(stack, torch.bitwise_or)
    if op == "bxor":
        return _fold(stack, torch.bitwise_xor)
    raise ValueError(f"unknown op {op!r}")


def _bound(stack: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
    u = UNIT_ROUNDOFF.get(dtype, 0.0)
    p = stack.shape[0]
    if u == 0.0 or op not in ("sum", "avg", "prod"):
        return torch.zeros(stack.shape[1:], dtype=torch.float64)
    if op == "prod":
        return 2 * (p + 1) * u * stack.abs().to(torch.float64).prod(0)
    return 2 * (p + 1) * u * stack.abs().to(torch.float64).sum(0)


def reference(collective: str, inputs: list[torch.Tensor], op: str = "sum", root: int = 0):
    """Expected per-rank outputs (wide dtype) and per-rank allowed absolute error.

    ``inputs`` are the ranks' inputs in the form :func:`plait.comm.virtual.simulate`
    takes them. Returns (expected, bounds): lists of tensors (or None where a rank has
    no output, e.g. non-root ranks of gather).
    """
    p = len(inputs)
    dtype = inputs[0].dtype if inputs and inputs[0] is not None else torch.float32
    zero = lambda t: torch.zeros(t.shape, dtype=torch.float64)  # noqa: E731
    if collective == "barrier":
        return [None] * p, [None] * p
    wide = [_wide(x.reshape(-1)) for x in inputs]
    if collective in ("all_reduce", "reduce", "reduce_scatter"):
        stack = torch.stack(wide)
        total, bound = _reduce(stack, op), _bound(stack, op, dtype)
        if collective == "all_reduce":
            return [total.clone() for _ in range(p)], [bound for _ in range(p)]
        if collective == "reduce":
            expected = [total if r == root else wide[r] for r in range(p)]
            bounds = [bound if r == root else zero(wide[r]) for r in range(p)]
            return expected, bounds
        chunks, bound_chunks = total.chunk(p), bound.chunk(p)
        return [c.clone() for c in chunks], [b.clone() for b in bound_chunks]
    if collective == "all_gather":
        whole = torch.cat(wide)
        return [whole.clone() for _ in range(p)], [zero(whole) for _ in range(p)]
    if collective == "broadcast":
        return [wide[root].clone() for _ in range(p)], [zero(wide[root]) for _ in range(p)]
    if collective == "gather":
        whole = torch.cat(wide)
        return [whole if r == root else None for r in range(p)], [zero(whole) if r == root else None for r in range(p)]
    if collective == "scatter":
        chunks = wide[root].chunk(p)
        return [c.clone() for c in chunks], [zero(c) for c in chunks]
    if collective == "all_to_all":
        m = wide[0].numel() // p
        expected = [torch.cat([wide[s][d * m : (d + 1) * m] for s in range(p)]) for d in range(p)]
        return expected, [zero(e) for e in expected]
    raise ValueError(f"unknown collective {collective!r}")


def count_wrong(output, expected, bound) -> int:
    """Elements of ``output`` outside ``expected`` +- ``bound`` (NaN counts as wrong)."""
    if expected is None:
        return 0 if output is None else output.numel()
    if output is None or output.numel() != expected.numel():
        return expected.numel() if output is None else max(output.numel(), expected.numel())
    got = _wide(output.reshape(-1))
    if got.dtype.is_complex:  # each part within the bound (see the module docstring)
        error = torch.view_as_real(got - expected.to(got.dtype)).abs().amax(-1)
        return int((~(error <= bound)).sum())
    if got.dtype.is_floating_point:
        error = (got - expected.to(got.dtype)).abs()
        return int((~(error <= bound)).sum())
    if output.dtype != torch.int64:  # integers wrap around in their own dtype, whatever the order
        expected = expected.to(output.dtype).to(torch.int64)
    return int((got != expected).sum())


def rank_inputs(collective: str, world_size: int, numel: int, dtype: torch.dtype, op: str, seed: int = 0):
    """Rank-distinct inputs every rank can rebuild: for rank r a tensor seeded by
    (seed, r). ``numel`` is the per-rank input size (for reduce_scatter, scatter and
    all_to_all it must be a multiple of world_size). Values keep products and
    integer sums small (int8 and uint8 may still wrap for large p; the comparison
    wraps the expected value the same way)."""
    inputs = []
    for rank in range(world_size):
        generator = torch.Generator().manual_seed(seed * 1000003 + rank * 7919 + numel)
        if dtype == torch.bool:
            # mostly True, so AND-like ops (prod, min, band) do not give all False
            values = torch.rand(numel, generator=generator) < 0.8
        elif dtype.is_complex:
            values = torch.complex(torch.randn(numel, generator=generator, dtype=torch.float64),
                                   torch.randn(numel, generator=generator, dtype=torch.float64))
        elif dtype.is_floating_point:
            if op == "prod":
                values = 0.5 + torch.rand(numel, generator=generator, dtype=torch.float64)
            else:
                values = torch.randn(numel, generator=generator, dtype=torch.float64)
        else:
            signed = dtype != torch.uint8
            if op == "prod":
                low, high = (-2, 3) if signed else (0, 3)
            elif op in BITWISE_OPS:  # every bit pattern of the dtype, signs included
                info = torch.iinfo(dtype)
                low, high = max(info.min, -(1 << 62)), min(info.max, (1 << 62))
            else:
                low, high = (-10, 11) if dtype in (torch.int8, torch.uint8) else (-100, 101)
                low = low if signed else 0
            values = torch.randint(low, high, (numel,), generator=generator, dtype=torch.int64)
        inputs.append(values.to(dtype))
    return inputs
