"""Which OpNode kind an aten op of torch.export's training IR is, with its attrs and
forward FLOPs (``plait.parallel.auto.opgraph`` lists the kinds). ``inputs`` are the
producers of the tensor arguments in schema order, ``params`` the parameters read
(directly or through folded views). Attrs per kind (dims normalised to >= 0):

    linear     weight, bias (name or None), weight_out_dim (0: W stored (out, in) as
               nn.Linear; 1: stored (in, out) as HF's Conv1D), in_features, out_features
    matmul     m, k, n (a (..., m, k) @ b (..., k, n)), param_side (None, or which operand
               is a parameter: MoE's stacked expert weights)
    attention  is_causal, scale, has_mask (the mask is inputs[3]), enable_gqa, dropout_p
    conv       weight, bias, stride, padding, dilation, groups, transposed, spatial_ndim
    embedding  weight, padding_idx
    norm       op (layer_norm | group_norm | rms_norm), normalized_ndim (trailing dims;
               group_norm: all but the batch dim, and groups), eps
    softmax    op (softmax | log_softmax), dim
    elementwise  op (the aten name, an in-place '_' stripped), p for dropout
    reduce     op, dims, keepdim; topk / max.dim / ... read through getitem: also index
               (0 values, 1 indices) and k
    view       op, dim_groups (trace_views.dim_groups), sliced_dims (input dims a shard
               cannot cross: cut by slice / select / narrow, or the dim of a cat),
               expanded_dims (output dims broadcast by expand); slice / narrow: dim, start,
               end, step; select: dim, index; cat / stack: dim
    permute    perm (output dim j is input dim perm[j])
    loss       op (cross_entropy | nll | mse | ...), reduction (none | mean | sum),
               class_dim, ignore_index, label_smoothing where the op has them

and every node reading a parameter: param_operands = ((param, operand shape, operand
dims: the parameter dim each operand dim comes from, -1 when new, sliced parameter
dims), ...).

FLOPs: matmuls, linears and attention count 2·m·n·k per product (attention: QKᵀ and
P·V, 4·b·h·s_q·s_k·d), convolutions as torch.utils.flop_counter counts them; the
bandwidth-bound kinds count what they touch, which is only a tie-breaker for the
strategies (they price those by bytes): elementwise 1 per output element, norm and
softmax 5 per element, reduce 1 per input element, loss 5 per input element, views,
permutes, embeddings and constants 0.

An op outside these tables is refused by name (``refusal``) unless torch tags it
pointwise (elementwise) or reduction (reduce).
"""

from __future__ import annotations

import math
import operator

import torch
from torch.utils.flop_counter import conv_flop_count, sdpa_flop_count

from plait.parallel.auto.trace_views import IDENTITY_OPS, dim_groups

__all__ = ["Unsupported", "op_name", "bind", "classify", "refusal", "REDUCTIONS", "SELECTIONS"]

LINEAR_OPS = frozenset({"linear"})
MATMUL_OPS = frozenset({"mm", "bmm", "matmul"})
CONV_OPS = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d",
                      "conv_transpose3d"})
NORM_OPS = frozenset({"layer_norm", "group_norm", "rms_norm"})
SOFTMAX_OPS = {"softmax": "softmax", "_softmax": "softmax", "log_softmax": "log_softmax",
               "_log_softmax": "log_softmax"}
LOSS_OPS = {"cross_entropy_loss": "cross_entropy", "nll_loss_nd": "nll", "nll_loss": "nll", "nll_loss2d": "nll",
            "mse_loss": "mse", "l1_loss": "l1", "smooth_l1_loss": "smooth_l1", "huber_loss": "huber",
            "binary_cross_entropy_with_logits": "bce_with_logits"}
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
ELEMENTWISE_OPS = IDENTITY_OPS | frozenset({"dropout", "feature_dropout", "alpha_dropout", "__or__", "__and__",
                                           "__xor__", "__invert__", "__lshift__", "__rshift__"})
# ops returning (values, indices) along one dim, read through getitem: reduce-like nodes
SELECTIONS = frozenset({"topk", "max", "min", "kthvalue", "mode", "median", "nanmedian"})
RESHAPE_OPS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze"})
PERMUTE_OPS = frozenset({"permute", "transpose", "t", "numpy_T", "swapaxes", "movedim"})

# the fixes named when an op is refused
FIXES = {
    "batch_norm": "BatchNorm's batch statistics need the whole batch and update buffers in place: use GroupNorm or "
                  "LayerNorm (or fold it into the convolution for inference)",
    "_native_batch_norm_legit_functional": "BatchNorm: use GroupNorm or LayerNorm",
    "nonzero": "its output shape depends on the data: compute it outside the model or use a mask (torch.where)",
    "masked_select": "its output shape depends on the data: multiply by the mask instead",
    "_local_scalar_dense": "a Python number read from a tensor (.item()) depends on the data: keep it a tensor",
    "index": "indexing by a tensor is unsupported: use F.embedding for table lookups and F.cross_entropy for labels",
    "gather": "gathering by a tensor is unsupported: use F.cross_entropy for label lookups or F.embedding",
    "scatter": "scattering by a tensor is unsupported",
    "index_put": "writing through a tensor index is unsupported: build the tensor with torch.where",
    "sort": "sorting is unsupported: compute it outside the model",
    "topk": "top-k is unsupported (data-dependent routing): use a dense mixture (softmax-weighted sum)",
    "argsort": "sorting is unsupported: compute it outside the model",
    "einsum": "write the contraction with torch.matmul / F.linear",
    "baddbmm": "write it as torch.bmm(a, b) + c",
    "addbmm": "write it as torch.bmm(a, b).sum(0) + c",
    "repeat": "use expand (a broadcast) instead of repeat",
    "cumsum": "prefix sums along a dim are unsupported",
}


class Unsupported(ValueError):
    """classify's way of saying an op has no sharding rule (``str``: the fix, or empty)."""


def op_name(target) -> str:
    """'aten.add_.Tensor' -> 'add' (the overload packet's name, in-place '_' stripped
    unless the name starts with one)."""
    name = target.overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) else getattr(
        target, "__name__", str(target))
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def bind(node) -> dict:
    """The call's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    bound = {}
    for position, argument in enumerate(schema.arguments):
        if position < len(node.args) and not argument.kwarg_only:
            bound[argument.name] = node.args[position]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def refusal(node, module: str, why: str = "") -> ValueError:
    """The ValueError naming an op the auto-parallel tracer cannot shard."""
    name = op_name(node.target)
    fix = why or FIXES.get(name) or ("it has no sharding rule; make the model use supported ops (linear, matmul, "
                                     "attention, conv, embedding, norms, softmax, pointwise ops, reductions, views)")
    return ValueError(f"auto-parallel cannot trace {node.target} (node {node.name!r} in module "
                      f"{module or '<top>'!r}): {fix}")


def _dims(dims, ndim: int) -> tuple[int, ...]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({d % ndim for d in dims})) if ndim else ()


def classify(node, shapes: dict, in_shapes: list, operands: list) -> tuple[str, dict, float]:
    """(kind, attrs, forward flops) of a call_function node that depends on an input
    (the tracer has set constants and folded parameter views aside). ``shapes``: the
    output shape of every fx node by name; ``in_shapes``: the shape of each tensor
    argument in argument order; ``operands``: for each such argument, ("input", fx name)
    or ("param", param name, operand dims). Raises ``refusal`` for an op it cannot shard
    (the caller adds the module path)."""
    name = op_name(node.target)
    out = shapes[node.name]
    numel = math.prod(out)
    args = bind(node) if isinstance(node.target, torch._ops.OpOverload) else {}
    if node.target is operator.getitem:
        return _selection(node, in_shapes[0], out)
    if name in LINEAR_OPS:
        kinds = [entry[0] for entry in operands]
        if kinds[:2] != ["input", "param"] or (len(kinds) > 2 and kinds[2] != "param") or len(in_shapes[1]) != 2:
            raise Unsupported("F.linear whose weight is not a parameter: write torch.matmul(x, w.transpose(-1, -2))")
        weight_dims = operands[1][2]
        in_features, out_features = in_shapes[1][1], in_shapes[1][0]
        attrs = dict(weight=operands[1][1], bias=operands[2][1] if len(operands) > 2 else None,
                     weight_out_dim=weight_dims[0], in_features=in_features, out_features=out_features)
        return "linear", attrs, 2.0 * math.prod(in_shapes[0][:-1]) * in_features * out_features
    if name in MATMUL_OPS:
        a, b = in_shapes[0], in_shapes[1]
        m, k = (a[-2] if len(a) > 1 else 1), a[-1]
        n = b[-1] if len(b) > 1 else 1
        batch = math.prod(out) // (m * n)  # out is (*batch, m, n) without the 1-d operands' dim
        sides = [position for position, entry in enumerate(operands[:2]) if entry[0] == "param"]
        if len(sides) > 1:
            raise Unsupported("a product of two parameters is unsupported: precompute it")
        attrs = dict(m=m, k=k, n=n, param_side=sides[0] if sides else None)
        return "matmul", attrs, 2.0 * batch * m * k * n
    if name == "scaled_dot_product_attention":
        attrs = dict(is_causal=bool(args["is_causal"]), scale=args.get("scale"),
                     has_mask=isinstance(args.get("attn_mask"), torch.fx.Node),
                     enable_gqa=bool(args.get("enable_gqa", False)), dropout_p=float(args["dropout_p"]))
        return "attention", attrs, float(sdpa_flop_count(list(in_shapes[0]), list(in_shapes[1]),
                                                         list(in_shapes[2])))
    if name in CONV_OPS:
        transposed = bool(args.get("transposed", name.startswith("conv_transpose")))
        weight = operands[1][1] if len(operands) > 1 and operands[1][0] == "param" else None
        bias = operands[2][1] if len(operands) > 2 and operands[2][0] == "param" else None
        if weight is None:
            raise Unsupported("a convolution whose weight is not a parameter is unsupported")
        attrs = dict(weight=weight, bias=bias, stride=tuple(args.get("stride", ())),
                     padding=args.get("padding") if isinstance(args.get("padding"), str) else tuple(
                         args.get("padding", ())),
                     dilation=tuple(args.get("dilation", ())), groups=int(args.get("groups", 1)),
                     transposed=transposed, spatial_ndim=len(out) - 2)
        return "conv", attrs, float(conv_flop_count(list(in_shapes[0]), list(in_shapes[1]), list(out), transposed))
    if name == "embedding":
        if operands[0][0] != "param":
            raise Unsupported("an embedding whose table is not a parameter is unsupported")
        return "embedding", dict(weight=operands[0][1], padding_idx=int(args["padding_idx"])), 0.0
    if name in NORM_OPS:
        ndim = len(out)
        if name == "group_norm":
            attrs = dict(op=name, normalized_ndim=ndim - 1, groups=int(args["num_groups"]), eps=float(args["eps"]))
        else:
            eps = args.get("eps")
            attrs = dict(op=name, normalized_ndim=len(args["normalized_shape"]),
                         eps=None if eps is None else float(eps))
        return "norm", attrs, 5.0 * numel
    if name in SOFTMAX_OPS:
        return "softmax", dict(op=SOFTMAX_OPS[name], dim=int(args["dim"]) % max(len(out), 1)), 5.0 * numel
    if name in LOSS_OPS:
        first = in_shapes[0]
        attrs = dict(op=LOSS_OPS[name], reduction=REDUCTIONS[int(args.get("reduction", 1))],
                     class_dim=1 if len(first) > 1 else 0)
        if "ignore_index" in args:
            attrs["ignore_index"] = int(args["ignore_index"])
        if "label_smoothing" in args:
            attrs["label_smoothing"] = float(args["label_smoothing"])
        return "loss", attrs, 5.0 * math.prod(first)
    if name in PERMUTE_OPS:
        return "permute", dict(perm=_perm(name, args, len(in_shapes[0]))), 0.0
    if name in RESHAPE_OPS:
        groups = dim_groups(in_shapes[0], out)
        return "view", dict(op=name, dim_groups=groups, sliced_dims=(), expanded_dims=()), 0.0
    if name == "expand":
        return "view", _expand_attrs(in_shapes[0], out), 0.0
    if name in ("slice", "narrow", "select"):
        dim = int(args["dim"]) % len(in_shapes[0])
        ndim = len(in_shapes[0])
        cut = (dim,) if name == "select" or in_shapes[0][dim] != out[dim] else ()
        groups = tuple(((d,), () if (name == "select" and d == dim) else (d - (name == "select" and d > dim),))
                       for d in range(ndim))
        attrs = dict(op=name, dim_groups=groups, sliced_dims=cut, expanded_dims=(), dim=dim)
        attrs.update(_bounds(name, args, in_shapes[0][dim]))
        return "view", attrs, 0.0
    if name in ("cat", "stack"):
        ndim = len(in_shapes[0])
        dim = int(args["dim"]) % (ndim + (name == "stack"))
        if name == "cat":
            groups = tuple(((d,), (d,)) for d in range(ndim))
            return "view", dict(op=name, dim=dim, dim_groups=groups, sliced_dims=(dim,), expanded_dims=()), 0.0
        groups = tuple(((d,), (d + (d >= dim),)) for d in range(ndim))
        groups = tuple(sorted(groups + (((), (dim,)),), key=lambda g: g[1]))
        return "view", dict(op=name, dim=dim, dim_groups=groups, sliced_dims=(), expanded_dims=()), 0.0
    if name in ELEMENTWISE_OPS or (isinstance(node.target, torch._ops.OpOverload)
                                   and torch.Tag.pointwise in node.target.tags):
        attrs = dict(op=name)
        if name in ("dropout", "feature_dropout", "alpha_dropout"):
            attrs["p"] = float(args["p"])
        return "elementwise", attrs, float(numel)
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.reduction in node.target.tags and len(
            out) <= len(in_shapes[0]) and name not in FIXES:
        ndim = len(in_shapes[0])
        keepdim = bool(args.get("keepdim", False))
        return "reduce", dict(op=name, dims=_dims(args.get("dim"), ndim), keepdim=keepdim), float(
            math.prod(in_shapes[0]))
    raise Unsupported("")


def _selection(node, in_shape, out) -> tuple[str, dict, float]:
    """getitem(topk/max.dim/..., i): a reduce along one dim (values or indices)."""
    source = node.args[0]
    name = op_name(source.target)
    if name not in SELECTIONS:
        raise Unsupported("")
    args = bind(source)
    if "dim" not in args:
        raise Unsupported(f"{name} over all dims returns no (values, indices) pair to shard")
    ndim = len(in_shape)
    attrs = dict(op=name, dims=(int(args["dim"]) % ndim,), keepdim=name == "topk" or bool(args.get("keepdim", False)),
                 index=int(node.args[1]))
    if name == "topk":
        attrs["k"] = int(args["k"])
    return "reduce", attrs, float(math.prod(in_shape))


def _bounds(name: str, args: dict, size: int) -> dict:
    """slice / narrow: start, end (normalised to [0, size]) and step; select: index (>= 0)."""
    if name == "select":
        return dict(index=int(args["index"]) % size)
    if name == "narrow":
        start = int(args["start"]) % size if size else 0
        return dict(start=start, end=start + int(args["length"]), step=1)
    start, end = args.get("start"), args.get("end")
    start = 0 if start is None else int(start)
    end = size if end is None else int(end)
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, 0), size)
    return dict(start=start, end=end, step=int(args.get("step", 1)))


def _perm(name: str, args: dict, ndim: int) -> tuple[int, ...]:
    if name in ("t", "numpy_T"):
        return tuple(reversed(range(ndim)))
    if name in ("transpose", "swapaxes"):
        a, b = args.get("dim0", args.get("axis0")) % ndim, args.get("dim1", args.get("axis1")) % ndim
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return tuple(perm)
    if name == "movedim":
        source, destination = args["source"], args["destination"]
        source = [source] if isinstance(source, int) else list(source)
        destination = [destination] if isinstance(destination, int) else list(destination)
        perm = [None] * ndim
        for s, d in zip(source, destination):
            perm[d % ndim] = s % ndim
        rest = iter(d for d in range(ndim) if d not in {s % ndim for s in source})
        return tuple(p if p is not None else next(rest) for p in perm)
    return tuple(d % ndim for d in args["dims"])


def _expand_attrs(in_shape, out) -> dict:
    lead = len(out) - len(in_shape)
    groups = tuple(((), (o,)) for o in range(lead)) + tuple(((k,), (lead + k,)) for k in range(len(in_shape)))
    expanded = tuple(o for o in range(len(out)) if o < lead or in_shape[o - lead] != out[o])
    return dict(op="expand", dim_groups=groups, sliced_dims=(), expanded_dims=expanded)
