"""Which layouts each operator kind runs exactly on local shards, and what layout its
output then has: the executor's check (``plait.parallel.auto.execute``) before any
tensor moves. A (kind, layouts) pair not listed here is refused by name, naming the
node, the axis, the placements and the fix; never run approximately.

Per mesh axis (placements of the inputs, the parameters and the output on it):

    every kind       all R -> R (each rank runs the whole operator)
    linear           x S<i> (i not last), W R -> S<i>;  x R, W S<out> -> S<last>;
                     x S<last>, W S<in> -> P;  x P, W R -> P (bias added once)
    matmul           a (..,m,k) @ b (..,k,n): m, n, batch dims as linear; k on both -> P;
                     one P operand with the other R -> P
    embedding        ids S<i>, table R -> S<i>;  table S<1> (columns) -> S<last>;
                     table S<0> (vocabulary), ids R -> P (ids outside this rank's rows
                     read zeros)
    attention        q, k, v (b, h, s, d) all S0 or all S1 -> the same
    conv             x S0, W R -> S0;  W S0 -> S1;  x S1, W S1 (groups 1) -> P;  x P -> P
    norm, softmax    the input's S<d> kept when d is not normalised over; no P
    reduce           a reduced sharded dim -> P (sum, mean: scaled local/global);
                     other shards kept (shifted when the dim goes away)
    loss             input and target sharded alike on a batch dim (mean, sum) -> P
    elementwise      broadcasting shards kept; P only through linear ops (add/sub of
                     P and R summands, mul/div with one P factor, unary copies)
    view, permute    checked by moving an index tensor (execute_views)
"""

from __future__ import annotations

from plait.names.placements import PARTIAL, REPLICATE, is_shard, shard, shard_dim

__all__ = ["ADDITIVE", "MULTIPLICATIVE", "LINEAR_UNARY", "LayoutRefused", "expected_output", "param_operands"]

ADDITIVE = ("add", "sub")
MULTIPLICATIVE = ("mul", "div")
LINEAR_UNARY = ("neg", "clone", "contiguous", "alias", "detach", "to", "_to_copy", "lift_fresh_copy", "dropout")


class LayoutRefused(ValueError):
    """A node's layouts the executor cannot run exactly."""


def _refuse(node, axis: int, text: str) -> None:
    raise LayoutRefused(f"node {node.name!r} ({node.kind}, {node.target}) on mesh axis {axis}: {text}")


def _ndims(shapes) -> list[int]:
    return [len(shape) for shape in shapes]


def expected_output(node, axis: int, inputs: list[str], input_shapes, params: dict[str, str], param_shapes) -> str:
    """The placement ``node``'s output has on ``axis`` when its inputs and parameters
    arrive as ``inputs`` / ``params`` there; LayoutRefused when it cannot run exactly."""
    placements = list(inputs) + list(params.values())
    if all(p == REPLICATE for p in placements):
        return REPLICATE
    if node.kind in ("matmul", "elementwise"):  # parameters as the operands they are read as
        operands = param_operands(node, axis, params, dict(zip(params, param_shapes)))
        if node.kind == "matmul" and node.attr("param_side") is not None:
            (placement, shape), = operands.values()
            index = node.attr("param_side")
            inputs, input_shapes = list(inputs), list(input_shapes)
            inputs.insert(index, placement)
            input_shapes.insert(index, shape)
            return _matmul(node, axis, inputs, input_shapes, {}, [])
        params = {name: placement for name, (placement, _) in operands.items()}
        param_shapes = [shape for _, shape in operands.values()]
    rule = _RULES.get(node.kind)
    if rule is None:
        _refuse(node, axis, f"a {node.kind} node runs replicated only (got inputs {inputs}, params {params})")
    return rule(node, axis, inputs, input_shapes, params, param_shapes)


def param_operands(node, axis, params: dict, shapes: dict) -> dict:
    """{param: (placement, shape)} of each parameter as the operand the op reads (through
    folded views: attrs param_operands' operand shape and dims; a shard of parameter dim
    i is a shard of the operand dim that comes from i)."""
    views = {entry[0]: entry[1:] for entry in node.attr("param_operands", ())}
    out = {}
    for name, placement in params.items():
        if name not in views:
            out[name] = (placement, tuple(shapes[name]))
            continue
        operand_shape, operand_dims, sliced = views[name][0], views[name][1], views[name][2]
        if is_shard(placement):
            if shard_dim(placement) in sliced or shard_dim(placement) not in operand_dims:
                _refuse(node, axis, f"parameter {name} is sharded on its dim {shard_dim(placement)}, which the op "
                                    "slices or drops: replicate it")
            placement = shard(list(operand_dims).index(shard_dim(placement)))
        out[name] = (placement, tuple(operand_shape))
    return out


def _linear(node, axis, inputs, shapes, params, param_shapes):
    x = inputs[0]
    weight = params.get(node.attr("weight"), REPLICATE)
    bias = params.get(node.attr("bias"), REPLICATE) if node.attr("bias") else REPLICATE
    out_dim = node.attr("weight_out_dim", 0)
    last = len(shapes[0]) - 1
    w_out, w_in = shard(out_dim), shard(1 - out_dim)
    column_bias = bias == shard(0) or not node.attr("bias")
    if x == REPLICATE and weight == w_out and column_bias:
        return shard(last)
    if is_shard(x) and shard_dim(x) < last and weight == REPLICATE and bias == REPLICATE:
        return x
    if x == shard(last) and weight == w_in and bias == REPLICATE:
        return PARTIAL
    if x == PARTIAL and weight == REPLICATE and bias == REPLICATE:
        return PARTIAL
    _refuse(node, axis, f"linear with x {x}, weight {weight} (out dim {out_dim}), bias {bias} is none of batch, "
                        "column (x R, W S<out>, bias S0), row (x S<last>, W S<in>, bias R) or partial input")


def _matmul(node, axis, inputs, shapes, params, param_shapes):
    a, b = inputs[:2]
    a_nd, b_nd = _ndims(shapes[:2])
    out_nd = len(node.shape)
    if PARTIAL in (a, b):
        if {a, b} == {PARTIAL, REPLICATE}:
            return PARTIAL
        _refuse(node, axis, f"matmul of {a} and {b}: only one partial factor with a replicated other is linear")
    da, db = shard_dim(a), shard_dim(b)
    if da == a_nd - 1 and db == b_nd - 2:
        return PARTIAL  # k on both
    if da == a_nd - 2 and b == REPLICATE:
        return shard(out_nd - 2)  # m
    if a == REPLICATE and db == b_nd - 1:
        return shard(out_nd - 1)  # n
    # batch dims, right-aligned against the output's
    if da is not None and da < a_nd - 2:
        out = da + out_nd - a_nd
        b_aligned = out - (out_nd - b_nd)
        b_size = shapes[1][b_aligned] if 0 <= b_aligned < b_nd - 2 else 1
        if db == b_aligned or (b == REPLICATE and b_size == 1):
            return shard(out)
    if db is not None and db < b_nd - 2 and a == REPLICATE:
        out = db + out_nd - b_nd
        a_aligned = out - (out_nd - a_nd)
        if not 0 <= a_aligned < a_nd - 2 or shapes[0][a_aligned] == 1:
            return shard(out)
    _refuse(node, axis, f"matmul of a {a} ({a_nd}-d) and b {b} ({b_nd}-d) is none of batch, m, n or k sharding")


def _embedding(node, axis, inputs, shapes, params, param_shapes):
    ids = inputs[0]
    table = params.get(node.attr("weight"), REPLICATE)
    if table == REPLICATE and is_shard(ids):
        return ids
    if ids == REPLICATE and table == shard(1):
        return shard(len(node.shape) - 1)
    if ids == REPLICATE and table == shard(0):
        return PARTIAL
    _refuse(node, axis, f"embedding with ids {ids} and table {table}: shard the ids (table R), the table's columns "
                        "(S1) or its vocabulary (S0) with replicated ids")


def _attention(node, axis, inputs, shapes, params, param_shapes):
    q, k, v = inputs[:3]
    if q == k == v and q in ("S0", "S1"):
        if len(inputs) > 3 and inputs[3] not in (REPLICATE, q):
            _refuse(node, axis, f"attention mask {inputs[3]} with q/k/v {q}: lay the mask out as {q} or R")
        if len(inputs) > 3 and inputs[3] == REPLICATE and shapes[3][shard_dim(q)] != 1:
            _refuse(node, axis, f"attention mask R of size {shapes[3][shard_dim(q)]} on the dim q/k/v shard: lay it "
                                f"out as {q}")
        return q
    _refuse(node, axis, f"attention with q {q}, k {k}, v {v}: shard all three alike by batch (S0) or heads (S1)")


def _conv(node, axis, inputs, shapes, params, param_shapes):
    x = inputs[0]
    weight = params.get(node.attr("weight"), REPLICATE)
    bias = params.get(node.attr("bias"), REPLICATE) if node.attr("bias") else REPLICATE
    if x == "S0" and weight == REPLICATE and bias == REPLICATE:
        return "S0"
    if x == REPLICATE and weight == "S0" and (bias == "S0" or not node.attr("bias")):
        return "S1"
    if x == "S1" and weight == "S1" and bias == REPLICATE and node.attr("groups", 1) == 1:
        return PARTIAL
    if x == PARTIAL and weight == REPLICATE and bias == REPLICATE:
        return PARTIAL
    _refuse(node, axis, f"conv with x {x}, weight {weight}, bias {bias} is none of batch (x S0), out channels "
                        "(W S0, bias S0) or in channels (x S1, W S1, groups 1)")


def _kept_dims(node, axis, inputs, shapes, banned: set[int], what: str):
    x = inputs[0]
    if x == PARTIAL:
        _refuse(node, axis, f"{what} is not linear: reshard its partial-sum input to R or S first")
    if shard_dim(x) in banned:
        _refuse(node, axis, f"{what} over dim {shard_dim(x)}, which {x} shards: shard another dim")
    return x


def _norm(node, axis, inputs, shapes, params, param_shapes):
    if any(p != REPLICATE for p in params.values()):
        _refuse(node, axis, f"norm parameters {params} must be replicated")
    ndim = len(shapes[0])
    banned = set(range(ndim - node.attr("normalized_ndim", 1), ndim))
    if node.attr("op") == "group_norm":
        banned = set(range(1, ndim))
    return _kept_dims(node, axis, inputs, shapes, banned, "normalising")


def _softmax(node, axis, inputs, shapes, params, param_shapes):
    return _kept_dims(node, axis, inputs, shapes, {node.attr("dim")}, "softmax")


def _reduce(node, axis, inputs, shapes, params, param_shapes):
    x = inputs[0]
    ndim = len(shapes[0])
    dims = node.attr("dims") or tuple(range(ndim))
    if x == PARTIAL:
        if node.attr("op") in ("sum", "mean"):
            return PARTIAL
        _refuse(node, axis, f"reduce {node.attr('op')} of a partial sum is not linear")
    d = shard_dim(x)
    if d in dims:
        if node.attr("op") not in ("sum", "mean"):
            _refuse(node, axis, f"reduce {node.attr('op')} over sharded dim {d}: only sum and mean give a partial sum")
        return PARTIAL
    if node.attr("keepdim"):
        return x
    return shard(d - sum(1 for dim in dims if dim < d))


def _loss(node, axis, inputs, shapes, params, param_shapes):
    x, target = inputs[:2]
    class_dim = node.attr("class_dim", 1)
    if node.attr("op") in ("cross_entropy", "nll"):
        ok = is_shard(x) and shard_dim(x) != class_dim and len(shapes[0]) > 1 and target == shard(
            shard_dim(x) - (1 if shard_dim(x) > class_dim else 0))
    else:
        ok = is_shard(x) and x == target
    if not ok:
        _refuse(node, axis, f"loss {node.attr('op')} with input {x} and target {target}: shard both alike on a batch "
                            "dim (not the class dim), or replicate both")
    if node.attr("reduction") == "none":
        return x if node.attr("op") == "mse" else target
    return PARTIAL


def _elementwise(node, axis, inputs, shapes, params, param_shapes):
    op = node.attr("op", "")
    operands = list(inputs) + list(params.values())
    operand_shapes = list(shapes) + list(param_shapes)
    out_nd = len(node.shape)
    partial = [p == PARTIAL for p in operands]
    shards = {p for p in operands if is_shard(p)}
    out_shards = set()
    for placement, shape in zip(operands, operand_shapes):
        if is_shard(placement):
            out_shards.add(shard_dim(placement) + out_nd - len(shape))
    if len(out_shards) > 1:
        _refuse(node, axis, f"elementwise {op} of operands sharded differently ({sorted(shards)}): reshard them alike")
    if out_shards and any(partial):
        _refuse(node, axis, f"elementwise {op} mixes shards and partial sums")
    if out_shards:
        out = out_shards.pop()
        for placement, shape in zip(operands, operand_shapes):
            aligned = out - (out_nd - len(shape))
            if placement == REPLICATE and 0 <= aligned and shape[aligned] != 1:
                _refuse(node, axis, f"elementwise {op}: a replicated operand of shape {tuple(shape)} is not broadcast "
                                    f"along output dim {out}, which is sharded: lay it out as S{aligned}")
        return shard(out)
    count = sum(partial)
    linear = (op in ADDITIVE) or (op in MULTIPLICATIVE and count == 1 and (op != "div" or partial[0])) or (
        op in LINEAR_UNARY and len(operands) == 1)
    if not linear:
        _refuse(node, axis, f"elementwise {op} is not linear in its partial-sum operands: reshard them to R first")
    return PARTIAL


_RULES = {"linear": _linear, "matmul": _matmul, "embedding": _embedding, "attention": _attention, "conv": _conv,
          "norm": _norm, "softmax": _softmax, "reduce": _reduce, "loss": _loss, "elementwise": _elementwise}
