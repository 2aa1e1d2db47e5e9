"""fold_constants: a computation whose inputs are only parameters and buffers (get_attr
nodes) gives the same tensor every forward; compute it once and store it as a buffer.

Examples: ``self.weight.t()``, ``self.scale * 2``, ``self.a @ self.b``. One node is folded per
application (its inputs all get_attr); the fixed point folds whole chains, since the folded
node becomes a get_attr itself. Deterministic, out-of-place operations only: random ones
(rand*, dropout, bernoulli, normal, multinomial, poisson) and in-place ones (names ending in
``_``, setitem) are never matches.

The stored value is a snapshot of the parameters at optimize time: the optimized module is
for inference, and training it would not update the folded buffer (it has no gradient path
to the parameters).

Predicted gain per forward: a view (t, transpose, reshape, ...) saves nothing but its call;
any other op saves its FLOPs (one per output element; 2·m·k·n for a matmul) and its bytes
(inputs read + output written).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from plait.graph.rule import Match, Rule, bypass, label

RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "multinomial", "poisson", "uniform", "exponential")
VIEW_NAMES = {"t", "transpose", "permute", "view", "reshape", "expand", "expand_as", "unsqueeze", "squeeze",
              "flatten", "unflatten", "narrow", "select", "getitem", "detach", "view_as", "swapaxes",
              "swapdims", "movedim", "chunk", "split", "unbind", "T", "mT"}
MATMUL_NAMES = {"matmul", "mm", "bmm", "mv", "matmul_"}


def _target_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def is_foldable_op(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    name = _target_name(node)
    if node.target is operator.setitem or (name.endswith("_") and not name.startswith("__")):
        return False
    return not any(word in name.lower() for word in RANDOM_WORDS)


def _attribute(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def evaluate(gm: fx.GraphModule, node: fx.Node):
    """Run one node whose inputs are get_attr nodes, on the attributes' current values."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda arg: _attribute(gm, arg.target))
    with torch.no_grad():
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)


class FoldConstants(Rule):
    """A node computed only from parameters/buffers is computed once and stored as a buffer (a snapshot)."""

    name = "fold_constants"

    def find(self, gm, shapes):
        return [Match(gm, shapes, (node,), label(node)) for node in gm.graph.nodes
                if is_foldable_op(node) and node in shapes and node.all_input_nodes
                and all(source.op == "get_attr" for source in node.all_input_nodes)]

    def gain(self, match):
        (node,) = match.nodes
        name = _target_name(node)
        if name in VIEW_NAMES:
            return 0.0, 0.0
        output = match.shapes[node]
        inputs = [match.shapes[source] for source in node.all_input_nodes if source in match.shapes]
        if name in MATMUL_NAMES or node.target is operator.matmul:
            inner = inputs[0].shape[-1] if inputs and inputs[0].shape else 1
            flops = 2 * output.numel * inner
        else:
            flops = output.numel
        return float(flops), float(output.nbytes + sum(shape.nbytes for shape in inputs))

    def apply(self, gm, match):
        (node,) = match.nodes
        value = evaluate(gm, node).detach().clone()
        buffer_name, suffix = f"folded_{node.name}", 0
        while hasattr(gm, buffer_name):
            suffix += 1
            buffer_name = f"folded_{node.name}_{suffix}"
        gm.register_buffer(buffer_name, value)
        sources = node.all_input_nodes
        with gm.graph.inserting_before(node):
            folded = gm.graph.get_attr(buffer_name)
        bypass(gm, node, folded)
        for source in sources:
            if not source.users:
                gm.graph.erase_node(source)
