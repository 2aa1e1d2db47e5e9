"""The vocabulary of one operator's choice along one mesh axis (``AxisOption``) and
the helpers the per-kind builders share: divisibility, broadcasting an output shard to
the operands (parameters read through folded views mapped back to their own dims),
batch-dim following for products. See ``strategies_options`` for the kinds."""

from __future__ import annotations

from dataclasses import dataclass

from plait.names.placements import REPLICATE, shard

__all__ = ["AxisOption", "Shapes", "REPLICATED_STYLE", "divides", "norm_dim", "broadcast", "param_operand",
           "param_broadcast", "operand_to_param", "local_operand", "follow", "batch_follow", "kept", "weight_bias", "param_placements"]

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
    order) and its parameters (name, shape) in order; ``fused_dim`` the dim of a slice
    that is one of the equal parts of a linear's output (``strategies.fused_part_dim``),
    else None."""

    out: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    params: tuple[tuple[str, tuple[int, ...]], ...]
    fused_dim: int | None = None


def divides(size: int, p: int) -> bool:
    return size % p == 0 and size >= p


def norm_dim(dim: int, ndim: int, node, key: str) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise ValueError(f"node {node.name!r} ({node.kind}): attrs[{key!r}]={dim} is outside a {ndim}-d tensor")
    return dim % ndim if ndim else 0


def broadcast(shape, out, out_dim: int) -> str | None:
    """The placement of an operand of ``shape`` broadcast to ``out`` when the output is
    sharded on ``out_dim``: S(its aligned dim) when it has the dim at full size, R when
    it lacks it or has size 1 there, None when the shapes do not broadcast."""
    aligned = out_dim - (len(out) - len(shape))
    if aligned < 0 or (shape[aligned] == 1 and out[out_dim] != 1):
        return REPLICATE
    return shard(aligned) if shape[aligned] == out[out_dim] else None


def param_operand(node, name: str, shape):
    """(operand shape, operand_dims, sliced param dims) of parameter ``name`` as the op
    reads it (A's attrs['param_operands']: folded views of a parameter, e.g.
    ``position[:s].unsqueeze(1)``); the parameter itself when it is read whole."""
    for entry in node.attr("param_operands", ()) or ():
        if entry[0] == name:
            return tuple(entry[1]), tuple(entry[2]), tuple(entry[3])
    return tuple(shape), tuple(range(len(shape))), ()


def operand_to_param(placement: str | None, dims, sliced) -> str | None:
    """An operand's placement as its parameter's: S(j) -> S(dims[j]); None when operand
    dim j is inserted (dims[j] < 0) or comes from a sliced parameter dim."""
    if placement is None or placement == REPLICATE:
        return placement
    source = dims[int(placement[1:])]
    return None if source < 0 or source in sliced else shard(source)


def local_operand(node, name: str, global_shape, local_shape) -> tuple[int, ...]:
    """The local shape of parameter ``name``'s operand (its folded views applied) when the
    parameter is held as ``local_shape``."""
    operand, dims, _ = param_operand(node, name, global_shape)
    return tuple(size // (global_shape[d] // local_shape[d]) if d >= 0 else size for size, d in zip(operand, dims))


def param_broadcast(node, name: str, shape, out, out_dim: int) -> str | None:
    """A parameter's placement when the output is sharded on ``out_dim``: its operand's
    by broadcasting, mapped back to the parameter's own dim (None when that dim is cut
    by a slice or the shapes do not broadcast)."""
    operand, dims, sliced = param_operand(node, name, shape)
    return operand_to_param(broadcast(operand, out, out_dim), dims, sliced)


def follow(node, shapes: Shapes, p: int, out_dim: int, style: str, output: str | None = None):
    """Shard the output's ``out_dim``; every input and parameter by broadcasting; the
    replicated ones with a gradient get a partial gradient. None when an operand cannot
    follow (shapes that do not broadcast, a shard through a parameter's slice)."""
    inputs = tuple(broadcast(shape, shapes.out, out_dim) for shape in shapes.inputs)
    params = tuple(param_broadcast(node, name, shape, shapes.out, out_dim) for name, shape in shapes.params)
    if None in inputs or None in params:
        return None
    return AxisOption(style, output or shard(out_dim), inputs, params,
                      partial_inputs=tuple(i for i, placement in enumerate(inputs) if placement == REPLICATE),
                      partial_params=tuple(name for (name, _), placement in zip(shapes.params, params)
                                           if placement == REPLICATE))


def batch_follow(node, shapes: Shapes, p: int, out_dim: int, style: str) -> AxisOption | None:
    """Shard batch dim ``out_dim`` of a batched product / attention: the operands' batch
    dims (all but their last two) broadcast to the output's (grouped-query attention: a
    key/value head dim of another size is sharded alike when it divides by ``p``, each
    rank's query heads reading its own key/value heads); parameters (none expected) R with
    a partial gradient."""
    out = shapes.out[:-2]
    inputs = []
    for shape in shapes.inputs:
        placement = broadcast(shape[:-2], out, out_dim)
        aligned = out_dim - (len(out) - len(shape[:-2]))
        if placement is None and node.kind == "attention" and node.attr("enable_gqa", False) \
                and divides(shape[aligned], p):
            placement = shard(aligned)
        if placement is None:
            return None
        inputs.append(placement)
    return AxisOption(style, shard(out_dim), tuple(inputs), param_placements(shapes, {}),
                      tuple(i for i, placement in enumerate(inputs) if placement == REPLICATE),
                      tuple(name for name, _ in shapes.params))


def kept(options) -> list[AxisOption]:
    return [option for option in options if option is not None]



def weight_bias(node, shapes: Shapes):
    """(weight name, bias name or None) of a linear/conv: A's attrs ``weight``/``bias``,
    else the first parameter of >= 2 dims and a 1-d one."""
    weight = node.attr("weight") or next((name for name, shape in shapes.params if len(shape) >= 2), None)
    bias = node.attr("bias") if node.attr("weight") else next(
        (name for name, shape in shapes.params if len(shape) == 1), None)
    return weight, bias


def param_placements(shapes: Shapes, placed: dict) -> tuple[str, ...]:
    return tuple(placed.get(name, REPLICATE) for name, _ in shapes.params)
