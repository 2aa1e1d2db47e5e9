"""How view-like aten ops map a tensor's dims to their output's dims: what the strategies
need to carry a shard through a reshape, and the tracer to see a parameter through the
views that feed it into an operator.

``dim_groups(in_shape, out_shape)`` splits both shapes into consecutive groups of equal
element count: ``((in dims), (out dims))`` pairs, in order. A dim of size 1 is a group of
its own with nothing on the other side (``((i,), ())`` when removed, ``((), (o,))`` when
added). A group of one dim on each side is 1-to-1; several in dims to one out dim is a
merge (flatten); one in dim to several out dims is a split (unflatten). A shard of the
group's first (outermost) in dim lands on its first out dim as contiguous equal blocks
when the sizes divide, which is why strategies carry ``S<first in>`` to
``S<first out>`` and nothing else.

``fold_dims`` follows one parameter through the layout-transparent ops the tracer folds
into the operator that reads it (t, transpose, permute, (un)squeeze, slice, select,
expand, identity copies, and views that only add or drop size-1 dims): for each dim of
the operand the operator sees, the parameter dim it comes from (-1 for an inserted or
broadcast dim), and the parameter dims whose extent was cut (they must stay whole).
"""

from __future__ import annotations

import math

__all__ = ["dim_groups", "is_one_to_one", "FOLDABLE", "IDENTITY_OPS", "fold_dims"]

# ops that return their input unchanged in shape and values (a copy, a cast, an alias)
IDENTITY_OPS = frozenset({"alias", "detach", "clone", "contiguous", "to", "_to_copy", "lift_fresh_copy",
                          "_assert_tensor_metadata"})
# ops the tracer folds into a parameter's consumer when they read only that parameter
FOLDABLE = IDENTITY_OPS | frozenset({"t", "transpose", "permute", "unsqueeze", "squeeze", "slice", "select", "expand",
                                     "view", "reshape", "_unsafe_view", "numpy_T"})


def dim_groups(in_shape, out_shape) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Consecutive groups of equal element count (the module docstring); ValueError when
    the element counts differ."""
    in_shape, out_shape = tuple(int(s) for s in in_shape), tuple(int(s) for s in out_shape)
    if math.prod(in_shape) != math.prod(out_shape):
        raise ValueError(f"a view from {in_shape} to {out_shape} changes the element count")
    groups = []
    i = o = 0
    while i < len(in_shape) or o < len(out_shape):
        if i < len(in_shape) and in_shape[i] == 1:
            groups.append(((i,), ()))
            i += 1
            continue
        if o < len(out_shape) and out_shape[o] == 1:
            groups.append(((), (o,)))
            o += 1
            continue
        ins, outs = [i], [o]
        in_count, out_count = in_shape[i], out_shape[o]
        i, o = i + 1, o + 1
        while in_count != out_count:
            if in_count < out_count:
                ins.append(i)
                in_count *= in_shape[i]
                i += 1
            else:
                outs.append(o)
                out_count *= out_shape[o]
                o += 1
        groups.append((tuple(ins), tuple(outs)))
    return tuple(groups)


def is_one_to_one(groups) -> bool:
    """True when every group maps at most one dim to at most one dim (only size-1 dims
    come or go): the view is a relabelling of dims."""
    return all(len(ins) <= 1 and len(outs) <= 1 for ins, outs in groups)


def fold_dims(op: str, args: dict, in_shape, out_shape, operand_dims, sliced):
    """The operand's (dims, sliced param dims) after ``op`` (one of FOLDABLE) given
    those of its input; None when the op is not a relabelling of dims (a real reshape
    of a parameter, which the tracer refuses)."""
    dims = list(operand_dims)
    sliced = set(sliced)
    ndim = len(in_shape)
    if op in IDENTITY_OPS:
        return tuple(dims), tuple(sorted(sliced))
    if op in ("t", "numpy_T"):
        return tuple(reversed(dims)), tuple(sorted(sliced))
    if op == "transpose":
        a, b = (args["dim0"] % ndim, args["dim1"] % ndim) if ndim else (0, 0)
        dims[a], dims[b] = dims[b], dims[a]
        return tuple(dims), tuple(sorted(sliced))
    if op == "permute":
        perm = [d % ndim for d in args["dims"]]
        return tuple(dims[d] for d in perm), tuple(sorted(sliced))
    if op in ("slice", "select"):
        dim = args["dim"] % ndim
        if dims[dim] >= 0 and (op == "select" or in_shape[dim] != out_shape[dim]):
            sliced.add(dims[dim])
        if op == "select":
            del dims[dim]
        return tuple(dims), tuple(sorted(sliced))
    if op == "expand":
        lead = len(out_shape) - ndim
        return tuple([-1] * lead + [d if in_shape[k] == out_shape[lead + k] else -1 for k, d in enumerate(dims)]), \
            tuple(sorted(sliced))
    # unsqueeze, squeeze, view, reshape: a relabelling only when size-1 dims come and go
    groups = dim_groups(in_shape, out_shape)
    if not is_one_to_one(groups):
        return None
    result = [-1] * len(out_shape)
    for ins, outs in groups:
        if ins and outs:
            result[outs[0]] = dims[ins[0]]
    return tuple(result), tuple(sorted(sliced))
