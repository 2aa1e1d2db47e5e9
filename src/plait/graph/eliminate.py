"""Nodes that compute nothing at inference: dropout in eval, nn.Identity, and a permute or
transpose followed by its inverse.

remove_dropout   nn.Dropout* modules in eval, and F.dropout* / torch.dropout calls traced
                 with training=False (or p = 0), return their input: the node is replaced
                 by its input. A dropout module in training mode (or a call with
                 training=True) is random and is refused.
remove_identity  nn.Identity returns its input: replaced by its input.
cancel_permutes  y = x.permute(p).permute(q) is x exactly when p[q[i]] = i for every i
                 (output dim i of the second is dim q[i] of the first, which is dim p[q[i]]
                 of x). transpose(a, b) is the permutation swapping a and b, .t() of a
                 2-D tensor swaps 0 and 1, so transpose(a, b).transpose(a, b) cancels too.
                 Refused when the intermediate is also used elsewhere.

None of these moves bytes or does FLOPs (a dropout in eval returns the very same tensor,
a permute is a view), so the predicted gain is (0 FLOPs, 0 bytes) and the rewrite pays by
the nodes it removes: one Python call each per forward (the engine's criterion).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from plait.graph.rule import Match, Rule, bypass, first_input, label, module_of, other_users

DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# dropout function -> its `training` default (position 2 in every signature); torch.* require it
DROPOUT_FUNCTIONS = {F.dropout: True, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True,
                     F.alpha_dropout: False, F.feature_alpha_dropout: False, torch.dropout: True,
                     torch.alpha_dropout: True, torch.feature_dropout: True, torch.feature_alpha_dropout: True}


def _dropout_training(node: fx.Node) -> bool:
    """Whether a traced dropout call was made with training on (F.* default training=True)."""
    if len(node.args) > 2:
        training = node.args[2]
    else:
        training = node.kwargs.get("training", node.kwargs.get("train", DROPOUT_FUNCTIONS[node.target]))
    probability = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    return bool(training) and probability != 0


class RemoveDropout(Rule):
    """Dropout in eval (module, or a call with training=False) returns its input: removed."""

    name = "remove_dropout"

    def find(self, gm, shapes):
        matches = []
        for node in gm.graph.nodes:
            is_module = isinstance(module_of(gm, node), DROPOUT_MODULES)
            is_call = node.op == "call_function" and node.target in DROPOUT_FUNCTIONS
            if (is_module or is_call) and first_input(node) is not None:
                matches.append(Match(gm, shapes, (node,), label(node)))
        return matches

    def check(self, match):
        (node,) = match.nodes
        if node.op == "call_module":
            module = module_of(match.gm, node)
            if module.training and module.p != 0:
                return f"{node.target} is in training mode (it zeroes random elements; call .eval())"
            return None
        if _dropout_training(node):
            return f"{node.name} is called with training=True (it zeroes random elements)"
        return None

    def apply(self, gm, match):
        (node,) = match.nodes
        bypass(gm, node, first_input(node))


class RemoveIdentity(Rule):
    """nn.Identity returns its input: removed."""

    name = "remove_identity"

    def find(self, gm, shapes):
        return [Match(gm, shapes, (node,), label(node)) for node in gm.graph.nodes
                if isinstance(module_of(gm, node), nn.Identity) and first_input(node) is not None]

    def apply(self, gm, match):
        (node,) = match.nodes
        bypass(gm, node, first_input(node))


def permutation_of(node: fx.Node, shapes) -> tuple[int, ...] | None:
    """The permutation a permute / transpose / t node applies (output dim i = input dim p[i]),
    or None if the node is none of these or its input's rank is unknown."""
    source = first_input(node)
    if source is None or source not in shapes:
        return None
    rank = len(shapes[source].shape)
    if (node.op == "call_method" and node.target == "permute") or (
            node.op == "call_function" and node.target is torch.permute):
        dims = node.args[1:] if node.op == "call_method" else node.args[1:2]
        if not dims:
            dims = (node.kwargs.get("dims"),)
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        if not all(isinstance(dim, int) for dim in dims) or len(dims) != rank:
            return None
        return tuple(dim % rank for dim in dims)
    is_transpose = (node.op == "call_method" and node.target in ("transpose", "swapaxes", "swapdims")) or (
        node.op == "call_function" and node.target in (torch.transpose, torch.swapaxes, torch.swapdims))
    if is_transpose and len(node.args) == 3 and all(isinstance(dim, int) for dim in node.args[1:]):
        first, second = (dim % rank for dim in node.args[1:])
        order = list(range(rank))
        order[first], order[second] = order[second], order[first]
        return tuple(order)
    is_t = (node.op == "call_method" and node.target == "t") or (node.op == "call_function" and node.target is torch.t)
    if is_t and len(node.args) == 1:
        return (1, 0) if rank == 2 else tuple(range(rank))
    return None


class CancelPermutes(Rule):
    """x.permute(p).permute(q) with p[q[i]] = i (also transpose(a, b) twice, .t().t()) is x: both removed."""

    name = "cancel_permutes"

    def find(self, gm, shapes):
        matches = []
        for outer in gm.graph.nodes:
            outer_order = permutation_of(outer, shapes)
            inner = first_input(outer)
            if outer_order is None or inner is None:
                continue
            inner_order = permutation_of(inner, shapes)
            if inner_order is None or len(inner_order) != len(outer_order):
                continue
            if all(inner_order[outer_order[i]] == i for i in range(len(outer_order))):
                matches.append(Match(gm, shapes, (inner, outer), f"{label(inner)} -> {label(outer)}",
                                     nodes_removed=2))
        return matches

    def check(self, match):
        inner, outer = match.nodes
        return other_users(inner, outer)

    def apply(self, gm, match):
        inner, outer = match.nodes
        bypass(gm, outer, first_input(inner))
        gm.graph.erase_node(inner)
