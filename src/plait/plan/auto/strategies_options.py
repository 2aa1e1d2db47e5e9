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
    reduce     S<d> of the input: a kept dim follows, a reduced dim gives P
    view       S<d> of the input carried through the reshape when d leads its group of
               dims (attrs dim_groups) and both leading sizes divide by p (same flat
               ranges); never through a sliced dim (attrs sliced_dims: split, slice, cat)
    permute    S<d> moves to the output position of d (attrs perm: out dim j = in dim perm[j])
    loss       batch: the inputs S0, the output P (a scalar) or S0 (reduction "none")
    input      batch S0, sequence S1
    constant, output: replicated only

Every kind has the all-replicated option ("replicated") first. An option never shards a
dim whose size does not divide by ``p``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.names.placements import PARTIAL, REPLICATE, shard

__all__ = ["AxisOption", "Shapes", "axis_options", "REPLICATED_STYLE"]

REPLICATED_STYLE = "replicated"


@dataclass(frozen=True)
class AxisOption:
    """One operator's choice along one mesh axis: ``style`` (its name), placements of the
    output, of each input and of each parameter, and the inputs (positions) and
    parameters (names) whose gradient is partial along the axis (all-reduced in backward
    when they have a gradient)."""

    style: str
    output: str
    inputs: tuple[str, ...]
    params: tuple[str, ...]
    partial_inputs: tuple[int, ...] = ()
    partial_params: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shapes:
    """Global shapes the options are built from: the node's output, its inputs (in
    order) and its parameters (name, shape) in order."""

    out: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    params: tuple[tuple[str, tuple[int, ...]], ...]


def axis_options(node, shapes: Shapes, p: int) -> list[AxisOption]:
    """The 1-D options of ``node`` on an axis of ``p`` ranks, the replicated one first."""
    replicated = AxisOption(REPLICATED_STYLE, REPLICATE, (REPLICATE,) * len(shapes.inputs),
                            (REPLICATE,) * len(shapes.params))
    if p == 1:
        return [replicated]
    builder = _BUILDERS.get(node.kind)
    found = builder(node, shapes, p) if builder is not None else []
    return [replicated] + found


def _divides(size: int, p: int) -> bool:
    return size % p == 0 and size >= p


def _norm_dim(dim: int, ndim: int, node, key: str) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise ValueError(f"node {node.name!r} ({node.kind}): attrs[{key!r}]={dim} is outside a {ndim}-d tensor")
    return dim % ndim if ndim else 0


def _broadcast(shape, out, out_dim: int) -> str | None:
    """The placement of an operand of ``shape`` broadcast to ``out`` when the output is
    sharded on ``out_dim``: S(its aligned dim) when it has the dim at full size, R when
    it lacks it or has size 1 there, None when the shapes do not broadcast."""
    aligned = out_dim - (len(out) - len(shape))
    if aligned < 0 or (shape[aligned] == 1 and out[out_dim] != 1):
        return REPLICATE
    return shard(aligned) if shape[aligned] == out[out_dim] else None


def _param_operand(node, name: str, shape):
    """(operand shape, operand_dims, sliced param dims) of parameter ``name`` as the op
    reads it (A's attrs['param_operands']: folded views of a parameter, e.g.
    ``position[:s].unsqueeze(1)``); the parameter itself when it is read whole."""
    for entry in node.attr("param_operands", ()) or ():
        if entry[0] == name:
            return tuple(entry[1]), tuple(entry[2]), tuple(entry[3])
    return tuple(shape), tuple(range(len(shape))), ()


def _param_broadcast(node, name: str, shape, out, out_dim: int) -> str | None:
    """A parameter's placement when the output is sharded on ``out_dim``: its operand's
    by broadcasting, mapped back to the parameter's own dim (None when that dim is cut
    by a slice or the shapes do not broadcast)."""
    operand, dims, sliced = _param_operand(node, name, shape)
    placement = _broadcast(operand, out, out_dim)
    if placement is None or placement == REPLICATE:
        return placement
    source = dims[int(placement[1:])]
    return None if source < 0 or source in sliced else shard(source)


def _follow(node, shapes: Shapes, p: int, out_dim: int, style: str, output: str | None = None):
    """Shard the output's ``out_dim``; every input and parameter by broadcasting; the
    replicated ones with a gradient get a partial gradient. None when an operand cannot
    follow (shapes that do not broadcast, a shard through a parameter's slice)."""
    inputs = tuple(_broadcast(shape, shapes.out, out_dim) for shape in shapes.inputs)
    params = tuple(_param_broadcast(node, name, shape, shapes.out, out_dim) for name, shape in shapes.params)
    if None in inputs or None in params:
        return None
    return AxisOption(style, output or shard(out_dim), inputs, params,
                      partial_inputs=tuple(i for i, placement in enumerate(inputs) if placement == REPLICATE),
                      partial_params=tuple(name for (name, _), placement in zip(shapes.params, params)
                                           if placement == REPLICATE))


def _batch_follow(node, shapes: Shapes, p: int, out_dim: int, style: str) -> AxisOption | None:
    """Shard batch dim ``out_dim`` of a batched product / attention: the operands' batch
    dims (all but their last two) broadcast to the output's (grouped-query attention: a
    key/value head dim of another size is sharded alike when it divides by ``p``, each
    rank's query heads reading its own key/value heads); parameters (none expected) R with
    a partial gradient."""
    out = shapes.out[:-2]
    inputs = []
    for shape in shapes.inputs:
        placement = _broadcast(shape[:-2], out, out_dim)
        aligned = out_dim - (len(out) - len(shape[:-2]))
        if placement is None and node.kind == "attention" and node.attr("enable_gqa", False) \
                and _divides(shape[aligned], p):
            placement = shard(aligned)
        if placement is None:
            return None
        inputs.append(placement)
    return AxisOption(style, shard(out_dim), tuple(inputs), _param_placements(shapes, {}),
                      tuple(i for i, placement in enumerate(inputs) if placement == REPLICATE),
                      tuple(name for name, _ in shapes.params))


def _kept(options) -> list[AxisOption]:
    return [option for option in options if option is not None]


def _elementwise(node, shapes: Shapes, p: int) -> list[AxisOption]:
    return _kept(_follow(node, shapes, p, d, f"S{d}") for d, size in enumerate(shapes.out) if _divides(size, p))


def _weight_bias(node, shapes: Shapes):
    """(weight name, bias name or None) of a linear/conv: A's attrs ``weight``/``bias``,
    else the first parameter of >= 2 dims and a 1-d one."""
    weight = node.attr("weight") or next((name for name, shape in shapes.params if len(shape) >= 2), None)
    bias = node.attr("bias") if node.attr("weight") else next(
        (name for name, shape in shapes.params if len(shape) == 1), None)
    return weight, bias


def _param_placements(shapes: Shapes, placed: dict) -> tuple[str, ...]:
    return tuple(placed.get(name, REPLICATE) for name, _ in shapes.params)


def _linear(node, shapes: Shapes, p: int) -> list[AxisOption]:
    x = shapes.inputs[0]
    weight, bias = _weight_bias(node, shapes)
    if weight is None or len(shapes.inputs) != 1 or len(x) < 1:
        raise ValueError(f"node {node.name!r} (linear) needs one input x (..., in) and a 2-d weight parameter; it has "
                         f"inputs {list(shapes.inputs)} and params {list(shapes.params)}")
    out_dim = int(node.attr("weight_out_dim", 0))  # 1: W stored (in, out), HF's Conv1D
    out_features, in_features = dict(shapes.params)[weight][out_dim], dict(shapes.params)[weight][1 - out_dim]
    every = tuple(name for name, _ in shapes.params)
    found = []
    if len(x) >= 2 and _divides(x[0], p):
        found.append(AxisOption("batch", shard(0), (shard(0),), _param_placements(shapes, {}), (), every))
    if len(x) >= 3 and _divides(x[1], p):
        found.append(AxisOption("sequence", shard(1), (shard(1),), _param_placements(shapes, {}), (), every))
    if _divides(out_features, p):
        placed = {weight: shard(out_dim), **({bias: shard(0)} if bias else {})}
        found.append(AxisOption("column", shard(len(shapes.out) - 1), (REPLICATE,), _param_placements(shapes, placed),
                                (0,), ()))
    if _divides(in_features, p):
        found.append(AxisOption("row", PARTIAL, (shard(len(x) - 1),), _param_placements(shapes, {weight: shard(1 - out_dim)})))
    return found


def _matmul(node, shapes: Shapes, p: int) -> list[AxisOption]:
    if len(shapes.inputs) != 2 or min(len(shapes.inputs[0]), len(shapes.inputs[1])) < 2:
        return []  # a vector operand (matrix-vector products): replicated only
    a, b = shapes.inputs
    out = shapes.out
    if a[-1] != b[-2]:
        raise ValueError(f"node {node.name!r} (matmul): a {a} @ b {b} do not contract (a's last dim must be b's "
                         "second last)")
    found = []
    for j in range(len(out) - 2):
        if _divides(out[j], p):
            found += _kept([_batch_follow(node, shapes, p, j, f"batch{j}")])
    if _divides(a[-2], p):
        found.append(AxisOption("m", shard(len(out) - 2), (shard(len(a) - 2), REPLICATE),
                                _param_placements(shapes, {}), (1,)))
    if _divides(b[-1], p):
        found.append(AxisOption("n", shard(len(out) - 1), (REPLICATE, shard(len(b) - 1)),
                                _param_placements(shapes, {}), (0,)))
    if _divides(a[-1], p):
        found.append(AxisOption("k", PARTIAL, (shard(len(a) - 1), shard(len(b) - 2)), _param_placements(shapes, {})))
    return found


def _attention(node, shapes: Shapes, p: int) -> list[AxisOption]:
    out = shapes.out
    names = {0: "batch", 1: "heads"} if len(out) == 4 else {0: "batch"}
    return _kept(_batch_follow(node, shapes, p, d, style) for d, style in names.items()
                 if d < len(out) - 2 and _divides(out[d], p))


def _conv(node, shapes: Shapes, p: int) -> list[AxisOption]:
    x = shapes.inputs[0]
    weight, bias = _weight_bias(node, shapes)
    if weight is None or len(x) < 3:
        raise ValueError(f"node {node.name!r} (conv) needs an input (N, C, ...) and a weight parameter (Cout, Cin/g, "
                         f"...); it has inputs {list(shapes.inputs)} and params {list(shapes.params)}")
    w_shape = dict(shapes.params)[weight]
    # W is (Cout, Cin/g, ...), or (Cin, Cout/g, ...) for a transposed convolution
    w_out, w_in = (1, 0) if node.attr("transposed", False) else (0, 1)
    every = tuple(name for name, _ in shapes.params)
    rest = tuple(REPLICATE for _ in shapes.inputs[1:])
    found = []
    if _divides(x[0], p):
        found.append(AxisOption("batch", shard(0), (shard(0),) + rest, _param_placements(shapes, {}), (), every))
    if node.attr("groups", 1) == 1:
        if _divides(w_shape[w_out], p):
            placed = {weight: shard(w_out), **({bias: shard(0)} if bias else {})}
            found.append(AxisOption("out", shard(1), (REPLICATE,) + rest, _param_placements(shapes, placed), (0,)))
        if _divides(w_shape[w_in], p):
            found.append(AxisOption("in", PARTIAL, (shard(1),) + rest,
                                    _param_placements(shapes, {weight: shard(w_in)})))
    return found


def _embedding(node, shapes: Shapes, p: int) -> list[AxisOption]:
    ids = shapes.inputs[0]
    if len(shapes.params) != 1 or len(shapes.params[0][1]) != 2:
        raise ValueError(f"node {node.name!r} (embedding) needs one 2-d table parameter; it has {list(shapes.params)}")
    table, (vocab, width) = shapes.params[0]
    found = []
    for d, style in ((0, "batch"), (1, "sequence")):
        if d < len(ids) and _divides(ids[d], p):
            found.append(AxisOption(style, shard(d), (shard(d),), (REPLICATE,), (), (table,)))
    if _divides(width, p):
        found.append(AxisOption("column", shard(len(shapes.out) - 1), (REPLICATE,), (shard(1),)))
    if _divides(vocab, p):
        found.append(AxisOption("vocab", PARTIAL, (REPLICATE,), (shard(0),)))
    return found


def _norm(node, shapes: Shapes, p: int) -> list[AxisOption]:
    kept = len(shapes.out) - int(node.attr("normalized_ndim", 1))
    return _kept(_follow(node, shapes, p, d, f"S{d}") for d in range(kept) if _divides(shapes.out[d], p))


def _softmax(node, shapes: Shapes, p: int) -> list[AxisOption]:
    dim = _norm_dim(int(node.attr("dim", -1)), len(shapes.out), node, "dim")
    return _kept(_follow(node, shapes, p, d, f"S{d}") for d, size in enumerate(shapes.out)
                 if d != dim and _divides(size, p))


def _reduce(node, shapes: Shapes, p: int) -> list[AxisOption]:
    x = shapes.inputs[0]
    dims = node.attr("dims")
    reduced = set(range(len(x))) if not dims else {_norm_dim(int(d), len(x), node, "dims") for d in dims}
    keepdim = bool(node.attr("keepdim", False))
    rest = tuple(REPLICATE for _ in shapes.inputs[1:])
    found = []
    for d, size in enumerate(x):
        if not _divides(size, p):
            continue
        if d in reduced:
            output = PARTIAL
        else:
            output = shard(d if keepdim else d - sum(1 for r in reduced if r < d))
        found.append(AxisOption(f"S{d}", output, (shard(d),) + rest, _param_placements(shapes, {})))
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
        if i in sliced or not _divides(src[i], p) or not _divides(dst[j], p):
            continue
        if any(len(shape) <= i or shape[i] != src[i] for shape in shapes.inputs[1:]):
            continue
        found.append(AxisOption(f"S{i}", shard(j), (shard(i),) * len(shapes.inputs), _param_placements(shapes, {})))
    return sorted(found, key=lambda option: int(option.style[1:]))


def _permute(node, shapes: Shapes, p: int) -> list[AxisOption]:
    """attrs ``perm``: output dim j is input dim perm[j] (``dims`` accepted too)."""
    src = shapes.inputs[0]
    perm = node.attr("perm", node.attr("dims"))
    if perm is None or sorted(_norm_dim(int(d), len(src), node, "perm") for d in perm) != list(range(len(src))):
        raise ValueError(f"node {node.name!r} (permute) needs attrs['perm'], a permutation of its input's "
                         f"{len(src)} dims; it has {perm!r}")
    order = [_norm_dim(int(d), len(src), node, "perm") for d in perm]
    return [AxisOption(f"S{d}", shard(order.index(d)), (shard(d),), _param_placements(shapes, {}))
            for d, size in enumerate(src) if _divides(size, p)]


def _loss(node, shapes: Shapes, p: int) -> list[AxisOption]:
    """Batch: every input with the first's dim 0 is S0 (the rest R); the output P (a
    reduced loss: the ranks' summands) or S0 (reduction "none"). Not for a classification
    loss over one unbatched sample (attrs class_dim 0: dim 0 is the classes)."""
    first = shapes.inputs[0]
    if not first or not _divides(first[0], p) or (node.attr("op") in ("cross_entropy", "nll")
                                                    and int(node.attr("class_dim", 1)) == 0):
        return []
    inputs = tuple(shard(0) if shape and shape[0] == first[0] else REPLICATE for shape in shapes.inputs)
    output = shard(0) if shapes.out and shapes.out[0] == first[0] else PARTIAL
    return [AxisOption("batch", output, inputs, _param_placements(shapes, {}),
                       tuple(i for i, placement in enumerate(inputs) if placement == REPLICATE),
                       tuple(name for name, _ in shapes.params))]


def _input(node, shapes: Shapes, p: int) -> list[AxisOption]:
    return [AxisOption(style, shard(d), (), ()) for d, style in ((0, "batch"), (1, "sequence"))
            if d < len(shapes.out) and _divides(shapes.out[d], p)]


_BUILDERS = {"linear": _linear, "matmul": _matmul, "attention": _attention, "conv": _conv, "embedding": _embedding,
             "norm": _norm, "softmax": _softmax, "elementwise": _elementwise, "reduce": _reduce, "view": _view,
             "permute": _permute, "loss": _loss, "input": _input}
