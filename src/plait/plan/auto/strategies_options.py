"""What one operator may do along ONE mesh axis of ``p`` ranks: its 1-D sharding options
(``AxisOption``), per operator kind. ``plait.plan.auto.strategies`` combines them over the
mesh's axes and prices the combinations.

Each option gives one placement for the output, for every tensor input (the node's
``inputs``, in order) and for every parameter (the node's ``params``, in order), and
says which replicated inputs/parameters get a *partial* gradient along the axis (the
executor's identity wrap whose backward all-reduces, Megatron's copy_to_region; for a
parameter under batch sharding it is data parallelism's gradient all-reduce):

    linear     y = x W^T + b, x (..., in), W (out, in) (or (in, out): attrs weight_out_dim 1,
               HF's Conv1D; "S0"/"S1" below then name W's out/in dim where it lies)
               batch     x S0, W R, y S0              W, b partial
               sequence  x S1, W R, y S1  (3-d x)     W, b partial
               column    x R, W S0, b S0, y S(last)   x partial
               row       x S(last), W S1, b R, y P    none (b is added once; its grad is whole)
    matmul     a (..., m, k) @ b (..., k, n)
               batch<j>  output batch dim j: S on the operands that have it, R (partial) on a
                         broadcast one;  m: a S(-2), b R (partial), y S(-2);
               n: a R (partial), b S(-1), y S(-1);  k: a S(-1), b S(-2), y P
    attention  sdpa(q, k, v[, mask]), (B, heads, s, d): batch (S0 everywhere), heads (S1)
    conv       x (N, C, ...), W (Cout, Cin/g, ...): batch (x S0, y S0; W, b partial),
               out (x R partial, W S0, b S0, y S1), in (x S1, W S1, b R, y P; groups 1 only)
    embedding  ids (...), table (V, E): batch (ids S0, y S0; table partial), sequence (ids S1),
               column (table S1, y S(last)), vocab (table S0, y P: masked lookup)
    norm       S<d> of a non-normalised dim d, follows; weight/bias R partial
    softmax    S<d> for d != the softmax dim, follows
    elementwise  S<d> of the output dim d; inputs/params by broadcasting (missing or size
               1 there: R, partial when it has a gradient; a parameter read through folded
               views, attrs param_operands, maps back to its own dim, never through a slice)
    reduce     S<d> of the input: a kept dim follows, a reduced dim gives P (sum, mean only)
    view       S<d> of the input carried through the reshape when d leads its group of
               dims (attrs dim_groups) and both leading sizes divide by p (same flat
               ranges); never through a sliced dim (attrs sliced_dims: split, slice, cat),
               except "fused": a slice that is one of k equal parts (attrs start, step 1)
               tiling the last dim of a linear read only by such slices keeps S<d> on
               both sides: the linear's S<d> is then BLOCKED (rank r holds its 1/p of
               each part: the executor shards W/b per part, ColwiseParallel(fused=k))
    permute    S<d> moves to the output position of d (attrs perm: out dim j = in dim perm[j])
    loss       batch: the inputs S0, the output P (a scalar) or S0 (reduction "none")
    input      batch S0, sequence S1
    constant, output: replicated only

Every kind has the all-replicated option ("replicated") first. An option never shards a
dim whose size does not divide by ``p``, and never gives a P output on a merged chain
that is not linear in its head's value (A's attrs partial_ok False: a linear + gelu).
"""

from __future__ import annotations

import math

from plait.names.placements import PARTIAL, REPLICATE, shard
from plait.plan.auto.strategies_axis import (REPLICATED_STYLE, AxisOption, Shapes, divides, follow, kept, norm_dim,
                                             param_placements)
from plait.plan.auto.strategies_products import (attention_options, conv_options, embedding_options, linear_options,
                                                 matmul_options)

__all__ = ["AxisOption", "Shapes", "axis_options", "REPLICATED_STYLE", "FUSED_STYLE"]

FUSED_STYLE = "fused"

# reductions whose result over a split dim is the sum of the ranks' partial results (a
# mean's summands are the local sums over the global count)
_SUMS = ("sum", "mean")


def axis_options(node, shapes: Shapes, p: int) -> list[AxisOption]:
    """The 1-D options of ``node`` on an axis of ``p`` ranks, the replicated one first."""
    replicated = AxisOption(REPLICATED_STYLE, REPLICATE, (REPLICATE,) * len(shapes.inputs),
                            (REPLICATE,) * len(shapes.params))
    if p == 1:
        return [replicated]
    builder = _BUILDERS.get(node.kind)
    found = builder(node, shapes, p) if builder is not None else []
    if node.attr("partial_ok", True) is False:  # a merged non-linear chain (gelu): gelu(a) + gelu(b) != gelu(a + b)
        found = [option for option in found if option.output != PARTIAL]
    return [replicated] + found


def _elementwise(node, shapes: Shapes, p: int) -> list[AxisOption]:
    return kept(follow(node, shapes, p, d, f"S{d}") for d, size in enumerate(shapes.out) if divides(size, p))


def _norm(node, shapes: Shapes, p: int) -> list[AxisOption]:
    leading = len(shapes.out) - int(node.attr("normalized_ndim", 1))
    return kept(follow(node, shapes, p, d, f"S{d}") for d in range(leading) if divides(shapes.out[d], p))


def _softmax(node, shapes: Shapes, p: int) -> list[AxisOption]:
    dim = norm_dim(int(node.attr("dim", -1)), len(shapes.out), node, "dim")
    return kept(follow(node, shapes, p, d, f"S{d}") for d, size in enumerate(shapes.out)
                if d != dim and divides(size, p))


def _reduce(node, shapes: Shapes, p: int) -> list[AxisOption]:
    x = shapes.inputs[0]
    dims = node.attr("dims")
    reduced = set(range(len(x))) if not dims else {norm_dim(int(d), len(x), node, "dims") for d in dims}
    keepdim = bool(node.attr("keepdim", False))
    rest = tuple(REPLICATE for _ in shapes.inputs[1:])
    found = []
    for d, size in enumerate(x):
        if not divides(size, p):
            continue
        if d in reduced:
            if node.attr("op", "sum") not in _SUMS:
                continue  # a max / top-k over a split dim is no sum of the ranks' parts
            output = PARTIAL
        else:
            output = shard(d if keepdim else d - sum(1 for r in reduced if r < d))
        found.append(AxisOption(f"S{d}", output, (shard(d),) + rest, param_placements(shapes, {})))
    return found


def _view_groups(src, dst):
    """Pairs (src dims, dst dims) of the reshape ``src`` -> ``dst`` whose products match,
    smallest first (size-1 dims join the group before them)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [i] if i < len(src) else [], [j] if j < len(dst) else []
        pi = src[i] if i < len(src) else 1
        pj = dst[j] if j < len(dst) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                return None
        groups.append((gi, gj))
    return groups


def _view(node, shapes: Shapes, p: int) -> list[AxisOption]:
    """A's attrs ``dim_groups`` ((in dims), (out dims)) and ``sliced_dims`` when traced;
    hand-built nodes: the groups of equal products (same element count) or, for a piece
    of a split / slice (same ndim), the dims of unchanged size. Several inputs (cat,
    stack) are sharded alike on the dim when each has it at the first's size."""
    src, dst = shapes.inputs[0], shapes.out
    groups = node.attr("dim_groups")
    sliced = set(node.attr("sliced_dims", ()) or ())
    if groups is None:
        if math.prod(src) == math.prod(dst):
            groups = _view_groups(src, dst) or ()
        elif len(src) == len(dst):
            groups = tuple(((d,), (d,)) for d in range(len(src)))
            sliced |= {d for d, (a, b) in enumerate(zip(src, dst)) if a != b}
        else:
            groups = ()
    found = []
    for gi, gj in groups:
        if not gi or not gj:
            continue
        i, j = gi[0], gj[0]
        if i in sliced or not divides(src[i], p) or not divides(dst[j], p):
            continue
        if any(len(shape) <= i or shape[i] != src[i] for shape in shapes.inputs[1:]):
            continue
        found.append(AxisOption(f"S{i}", shard(j), (shard(i),) * len(shapes.inputs), param_placements(shapes, {})))
    found.sort(key=lambda option: int(option.style[1:]))
    d = shapes.fused_dim
    if d is not None and divides(dst[d], p):
        # a part of a fused linear output (q, k, v of one product): the producer's S<d> read as
        # BLOCKED, rank r holding its 1/p of every part (Megatron's fused QKV, ColwiseParallel(fused=k))
        found.append(AxisOption(FUSED_STYLE, shard(d), (shard(d),), param_placements(shapes, {})))
    return found


def _permute(node, shapes: Shapes, p: int) -> list[AxisOption]:
    """attrs ``perm``: output dim j is input dim perm[j] (``dims`` accepted too)."""
    src = shapes.inputs[0]
    perm = node.attr("perm", node.attr("dims"))
    if perm is None or sorted(norm_dim(int(d), len(src), node, "perm") for d in perm) != list(range(len(src))):
        raise ValueError(f"node {node.name!r} (permute) needs attrs['perm'], a permutation of its input's "
                         f"{len(src)} dims; it has {perm!r}")
    order = [norm_dim(int(d), len(src), node, "perm") for d in perm]
    return [AxisOption(f"S{d}", shard(order.index(d)), (shard(d),), param_placements(shapes, {}))
            for d, size in enumerate(src) if divides(size, p)]


def _loss(node, shapes: Shapes, p: int) -> list[AxisOption]:
    """Batch: the input and a target with its dim 0 are S0 (anything else R); the output P (a
    reduced loss: the ranks' summands) or S0 (reduction "none"). Not for a classification
    loss over one unbatched sample (attrs class_dim 0: dim 0 is the classes)."""
    first = shapes.inputs[0]
    if not first or not divides(first[0], p) or (node.attr("op") in ("cross_entropy", "nll")
                                                    and int(node.attr("class_dim", 1)) == 0):
        return []
    inputs = tuple(shard(0) if position < 2 and shape and shape[0] == first[0] else REPLICATE
                   for position, shape in enumerate(shapes.inputs))  # (input, target); a class weight stays R
    output = shard(0) if shapes.out and shapes.out[0] == first[0] else PARTIAL
    return [AxisOption("batch", output, inputs, param_placements(shapes, {}),
                       tuple(i for i, placement in enumerate(inputs) if placement == REPLICATE),
                       tuple(name for name, _ in shapes.params))]


def _input(node, shapes: Shapes, p: int) -> list[AxisOption]:
    return [AxisOption(style, shard(d), (), ()) for d, style in ((0, "batch"), (1, "sequence"))
            if d < len(shapes.out) and divides(shapes.out[d], p)]


_BUILDERS = {"linear": linear_options, "matmul": matmul_options, "attention": attention_options, "conv": conv_options,
             "embedding": embedding_options,
             "norm": _norm, "softmax": _softmax, "elementwise": _elementwise, "reduce": _reduce, "view": _view,
             "permute": _permute, "loss": _loss, "input": _input}
