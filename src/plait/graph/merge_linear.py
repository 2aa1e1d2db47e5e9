"""merge_linear: two Linear layers with nothing between are one Linear.

    y = W2 (W1 x + b1) + b2 = (W2 W1) x + (W2 b1 + b2)        W1: (mid, in), W2: (out, mid)

FLOPs per row of x: 2·in·mid + 2·mid·out before, 2·in·out after (bias adds: mid + out
before, out after). The merge pays only when in·mid + mid·out > in·out, i.e. when

    mid > in·out / (in + out);

a bottleneck (mid below that, e.g. a low-rank factorisation 512 -> 16 -> 512) is cheaper
as two layers and is refused with the FLOP numbers. Bytes saved per forward: the (rows, mid)
intermediate written and read, plus the weights read (in·mid + mid·out + mid -> in·out).
The merged weights are computed in float64 and cast to the layers' dtype.
Refused: the first output used by anything else, either layer's weights shared.
"""

from __future__ import annotations

from torch import nn

from plait.graph.fold_bn import set_weight_bias
from plait.graph.rule import Match, Rule, calls_module, first_input, label, module_of, other_users, shared_module_reason


def linear_flops_per_row(layer: nn.Linear) -> int:
    return 2 * layer.in_features * layer.out_features + (layer.out_features if layer.bias is not None else 0)


class MergeLinear(Rule):
    """Linear -> Linear with nothing between: W = W2·W1, b = W2·b1 + b2, where FLOPs drop."""

    name = "merge_linear"

    def find(self, gm, shapes):
        matches = []
        for second in gm.graph.nodes:
            if not calls_module(gm, second, nn.Linear):
                continue
            first = first_input(second)
            if first is not None and calls_module(gm, first, nn.Linear):
                matches.append(Match(gm, shapes, (first, second), f"{label(first)} -> {label(second)}"))
        return matches

    def check(self, match):
        first, second = match.nodes
        return (other_users(first, second) or shared_module_reason(match.gm, first)
                or shared_module_reason(match.gm, second))

    def gain(self, match):
        first, second = match.nodes
        layer1, layer2 = module_of(match.gm, first), module_of(match.gm, second)
        middle = match.shapes[first]
        rows = middle.numel // layer1.out_features
        has_bias = layer1.bias is not None or layer2.bias is not None
        merged_flops = 2 * layer1.in_features * layer2.out_features + (layer2.out_features if has_bias else 0)
        flops_saved = rows * (linear_flops_per_row(layer1) + linear_flops_per_row(layer2) - merged_flops)
        weights_before = sum(p.numel() for p in (*layer1.parameters(), *layer2.parameters()))
        weights_after = layer1.in_features * layer2.out_features + (layer2.out_features if has_bias else 0)
        bytes_saved = 2 * middle.nbytes + (weights_before - weights_after) * middle.itemsize
        return flops_saved, bytes_saved

    def apply(self, gm, match):
        first, second = match.nodes
        layer1, layer2 = module_of(gm, first), module_of(gm, second)
        w1, w2 = layer1.weight.detach().double(), layer2.weight.detach().double()
        b1 = layer1.bias.detach().double() if layer1.bias is not None else w1.new_zeros(w1.shape[0])
        b2 = layer2.bias.detach().double() if layer2.bias is not None else w2.new_zeros(w2.shape[0])
        has_bias = layer1.bias is not None or layer2.bias is not None
        merged = nn.Linear(layer1.in_features, layer2.out_features, bias=has_bias,
                           device=w1.device, dtype=layer2.weight.dtype)
        set_weight_bias(merged, w2 @ w1, w2 @ b1 + b2 if has_bias else None)
        # the second call site takes the merged layer and reads the first one's input
        gm.set_submodule(second.target, merged)
        second.args = (first_input(first), *second.args[1:])
        gm.graph.erase_node(first)
