"""Rewrites of torch.export's unlifted GraphModule into the canonical form the tracer
classifies and the executor runs, each exact (the same values, up to the rounding of
one fused kernel versus two):

- ``drop_checks``: the input guards (``_guards_fn``) and ``_assert_tensor_metadata``
  nodes go, so the module runs on local shards whose shapes differ from the trace's;
- ``canonical_params``: every get_attr of a parameter reads it by the name
  ``model.named_parameters()`` gives (a tied head's weight by its embedding's name);
- ``split_getitems``: ``getitem(split/chunk/unbind/broadcast_tensors(x), i)`` becomes one
  single-output view of x (``slice`` / ``select`` / ``expand``, or x itself), so every
  tensor in the graph is one node's output;
- ``linears``: a product with a parameter matrix becomes ``aten.linear(x, W, b)``
  (W as (out, in), through a folded ``t`` where the parameter is stored (in, out)):
  ``mm(x, W)``, ``matmul(x, W)``, ``addmm(b, x, W)`` (HF's Conv1D) and the flatten
  view -> mm/addmm -> unflatten view around them (so the linear sees (..., in));
- ``empty_cats``: a cat of one tensor and empty ones (HF's key/value cache) is that tensor;
- ``identity_views``: a view / reshape / expand / alias to the shape it already has goes;
- ``shape_only``: ``zeros_like(x)``, ``new_ones(x, size)``, ... become ``aten.full`` of
  the global shape (constants: they never read x's values).
"""

from __future__ import annotations

import operator

import torch

from plait.parallel.auto.trace_kinds import bind, op_name
from plait.parallel.auto.trace_views import FOLDABLE

__all__ = ["drop_checks", "canonical_params", "split_getitems", "shape_only", "empty_cats", "identity_views", "linears",
           "param_root"]

aten = torch.ops.aten
FILLS = {"zeros_like": 0, "ones_like": 1, "empty_like": 0, "full_like": None, "new_zeros": 0, "new_ones": 1,
         "new_empty": 0, "new_full": None}
IDENTITY_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                            aten.alias.default})
SPLITS = frozenset({"split", "split_with_sizes", "unsafe_split", "unsafe_split_with_sizes", "chunk",
                    "tensor_split"})


def drop_checks(module: torch.fx.GraphModule) -> None:
    """Remove the guards and metadata asserts, then dead nodes (fx keeps impure ones)."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
            if hasattr(module, "_guards_fn"):
                delattr(module, "_guards_fn")
        elif node.op == "call_function" and node.target is aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code()


def canonical_params(module: torch.fx.GraphModule, model: torch.nn.Module) -> dict[str, str]:
    """Rewrite get_attr targets of parameters to the model's names; returns {get_attr
    node name: parameter name}. Refuses a parameter the model does not own."""
    by_id = {}
    for name, param in model.named_parameters():
        by_id.setdefault(id(param), name)
    reads = {}
    for node in module.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            value = module.get_parameter(node.target)
        except AttributeError:
            continue
        name = by_id.get(id(value))
        if name is None:
            raise ValueError(f"the traced module's parameter {node.target!r} is not one of the model's parameters "
                             f"(torch.export copied it?): auto-parallel needs the model's own parameter objects")
        node.target = name
        reads[node.name] = name
    return reads


def _fake(target, args, kwargs=None):
    """The FakeTensor a new node produces (its meta['val'])."""
    values = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    fake_mode = next(v.fake_mode for v in torch.utils._pytree.tree_leaves(values) if hasattr(v, "fake_mode"))
    with fake_mode:
        return target(*values, **(kwargs or {}))


def _insert(graph, before, target, args, like) -> torch.fx.Node:
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    node.meta.update({key: like.meta[key] for key in ("nn_module_stack", "stack_trace") if key in like.meta})
    node.meta["val"] = _fake(target, args)
    return node


def split_getitems(module: torch.fx.GraphModule) -> None:
    graph = module.graph
    for source in list(graph.nodes):
        if source.op != "call_function" or not isinstance(source.target, torch._ops.OpOverload):
            continue
        name = op_name(source.target)
        if name not in SPLITS | {"unbind", "broadcast_tensors"}:
            continue
        getters = [user for user in source.users if user.target is operator.getitem]
        if len(getters) != len(source.users):
            continue
        pieces = source.meta["val"]
        for getter in getters:
            index = getter.args[1]
            if name == "broadcast_tensors":
                origin = source.args[0][index]
                if tuple(origin.meta["val"].shape) == tuple(pieces[index].shape):
                    getter.replace_all_uses_with(origin)
                    graph.erase_node(getter)
                    continue
                new = _insert(graph, getter, aten.expand.default, (origin, list(pieces[index].shape)), getter)
            else:
                x = source.args[0]
                dim = int(bind(source).get("dim", 0)) % x.meta["val"].dim()
                if name == "unbind":
                    new = _insert(graph, getter, aten.select.int, (x, dim, index), getter)
                else:
                    start = sum(int(piece.shape[dim]) for piece in pieces[:index])
                    new = _insert(graph, getter, aten.slice.Tensor,
                                  (x, dim, start, start + int(pieces[index].shape[dim])), getter)
            getter.replace_all_uses_with(new)
            graph.erase_node(getter)
        if not source.users:
            graph.erase_node(source)


def shape_only(module: torch.fx.GraphModule) -> None:
    """``zeros_like(x)`` / ``new_ones(x, size)`` / ... read only x's shape, dtype and device:
    each becomes ``aten.full(global shape, value)``, a constant that runs whole."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = op_name(node.target)
        if name not in FILLS:
            continue
        value = node.meta["val"]
        fill = bind(node)["fill_value"] if FILLS[name] is None else FILLS[name]
        with graph.inserting_before(node):
            full = graph.call_function(aten.full.default, (list(value.shape), fill),
                                       {"dtype": value.dtype, "device": value.device})
        full.meta.update(node.meta)
        node.replace_all_uses_with(full)
        graph.erase_node(node)


def empty_cats(module: torch.fx.GraphModule) -> None:
    """``cat([empty, x])`` (HF's key/value cache, empty at the first step) is x; the empty
    constants it read go with it."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        full = [piece for piece in node.args[0] if piece.meta["val"].numel() > 0]
        if len(full) == 1 and tuple(full[0].meta["val"].shape) == tuple(node.meta["val"].shape):
            node.replace_all_uses_with(full[0])
            graph.erase_node(node)
    graph.eliminate_dead_code(is_impure_node=_impure)


def _impure(node) -> bool:
    """fx's rule, except an in-place detach of a fresh copy (HF's cache tensors), which no
    one can observe."""
    if node.target is aten.detach_.default and node.args[0].target is aten.lift_fresh_copy.default:
        return False
    return node.is_impure()


def identity_views(module: torch.fx.GraphModule) -> None:
    """A view / reshape / expand / alias whose output has its input's shape is its input:
    its readers read the input instead (the same values, the same gradient)."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in IDENTITY_VIEWS:
            continue
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and isinstance(source.meta.get("val"), torch.Tensor) and \
                tuple(source.meta["val"].shape) == tuple(node.meta["val"].shape):
            node.replace_all_uses_with(source)
            graph.erase_node(node)


def param_root(node, params: dict) -> str | None:
    """The parameter a node is (a get_attr in ``params``, {node name: param name}) or
    reads through FOLDABLE single-input ops only, else None."""
    while True:
        if node.op == "get_attr":
            return params.get(node.name)
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return None
        if op_name(node.target) not in FOLDABLE:
            return None
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(tensors) != 1:
            return None
        node = tensors[0]


def _transposed(graph, weight, before, like):
    """W as (out, in) for aten.linear: the input of a t() of it when there is one."""
    if weight.op == "call_function" and weight.target in (aten.t.default, aten.numpy_T.default):
        return weight.args[0]
    return _insert(graph, before, aten.t.default, (weight,), like)


def linears(module: torch.fx.GraphModule, params: dict) -> None:
    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.matmul.default,
                                                             aten.addmm.default):
            continue
        if node.target is aten.addmm.default:
            bias, x, weight = node.args[:3]
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) > 3:
                continue
            if param_root(bias, params) is None or bias.meta["val"].dim() != 1:
                continue
        else:
            (x, weight), bias = node.args[:2], None
        if param_root(weight, params) is None or weight.meta["val"].dim() != 2 or param_root(x, params) is not None:
            continue
        result = node
        x_shape = tuple(x.meta["val"].shape)
        only_user = next(iter(node.users)) if len(node.users) == 1 else None
        if (x.op == "call_function" and x.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
                and len(x.users) == 1 and only_user is not None
                and only_user.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)):
            flat_in = x.args[0]
            lead = tuple(flat_in.meta["val"].shape[:-1])
            out_shape = tuple(only_user.meta["val"].shape)
            if len(x_shape) == 2 and x_shape[1] == flat_in.meta["val"].shape[-1] and out_shape[:-1] == lead:
                x, result = flat_in, only_user
        transposed = _transposed(graph, weight, node, node)
        args = (x, transposed) if bias is None else (x, transposed, bias)
        linear = _insert(graph, node, aten.linear.default, args, node)
        result.replace_all_uses_with(linear)
        flat = node.args[1] if node.target is aten.addmm.default else node.args[0]
        for dead in dict.fromkeys((result, node, flat)):
            if dead.op == "call_function" and not dead.users:
                graph.erase_node(dead)
        if weight.op == "call_function" and not weight.users:
            graph.erase_node(weight)
