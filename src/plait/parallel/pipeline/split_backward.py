"""The two halves of a split backward (zero bubble) without doing B's work twice.

B computes the stage input's gradient now (it is on the critical path); W computes
the weight gradients later. W as a plain backward from the stage output to the
parameters walks the whole graph again: for a chain of L Linear layers it redoes
the L-1 activation gradients dX = dY·W that B already made (one matmul per layer
of the two a layer's backward costs: 50% more backward work).

Instead B finds the *input path* (the autograd nodes from which the stage input's
gradient accumulator is reachable) and, on it, every *boundary* node: one with a
child off the path that leads to parameters (a *weight branch*: for a Linear, its
AddmmBackward, whose weight and bias branches lead to the weight and bias). A
pre-hook captures the gradients flowing into each boundary node while B runs. W
then replays each boundary node alone, from its captured gradients, with only the
parameters behind its weight branches as inputs: autograd runs just the
weight-gradient work (dW = dYᵀX, db = Σ dY), each node once, and the results are
the same floating-point operations on the same values as the plain W.

Each parameter contribution leaves the input path through exactly one boundary
edge, so the replays count each once, unless a node's weight branches and its
input-path children reach a common parameter (a weight used twice along the path):
then, and whenever a boundary node did not run in B, W falls back to the plain
backward. The captured gradients (one per boundary node output, the size of a
layer's output) are held from B to W, beside the graph both ways keep.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


class DeferredWeights:
    """What B leaves for W: per boundary node, its parameters and captured gradients."""

    __slots__ = ("nodes", "params", "grads")

    def __init__(self, nodes, params):
        self.nodes, self.params = nodes, params
        self.grads: list = [None] * len(nodes)

    def complete(self) -> bool:
        return all(grads is not None for grads in self.grads)


def boundary_plan(roots, targets, params: list[torch.Tensor]):
    """(boundary nodes, the parameters behind each one's weight branches) of the
    graph under ``roots`` (one node or a list: a stage's outputs) for the inputs whose
    accumulator nodes are ``targets`` (one node or a set); None when W must be a plain
    backward (see the module docstring). Parameter sets are bit masks (bit i:
    ``params[i]``): one pass over the graph, children read once."""
    roots = list(roots) if isinstance(roots, (list, tuple)) else [roots]
    targets = set(targets) if isinstance(targets, (set, frozenset, list, tuple)) else {targets}
    if any(root is None for root in roots):
        return None  # an output that is an input passed through: nothing to replay for it
    bit_of = {id(param): 1 << index for index, param in enumerate(params)}
    reaches: dict = {}  # node -> does it reach the input
    masks: dict = {}  # node -> parameters it reaches
    children_of: dict = {}
    stack = list(roots)
    while stack:
        node = stack[-1]
        if node in reaches:
            stack.pop()
            continue
        children = children_of.get(node)
        if children is None:
            children = children_of[node] = [child for child, _ in node.next_functions if child is not None]
            pending = [child for child in children if child not in reaches]
            if pending:
                stack.extend(pending)
                continue
        stack.pop()
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            reaches[node], masks[node] = node in targets, bit_of.get(id(variable), 0)
        else:
            reach, mask = False, 0
            for child in children:
                reach = reach or reaches[child]
                mask |= masks[child]
            reaches[node], masks[node] = reach, mask
    if not any(reaches[root] for root in roots):
        return None  # the output does not depend on the input: B has nothing to capture
    nodes, node_params = [], []
    for node in reaches:  # finished children first: the layers nearest the input first
        children = children_of[node]
        if not reaches[node] or not children:
            continue
        behind = on_path = 0
        for child in children:
            if reaches[child]:
                on_path |= masks[child]
            else:
                behind |= masks[child]
        if not behind:
            continue
        if behind & on_path:
            return None  # replaying this node would count the path's use of a weight twice
        nodes.append(node)
        node_params.append([param for index, param in enumerate(params) if behind >> index & 1])
    return nodes, node_params


def input_backward(out, grad, stage_input, params: list[torch.Tensor]):
    """B: accumulate the stage input's gradient; return what W needs (None: W runs
    the plain backward). ``out``/``grad``/``stage_input``: a tensor each, or lists (a
    stage whose boundaries are several tensors)."""
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    inputs = list(stage_input) if isinstance(stage_input, (list, tuple)) else [stage_input]
    plan = boundary_plan([o.grad_fn for o in outs], {get_gradient_edge(i).node for i in inputs},
                         params) if params else None
    deferred = None if plan is None else DeferredWeights(*plan)
    handles = []
    if deferred is not None:
        for index, node in enumerate(deferred.nodes):
            handles.append(node.register_prehook(_capture(deferred.grads, index)))
    try:
        torch.autograd.backward(out, grad, inputs=inputs, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return deferred if deferred is not None and deferred.complete() else None


def _capture(slots: list, index: int):
    def hook(grad_outputs):
        slots[index] = grad_outputs
    return hook


def weight_backward(out: torch.Tensor, grad, deferred: DeferredWeights | None, params: list[torch.Tensor]) -> None:
    """W: accumulate the parameters' gradients (from B's captures when it left them)."""
    if deferred is None:
        torch.autograd.backward(out, grad, inputs=params)
        return
    for node, node_params, grads in zip(deferred.nodes, deferred.params, deferred.grads):
        edges = [(GradientEdge(node, index), value) for index, value in enumerate(grads) if value is not None]
        if edges:
            torch.autograd.backward([edge for edge, _ in edges], [value for _, value in edges], inputs=node_params,
                                    retain_graph=True)
