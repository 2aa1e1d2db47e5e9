"""The 1-D options of the operators that multiply (linear, matmul, attention, conv,
embedding): see ``strategies_options``' table."""

from __future__ import annotations

from plait.names.placements import PARTIAL, REPLICATE, shard
from plait.plan.auto.strategies_axis import (AxisOption, Shapes, batch_follow, broadcast, divides, kept,
                                             operand_to_param, param_operand, param_placements, weight_bias)

__all__ = ["linear_options", "matmul_options", "attention_options", "conv_options", "embedding_options"]


def linear_options(node, shapes: Shapes, p: int) -> list[AxisOption]:
    x = shapes.inputs[0]
    weight, bias = weight_bias(node, shapes)
    if weight is None or len(shapes.inputs) != 1 or len(x) < 1:
        raise ValueError(f"node {node.name!r} (linear) needs one input x (..., in) and a 2-d weight parameter; it has "
                         f"inputs {list(shapes.inputs)} and params {list(shapes.params)}")
    out_dim = int(node.attr("weight_out_dim", 0))  # 1: W stored (in, out), HF's Conv1D
    out_features, in_features = dict(shapes.params)[weight][out_dim], dict(shapes.params)[weight][1 - out_dim]
    every = tuple(name for name, _ in shapes.params)
    found = []
    if len(x) >= 2 and divides(x[0], p):
        found.append(AxisOption("batch", shard(0), (shard(0),), param_placements(shapes, {}), (), every))
    if len(x) >= 3 and divides(x[1], p):
        found.append(AxisOption("sequence", shard(1), (shard(1),), param_placements(shapes, {}), (), every))
    if divides(out_features, p):
        placed = {weight: shard(out_dim), **({bias: shard(0)} if bias else {})}
        found.append(AxisOption("column", shard(len(shapes.out) - 1), (REPLICATE,), param_placements(shapes, placed),
                                (0,), ()))
    if divides(in_features, p):
        found.append(AxisOption("row", PARTIAL, (shard(len(x) - 1),), param_placements(shapes, {weight: shard(1 - out_dim)})))
    return found


def matmul_options(node, shapes: Shapes, p: int) -> list[AxisOption]:
    """a (..., m, k) @ b (..., k, n): batch<j>, m, n, k. One operand may be a parameter
    (A's attrs param_side 0: a, 1: b; read through param_operands): its placement maps
    back to the parameter's own dim, and it takes a partial gradient where it is R."""
    side = node.attr("param_side")
    if side is not None:
        name, shape = shapes.params[0]
        operand, dims, sliced = param_operand(node, name, shape)
        a, b = (operand, shapes.inputs[0]) if side == 0 else (shapes.inputs[0], operand)
    elif len(shapes.inputs) == 2:
        a, b = shapes.inputs
    else:
        return []
    if min(len(a), len(b)) < 2:
        return []  # a vector operand (matrix-vector products): replicated only
    out = shapes.out
    if a[-1] != b[-2]:
        raise ValueError(f"node {node.name!r} (matmul): a {a} @ b {b} do not contract (a's last dim must be b's "
                         "second last)")
    pairs = []  # (style, output, a's placement, b's placement)
    for j in range(len(out) - 2):
        if divides(out[j], p):
            pairs.append((f"batch{j}", shard(j), broadcast(a[:-2], out[:-2], j), broadcast(b[:-2], out[:-2], j)))
    if divides(a[-2], p):
        pairs.append(("m", shard(len(out) - 2), shard(len(a) - 2), REPLICATE))
    if divides(b[-1], p):
        pairs.append(("n", shard(len(out) - 1), REPLICATE, shard(len(b) - 1)))
    if divides(a[-1], p):
        pairs.append(("k", PARTIAL, shard(len(a) - 1), shard(len(b) - 2)))
    found = []
    for style, output, on_a, on_b in pairs:
        if on_a is None or on_b is None:
            continue
        if side is None:
            found.append(AxisOption(style, output, (on_a, on_b), param_placements(shapes, {}),
                                    tuple(i for i, pl in enumerate((on_a, on_b)) if pl == REPLICATE),
                                    tuple(n for n, _ in shapes.params)))
            continue
        on_param, on_input = (on_a, on_b) if side == 0 else (on_b, on_a)
        on_param = operand_to_param(on_param, dims, sliced)
        if on_param is None:
            continue
        found.append(AxisOption(style, output, (on_input,), param_placements(shapes, {name: on_param}),
                                (0,) if on_input == REPLICATE else (),
                                tuple(n for n, _ in shapes.params if n != name or on_param == REPLICATE)))
    return found


def attention_options(node, shapes: Shapes, p: int) -> list[AxisOption]:
    out = shapes.out
    names = {0: "batch", 1: "heads"} if len(out) == 4 else {0: "batch"}
    return kept(batch_follow(node, shapes, p, d, style) for d, style in names.items()
                if d < len(out) - 2 and divides(out[d], p))


def conv_options(node, shapes: Shapes, p: int) -> list[AxisOption]:
    x = shapes.inputs[0]
    weight, bias = weight_bias(node, shapes)
    if weight is None or len(x) < 3:
        raise ValueError(f"node {node.name!r} (conv) needs an input (N, C, ...) and a weight parameter (Cout, Cin/g, "
                         f"...); it has inputs {list(shapes.inputs)} and params {list(shapes.params)}")
    w_shape = dict(shapes.params)[weight]
    # W is (Cout, Cin/g, ...), or (Cin, Cout/g, ...) for a transposed convolution
    w_out, w_in = (1, 0) if node.attr("transposed", False) else (0, 1)
    every = tuple(name for name, _ in shapes.params)
    rest = tuple(REPLICATE for _ in shapes.inputs[1:])
    found = []
    if divides(x[0], p):
        found.append(AxisOption("batch", shard(0), (shard(0),) + rest, param_placements(shapes, {}), (), every))
    if node.attr("groups", 1) == 1:
        if divides(w_shape[w_out], p):
            placed = {weight: shard(w_out), **({bias: shard(0)} if bias else {})}
            found.append(AxisOption("out", shard(1), (REPLICATE,) + rest, param_placements(shapes, placed), (0,)))
        if divides(w_shape[w_in], p):
            found.append(AxisOption("in", PARTIAL, (shard(1),) + rest,
                                    param_placements(shapes, {weight: shard(w_in)})))
    return found


def embedding_options(node, shapes: Shapes, p: int) -> list[AxisOption]:
    ids = shapes.inputs[0]
    if len(shapes.params) != 1 or len(shapes.params[0][1]) != 2:
        raise ValueError(f"node {node.name!r} (embedding) needs one 2-d table parameter; it has {list(shapes.params)}")
    table, (vocab, width) = shapes.params[0]
    found = []
    for d, style in ((0, "batch"), (1, "sequence")):
        if d < len(ids) and divides(ids[d], p):
            found.append(AxisOption(style, shard(d), (shard(d),), (REPLICATE,), (), (table,)))
    if divides(width, p):
        found.append(AxisOption("column", shard(len(shapes.out) - 1), (REPLICATE,), (shard(1),)))
    if divides(vocab, p):
        found.append(AxisOption("vocab", PARTIAL, (REPLICATE,), (shard(0),)))
    return found
