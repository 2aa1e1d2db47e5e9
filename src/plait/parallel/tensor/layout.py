"""The layout a tensor-parallel layer's input must have, and the check that refuses any other.

Two layouts, over the ranks of one tensor-parallel group of p ranks:

- replicated: the same tensor on every rank, (s, b, h) sequence-first for plait's
  layers. What every layer takes without sequence parallelism, and what token ids
  and a row-parallel layer's unsplit input (``input_is_parallel=False``) always are.
- sequence-sharded: rank r holds rows [r·s/p, (r+1)·s/p) of the sequence-first
  (s, b, h), an (s/p, b, h) slice different on every rank. What a column-parallel
  input (hence ParallelAttention and ParallelMLP) takes under sequence parallelism.

A mistake in either direction trains silently wrong: a replicated input under
sequence parallelism (HF's (b, s, h) activations, the same on every rank) is
gathered into p copies of every token, so every sharded weight and row bias gets
p times its gradient; a rank-local input without sequence parallelism (each tp
rank given its own batch) is summed across ranks by the row-parallel all-reduce.

The check: on a layer's first forward (``TensorParallel(check_layout="first")``,
the default) every rank all-gathers a fingerprint of its input over the tp group,
its shape, four float64 checksums (two feature projections, each summed with two
row weightings), their norm and the rows' spread, and every rank raises the same ValueError,
naming the layer and the shapes, if the input is replicated where it must be
sharded or differs between ranks where it must be replicated. Cost: one pass over
the input and an all-gather of p·13 float64 numbers, once per layer; later forwards
test one flag. ``"always"`` repeats it every forward (a recomputed forward too:
every rank recomputes the same layers, so the extra all-gathers stay matched);
``"off"`` never runs it. With "first", activation recomputation (the forward run
again in the backward) runs no check; pipeline stages each check their own layers
on their first micro-batch, over their own tp group (the check never spans stages).
The rounding of a "replicated" tensor may differ between ranks (another
all-reduce order), so checksums equal to within ``TOLERANCE`` of
their norm count as the same; token ids must be equal exactly. Not visible to the
check: an input whose rows are all equal, or zero (a replicated and a sharded one
look alike: nothing is refused), and a batch-first input sharded along its own
sequence dim, (b, s/p, h), which has the shape of (s/p, b, h): the layers take dim
0 as the sequence (a position-wise MLP is still exact; attention would attend
within chunks), so a batch-first caller converts with ``SequenceParallelEntry``.
Not checked either: fx proxies, meta tensors and code being compiled.
"""

from __future__ import annotations

import torch

from plait import comm

FIRST, ALWAYS, OFF = "first", "always", "off"
LAYOUT_CHECKS = (FIRST, ALWAYS, OFF)
REPLICATED, SEQUENCE_SHARDED = "replicated", "sequence-sharded"

# |checksum difference| <= TOLERANCE · norm counts as equal: above the rounding by
# which two ranks' copies of one replicated tensor may differ (~ unit roundoff of the
# dtype: 1e-16, 6e-8, 4e-3), far below the O(1) differences of different data.
TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}
_MAX_DIMS = 6
_GOLDEN = 0.6180339887498949  # irrational steps: weights no data pattern lines up with
_SILVER = 0.4142135623730951
_FIELDS = 1 + _MAX_DIMS + 6  # ndim, dims, 4 checksums, norm, row spread


def _weights(count: int, step: float, device) -> torch.Tensor:
    """1 + frac(i·step), i < count: in [1, 2), deterministic, the same on every rank."""
    return 1.0 + torch.remainder(torch.arange(count, dtype=torch.float64, device=device) * step, 1.0)


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """(_FIELDS,) float64: ndim, up to 6 dims (the rest multiplied into the last), then
    for R = rows of x ((numel/h, h)) and P = R·W with two generic feature weightings
    W (h, 2) (a LayerNorm output's rows sum to 0, so plain row sums would not tell
    shards apart): u₁ᵀP, u₂ᵀP for two row weightings, ‖P‖ and the spread ‖P - mean
    row‖ (0: every row equal). One pass over x."""
    dims = list(x.shape)
    if len(dims) > _MAX_DIMS:
        dims = dims[:_MAX_DIMS - 1] + [int(torch.tensor(dims[_MAX_DIMS - 1:]).prod())]
    shape = [float(x.dim())] + [float(d) for d in dims] + [-1.0] * (_MAX_DIMS - len(dims))
    values = torch.zeros(6, dtype=torch.float64, device=x.device)
    if x.numel():
        width = x.shape[-1] if x.dim() else 1
        rows = x.detach().reshape(-1, width)
        # float64 stays float64; integers (token ids, exact below 2^53) and half types go through float32/64
        compute = torch.float64 if not rows.is_floating_point() or rows.dtype == torch.float64 else torch.float32
        features = torch.stack([_weights(width, _GOLDEN, x.device), _weights(width, _SILVER, x.device)], dim=1)
        projected = (rows.to(compute) @ features.to(compute)).double()  # (rows, 2)
        row_weights = torch.stack([_weights(rows.shape[0], _SILVER, x.device),
                                   2.0 - _weights(rows.shape[0], _GOLDEN, x.device) * 0.5], dim=0)  # (2, rows)
        sums = (row_weights @ projected).reshape(-1)  # (4,)
        spread = torch.linalg.vector_norm(projected - projected.mean(dim=0))
        values = torch.cat([sums, torch.linalg.vector_norm(projected).reshape(1), spread.reshape(1)])
    return torch.cat([torch.tensor(shape, dtype=torch.float64, device=x.device), values])


def _shape_of(row: torch.Tensor) -> tuple[int, ...]:
    ndim = int(row[0])
    return tuple(int(d) for d in row[1:1 + min(ndim, _MAX_DIMS)])


def _same(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    """Equal shapes and checksums within ``tolerance`` of the larger norm."""
    if not torch.equal(a[:1 + _MAX_DIMS], b[:1 + _MAX_DIMS]):
        return False
    sums_a, sums_b = a[1 + _MAX_DIMS:5 + _MAX_DIMS], b[1 + _MAX_DIMS:5 + _MAX_DIMS]
    norm = max(float(a[5 + _MAX_DIMS]), float(b[5 + _MAX_DIMS]))
    return float((sums_a - sums_b).abs().max()) <= tolerance * norm


def layout_problem(rows: torch.Tensor, expected: str, tolerance: float, fix: str = "") -> str | None:
    """What is wrong with the inputs whose fingerprints are ``rows`` (p, _FIELDS), one
    per rank, for a layer expecting ``expected``; None if nothing. The same answer on
    every rank (it reads only the gathered rows). ``fix``: another way out, named
    after the first when the input differs between ranks."""
    shapes = [_shape_of(row) for row in rows]
    if any(shape != shapes[0] for shape in shapes):
        listed = ", ".join(f"rank {rank} {shape}" for rank, shape in enumerate(shapes))
        return f"input shapes differ between the tp ranks ({listed}): every rank must feed the same shape"
    same = [_same(rows[0], row, tolerance) for row in rows]
    if expected == REPLICATED:
        differ = [rank for rank, equal in enumerate(same) if not equal]
        if differ:
            return (f"input of shape {shapes[0]} differs between the tp ranks (ranks {differ} from rank 0's) where it "
                    "must be replicated, the same on every rank: give every rank of the tensor-parallel group the "
                    "same batch (e.g. broadcast it within the group; data parallelism splits the batch over the dp "
                    "ranks only)" + (f", or {fix}" if fix else ""))
        return None
    telling = all(float(row[5 + _MAX_DIMS]) > 0 and float(row[6 + _MAX_DIMS]) > 0 for row in rows)
    if telling and all(same):
        seq_dim = "1 for a batch-first (b, s, h), 0 for (s, b, h)"
        return (f"input of shape {shapes[0]} is the same on every tp rank (replicated), not sharded along the "
                f"sequence: with sequence_parallel=True each rank must feed its own sequence-first slice "
                f"(s/tp, b, h) = (s/{rows.shape[0]}, b, h) of the sequence, else every sharded weight gets "
                f"{rows.shape[0]}x its gradient; convert a replicated input with "
                f"plait.parallel.tensor.SequenceParallelEntry(tp, seq_dim=...) or scatter_to_sequence(x, tp, "
                f"seq_dim=...) ({seq_dim}), or use sequence_parallel=False")
    return None


def _checkable(x) -> bool:
    """A plain tensor holding data: not an fx proxy, a meta/fake tensor or a tensor being compiled."""
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.device.type == "meta":
        return False
    return not torch.compiler.is_compiling()


def check_layout(x: torch.Tensor, tp, expected: str, owner: str, fix: str = "") -> None:
    """Collective over ``tp``'s group: raise ValueError on every rank, naming ``owner``
    and the shapes, unless ``x`` has the ``expected`` layout (REPLICATED or
    SEQUENCE_SHARDED) over the group (``fix``: see layout_problem). A group of one
    has nothing to compare."""
    if tp.size == 1 or not _checkable(x):
        return
    with torch.no_grad():
        mine = fingerprint(x).to(comm.default_device(tp.group))
        everyone = torch.empty(tp.size * mine.numel(), dtype=mine.dtype, device=mine.device)
        comm.all_gather_single(everyone, mine, group=tp.group, algorithm=tp.algorithm)
    tolerance = TOLERANCE.get(x.dtype, 0.0)  # integers (token ids): exactly equal
    problem = layout_problem(everyone.view(tp.size, -1).cpu(), expected, tolerance, fix)
    if problem:
        sp = "sequence_parallel=True" if tp.sequence_parallel else "sequence_parallel=False"
        raise ValueError(f"{owner} ({sp}, tp={tp.size}, this rank {tp.rank} has shape {tuple(x.shape)}): {problem} "
                         f"(TensorParallel(check_layout='off') skips this check)")


class LayoutCheck:
    """A layer's input check: the layout it expects and whether its first forward
    has run the check (``TensorParallel.check_layout`` says when to run it). Plain
    state on the layer, copied with it."""

    def __init__(self, owner: str, expected: str, fix: str = ""):
        if expected not in (REPLICATED, SEQUENCE_SHARDED):
            raise ValueError(f"expected={expected!r} must be {REPLICATED!r} or {SEQUENCE_SHARDED!r}")
        self.owner, self.expected, self.fix, self.checked = owner, expected, fix, False

    def __call__(self, x: torch.Tensor, tp) -> None:
        mode = tp.check_layout
        if mode == OFF or (mode == FIRST and self.checked) or tp.size == 1:
            return
        check_layout(x, tp, self.expected, self.owner, self.fix)
        self.checked = _checkable(x)  # an unchecked proxy or compiled call leaves the next one to check

    def __repr__(self) -> str:
        return f"LayoutCheck({self.owner!r}, {self.expected}, checked={self.checked})"


def column_input_check(owner: str, tp) -> LayoutCheck:
    """A column-parallel input's check: sharded along the sequence under sequence
    parallelism, replicated otherwise (where sharding the sequence is the other way out)."""
    if tp.sequence_parallel:
        return LayoutCheck(owner, SEQUENCE_SHARDED)
    return LayoutCheck(owner, REPLICATED, "shard the sequence with sequence_parallel=True (each rank its own "
                                          "(s/tp, b, h) slice)")
