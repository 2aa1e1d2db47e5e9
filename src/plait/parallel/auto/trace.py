"""A model's training step as an OpGraph, from torch.export's training IR.

``trace_graph(model, example_inputs)`` exports ``model(*example_inputs)`` (which returns
the scalar loss) with ``torch.export.export(strict=False)``, unlifts it
(``ep.module()``: parameters read by get_attr, the model's own objects), rewrites it into
a canonical form (``trace_rewrite``) and classifies every tensor-valued node:

- a placeholder is an ``input`` node, the returned loss feeds the ``output`` node;
- a node that depends on no input and no parameter (arange, masks, a buffer) is a
  ``constant``: replicated, run whole on every rank;
- a layout-transparent op that reads only a parameter (t, transpose, permute, slice,
  unsqueeze, ...; ``trace_views.FOLDABLE``) is folded into each node that reads it: that
  node lists the parameter in ``params``, the folded fx nodes in ``members`` and how the
  operand's dims come from the parameter's in ``attrs['param_operands']``;
- every other op gets its kind, attrs and FLOPs from ``trace_kinds.classify`` or is
  refused by name (op, module path, fix).

Node names are the fx nodes' in ``TracedGraph.module.graph``; a node's value is its
member that comes last in that graph. ``simplify`` (``trace_simplify``) merges Alpa's
elementwise chains.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from plait.parallel.auto.opgraph import OpGraph, OpNode, ParamMeta
from plait.parallel.auto.trace_kinds import SELECTIONS, Unsupported, bind, classify, op_name, refusal
from plait.parallel.auto.trace_rewrite import (canonical_params, drop_checks, empty_cats, identity_views, linears,
                                              shape_only, split_getitems)
from plait.parallel.auto.trace_simplify import simplify
from plait.parallel.auto.trace_views import FOLDABLE, dim_groups, fold_dims

__all__ = ["TracedGraph", "trace_graph", "simplify", "dim_groups"]


@dataclass(frozen=True)
class TracedGraph:
    """``graph`` (OpGraph, unsimplified), ``module`` (the canonical fx GraphModule: run it
    with the global inputs and it returns the loss, as the model does), the
    ``example_inputs`` it was traced with, and ``random_ops``: fx nodes that draw random
    numbers (dropout with p > 0 in training): not reproducible shard by shard."""

    graph: OpGraph
    module: torch.fx.GraphModule
    example_inputs: tuple
    random_ops: tuple[str, ...] = ()

    def fx_node(self, name: str) -> torch.fx.Node:
        """The fx node called ``name`` in ``module.graph``."""
        for node in self.module.graph.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no fx node {name!r} in the traced module")

    def value_node(self, node) -> torch.fx.Node:
        """The fx node whose output is an OpNode's value (its last member in graph order);
        ``node``: an OpNode (of this graph or of its ``simplify``) or a name in ``graph``."""
        members = set((self.graph.node(node) if isinstance(node, str) else node).members)
        return [node for node in self.module.graph.nodes if node.name in members][-1]


def trace_graph(model: torch.nn.Module, example_inputs) -> TracedGraph:
    """Export ``model(*example_inputs)`` -> scalar loss and build its OpGraph (module
    docstring). Raises ValueError naming any op it cannot shard."""
    example_inputs = tuple(example_inputs)
    for position, value in enumerate(example_inputs):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"example_inputs[{position}] is a {type(value).__name__}: auto-parallel traces "
                             f"tensor inputs only (bind other arguments in the model)")
    try:
        exported = torch.export.export(model, example_inputs, strict=False)
    except Exception as error:  # torch raises many kinds; re-raised with the model named
        raise ValueError(f"torch.export(strict=False) could not trace {type(model).__name__}: "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
                         f"(auto-parallel needs a model torch.export accepts)") from error
    module = exported.module()
    drop_checks(module)
    param_reads = canonical_params(module, model)
    split_getitems(module)
    shape_only(module)
    empty_cats(module)
    identity_views(module)
    linears(module, param_reads)
    module.graph.lint()
    module.recompile()
    graph, random_ops = _build(module, model, param_reads)
    return TracedGraph(graph=graph, module=module, example_inputs=example_inputs, random_ops=random_ops)


def _shape(node) -> tuple[int, ...]:
    value = node.meta["val"]
    if not all(isinstance(size, int) for size in value.shape):  # a torch.SymInt: unknown until the data is seen
        raise refusal(node, _module_path(node), f"its output shape {tuple(value.shape)} depends on the data; "
                                                f"auto-parallel needs static shapes")
    return tuple(value.shape)


def _is_tensor(node) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _tensor_args(node) -> list:
    """The fx nodes among the call's arguments, in schema order (lists flattened)."""
    values = list(bind(node).values()) if isinstance(node.target, torch._ops.OpOverload) else list(node.args)
    found = []
    for value in values:
        for item in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(item, torch.fx.Node):
                found.append(item)
    return found


def _build(module, model, param_reads) -> tuple[OpGraph, tuple[str, ...]]:
    """One pass over the canonical module in graph order (the module docstring's rules):
    the OpGraph and the random ops. ``param_reads``: {get_attr node: parameter name}."""
    nodes, inputs, random_ops = [], [], []
    shapes = {}
    depends_input, depends_param = set(), set()
    folds = {}  # fx name -> (param name, operand dims, sliced param dims, fx names folded in)
    op_nodes = set()
    output = None
    order = {fx_node.name: position for position, fx_node in enumerate(module.graph.nodes)}
    for node in module.graph.nodes:
        if _is_tensor(node):
            shapes[node.name] = _shape(node)
        if node.op == "placeholder":
            if not _is_tensor(node):
                raise ValueError(f"input {node.name!r} is not a tensor: auto-parallel traces tensor inputs only")
            depends_input.add(node.name)
            nodes.append(_op(node, "input", (), (), 0.0, {"index": len(inputs)}))
            inputs.append(node.name)
            op_nodes.add(node.name)
            continue
        if node.op == "get_attr":
            if node.name in param_reads:
                depends_param.add(node.name)
                folds[node.name] = (param_reads[node.name], tuple(range(len(shapes[node.name]))), (), ())
            elif _is_tensor(node):
                nodes.append(_op(node, "constant", (), (), 0.0, {}))
                op_nodes.add(node.name)
            continue
        if node.op == "output":
            output = _output(node, op_nodes, shapes)
            continue
        if node.op != "call_function":
            raise ValueError(f"unexpected {node.op} node {node.name!r} ({node.target}) in the exported graph")
        sources = node.all_input_nodes
        if any(source.name in depends_input for source in sources):
            depends_input.add(node.name)
        if any(source.name in depends_param for source in sources):
            depends_param.add(node.name)
        if not _is_tensor(node):
            if isinstance(node.meta.get("val"), (list, tuple)) and node.name in depends_input and \
                    op_name(node.target) not in SELECTIONS:
                raise refusal(node, _module_path(node), "")
            continue
        if _random(node):  # a dropout mask drawn as a constant (plait's ConsistentDropout) counts too
            random_ops.append(node.name)
        if node.name not in depends_input and node.name not in depends_param:
            nodes.append(_op(node, "constant", _node_args(node, op_nodes), (), 0.0, {}))
            op_nodes.add(node.name)
            continue
        source = _selection_source(node)
        tensor_args = [arg for arg in _tensor_args(source or node) if _is_tensor(arg)]
        name = op_name(node.target)
        if node.name not in depends_input and name in FOLDABLE and len(tensor_args) == 1 and \
                tensor_args[0].name in folds:
            param, dims, sliced, chain = folds[tensor_args[0].name]
            args = bind(node) if isinstance(node.target, torch._ops.OpOverload) else {}
            folded = fold_dims(name, args, shapes[tensor_args[0].name], shapes[node.name], dims, sliced)
            if folded is None:
                raise refusal(node, _module_path(node), f"a reshape of parameter {param!r} from "
                              f"{shapes[tensor_args[0].name]} to {shapes[node.name]} cannot be sharded: store the "
                              f"parameter in the shape it is used in")
            folds[node.name] = (param, folded[0], folded[1], chain + (node.name,))
            continue
        nodes.append(_classified(node, tensor_args, shapes, folds, op_nodes, order))
        op_nodes.add(node.name)
    params = tuple(ParamMeta(name, tuple(param.shape), str(param.dtype).removeprefix("torch."), param.element_size())
                   for name, param in model.named_parameters())
    nodes.append(output)
    return OpGraph(nodes=tuple(nodes), params=params, inputs=tuple(inputs), output=output.name), tuple(random_ops)


def _node_args(node, op_nodes) -> tuple[str, ...]:
    return tuple(arg.name for arg in _tensor_args(node) if arg.name in op_nodes)


def _selection_source(node):
    """The topk / max.dim / ... node a getitem reads (the getitem is the OpNode), else None."""
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and \
            isinstance(node.args[0].target, torch._ops.OpOverload) and op_name(node.args[0].target) in SELECTIONS:
        return node.args[0]
    return None


def _random(node) -> bool:
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    args = bind(node)
    if "dropout_p" in args:
        return float(args["dropout_p"]) > 0
    if op_name(node.target) in ("dropout", "feature_dropout", "alpha_dropout"):
        return float(args["p"]) > 0 and bool(args["train"])
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def _classified(node, tensor_args, shapes, folds, op_nodes, order) -> OpNode:
    operands, in_shapes, inputs, params, members, param_operands = [], [], [], [], [], []
    for arg in tensor_args:
        if arg.name in folds:
            param, dims, sliced, chain = folds[arg.name]
            operands.append(("param", param, dims))
            if param not in params:
                params.append(param)
            members.extend(chain)
            param_operands.append((param, shapes[arg.name], dims, sliced))
        elif arg.name in op_nodes:
            operands.append(("input", arg.name))
            inputs.append(arg.name)
        else:
            continue
        in_shapes.append(shapes[arg.name])
    module = _module_path(node)
    try:
        kind, attrs, flops = classify(node, shapes, in_shapes, operands)
    except Unsupported as error:
        raise refusal(node, module, str(error)) from None
    if param_operands:
        attrs["param_operands"] = tuple(param_operands)
    source = _selection_source(node)
    members = [node.name] + sorted(dict.fromkeys(members + ([source.name] if source else [])), key=order.__getitem__)
    return _op(node, kind, tuple(inputs), tuple(params), flops, attrs, tuple(members), module)


def _op(node, kind, inputs, params, flops, attrs, members=None, module=None) -> OpNode:
    value = node.meta["val"]
    return OpNode(name=node.name, kind=kind, target=str(node.target), inputs=tuple(inputs), params=tuple(params),
                  shape=tuple(int(s) for s in value.shape), dtype=str(value.dtype).removeprefix("torch."),
                  itemsize=value.element_size(), flops=float(flops), attrs=tuple(attrs.items()),
                  module=_module_path(node) if module is None else module, members=members or (node.name,))


def _output(node, op_nodes, shapes) -> OpNode:
    results = [value for value in torch.utils._pytree.tree_leaves(node.args[0]) if isinstance(value, torch.fx.Node)]
    if len(results) != 1 or results[0].name not in op_nodes:
        raise ValueError(f"the model must return one tensor, the loss; it returns {len(results)} graph values "
                         f"({[r.name for r in results]}): wrap it to return the scalar loss")
    value = results[0]
    if math.prod(shapes[value.name]) != 1:
        raise ValueError(f"the model returns a tensor of shape {shapes[value.name]}, not a scalar loss: "
                         f"wrap it to return the loss (e.g. F.cross_entropy(logits, targets))")
    source = value.meta["val"]
    return OpNode(name=node.name, kind="output", target="output", inputs=(value.name,), params=(),
                  shape=shapes[value.name], dtype=str(source.dtype).removeprefix("torch."),
                  itemsize=source.element_size(), members=(node.name,))
