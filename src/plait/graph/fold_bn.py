"""BatchNorm folding: an eval-mode BatchNorm is an affine map per channel, so it folds
into the convolution or linear layer next to it.

In eval, BatchNorm computes per channel c, with σ_c = sqrt(running_var_c + eps):

    y = (x − μ_c)·γ_c/σ_c + β_c = s_c·x + t_c,     s = γ/σ,  t = β − μ·s

(γ = 1, β = 0 without affine). Three rules fold it:

fold_conv_bn   Conv{1,2,3}d -> BN: scale each OUTPUT channel o of the conv:
                   W'[o] = W[o]·s_o,   b'_o = (b_o − μ_o)·s_o + β_o
               exact for any stride, padding, dilation or groups (depthwise included): BN
               acts per output channel, after everything the conv does.
fold_linear_bn Linear -> BatchNorm1d on (N, features): the same with o an output feature.
fold_bn_conv   BN -> Conv{1,2,3}d: fold into the FOLLOWING conv's INPUT channels c:
                   W'[o, c] = W[o, c]·s_c,   b'_o = b_o + Σ_{c,k} W[o, c, k]·t_c
               exact only when the conv does not pad (the original pads the BN's output
               with zeros that the folded conv would see as x = 0, i.e. as t_c) and is not
               grouped (then input channel c of W[o] is not channel c of the BN).

The new weights are computed in float64 and cast to the layer's dtype, so float32 models
lose at most one rounding per weight. Refused: BN in training mode (it normalises by the
batch), BN without running statistics (track_running_stats=False: batch statistics even in
eval), the layer's output (or the BN's) used by anything else (pytorch#104593: folding
would change that use; torch.ao.quantization.fuse_modules still does so in torch 2.13),
the layer's weights shared (tied parameters
or one module called at several places). Predicted gain per forward: the BN's 2 FLOPs per
element (a multiply and an add) and its N elements read and N written, less one add per
element where the layer had no bias and now has one.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from plait.graph.rule import (Match, Rule, bypass, calls_module, first_input, label, module_of,
                              other_users, shared_module_reason)

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def bn_scale_shift(bn: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, t) in float64 with BN(x) = s·x + t per channel (eval mode, running statistics)."""
    sigma = torch.sqrt(bn.running_var.double() + bn.eps)
    gamma = bn.weight.double() if bn.weight is not None else torch.ones_like(sigma)
    beta = bn.bias.double() if bn.bias is not None else torch.zeros_like(sigma)
    scale = gamma / sigma
    return scale, beta - bn.running_mean.double() * scale


def bn_reason(bn: _BatchNorm, name: str) -> str | None:
    if bn.training:
        return f"{name} is in training mode (it normalises by the batch's statistics; call .eval())"
    if bn.running_mean is None or bn.running_var is None:
        return f"{name} has no running statistics (track_running_stats=False: it uses batch statistics in eval)"
    return None


def set_weight_bias(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Replace a layer's weight and bias (None: no bias) by new float64 values cast to its dtype."""
    dtype, requires_grad = layer.weight.dtype, layer.weight.requires_grad
    layer.weight = nn.Parameter(weight.to(dtype), requires_grad=requires_grad)
    layer.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=requires_grad)


def bn_gain(match: Match, bn_node: fx.Node, layer_node: fx.Node, layer: nn.Module) -> tuple[float, float]:
    """The BN's 2 FLOPs per element, its N elements read + N written and its 4 per-channel
    vectors read; less, where the layer had no bias, one add per output element and the
    bias vector read."""
    bn_out, layer_out = match.shapes[bn_node], match.shapes[layer_node]
    channels = bn_out.shape[1] if len(bn_out.shape) > 1 else 1
    new_bias = layer.bias is None
    flops_saved = 2 * bn_out.numel - (layer_out.numel if new_bias else 0)
    bytes_saved = 2 * bn_out.nbytes + (4 - (1 if new_bias else 0)) * channels * bn_out.itemsize
    return flops_saved, bytes_saved


class _LayerThenBn(Rule):
    """layer -> BN folding (the shared part of fold_conv_bn and fold_linear_bn)."""

    layer_types: tuple[type, ...] = ()

    def find(self, gm, shapes):
        matches = []
        for bn_node in gm.graph.nodes:
            if not calls_module(gm, bn_node, _BatchNorm):
                continue
            layer_node = first_input(bn_node)
            if layer_node is not None and calls_module(gm, layer_node, self.layer_types):
                matches.append(Match(gm, shapes, (layer_node, bn_node),
                                     f"{label(layer_node)} -> {label(bn_node)}"))
        return matches

    def check(self, match):
        layer_node, bn_node = match.nodes
        gm = match.gm
        return (bn_reason(module_of(gm, bn_node), bn_node.target)
                or other_users(layer_node, bn_node)
                or shared_module_reason(gm, layer_node)
                or self.layout_reason(match))

    def layout_reason(self, match) -> str | None:
        return None

    def gain(self, match):
        layer_node, bn_node = match.nodes
        return bn_gain(match, bn_node, layer_node, module_of(match.gm, layer_node))

    def apply(self, gm, match):
        layer_node, bn_node = match.nodes
        layer, bn = module_of(gm, layer_node), module_of(gm, bn_node)
        scale, shift = bn_scale_shift(bn)
        weight = layer.weight.detach().double()
        bias = layer.bias.detach().double() if layer.bias is not None else torch.zeros_like(scale)
        per_out = scale.reshape(-1, *([1] * (weight.dim() - 1)))
        set_weight_bias(layer, weight * per_out, bias * scale + shift)
        bypass(gm, bn_node, layer_node)


class FoldConvBn(_LayerThenBn):
    """Conv{1,2,3}d -> BatchNorm (eval): W' = W·γ/σ per output channel, b' = (b − μ)·γ/σ + β."""

    name = "fold_conv_bn"
    layer_types = CONV_TYPES


class FoldLinearBn(_LayerThenBn):
    """Linear -> BatchNorm1d (eval) on (N, features): W' = W·γ/σ per output feature, b' = (b − μ)·γ/σ + β."""

    name = "fold_linear_bn"
    layer_types = (nn.Linear,)

    def layout_reason(self, match):
        layer_node = match.nodes[0]
        shape = match.shapes.get(layer_node)
        if shape is None or len(shape.shape) != 2:
            return (f"{label(layer_node)}'s output has shape {None if shape is None else shape.shape}: "
                    f"BatchNorm1d normalises dim 1, which is the linear's features only for (N, features)")
        return None


class FoldBnConv(Rule):
    """BatchNorm (eval) -> Conv{1,2,3}d without padding or groups: fold the BN into the conv's
    input channels, W' = W·s_c, b' = b + Σ W·t_c."""

    name = "fold_bn_conv"

    def find(self, gm, shapes):
        matches = []
        for conv_node in gm.graph.nodes:
            if not calls_module(gm, conv_node, CONV_TYPES):
                continue
            bn_node = first_input(conv_node)
            if bn_node is not None and calls_module(gm, bn_node, _BatchNorm):
                matches.append(Match(gm, shapes, (bn_node, conv_node),
                                     f"{label(bn_node)} -> {label(conv_node)}"))
        return matches

    def check(self, match):
        bn_node, conv_node = match.nodes
        gm = match.gm
        conv = module_of(gm, conv_node)
        reason = bn_reason(module_of(gm, bn_node), bn_node.target) or other_users(bn_node, conv_node)
        if reason:
            return reason
        if conv.padding == "same" or any(conv.padding if conv.padding != "valid" else ()):
            return (f"{conv_node.target} is padded (padding={conv.padding}): its zero padding comes after "
                    f"{bn_node.target} in the original, which the folded conv would not reproduce")
        if conv.groups != 1:
            return (f"{conv_node.target} is grouped (groups={conv.groups}): only an ungrouped conv sees every "
                    f"BN channel in every output channel")
        return shared_module_reason(gm, conv_node)

    def gain(self, match):
        bn_node, conv_node = match.nodes
        return bn_gain(match, bn_node, conv_node, module_of(match.gm, conv_node))

    def apply(self, gm, match):
        bn_node, conv_node = match.nodes
        conv, bn = module_of(gm, conv_node), module_of(gm, bn_node)
        scale, shift = bn_scale_shift(bn)
        weight = conv.weight.detach().double()  # (out, in, *kernel)
        bias = conv.bias.detach().double() if conv.bias is not None else weight.new_zeros(weight.shape[0])
        per_in = [1, -1] + [1] * (weight.dim() - 2)
        new_bias = bias + (weight * shift.reshape(per_in)).sum(dim=tuple(range(1, weight.dim())))
        set_weight_bias(conv, weight * scale.reshape(per_in), new_bias)
        bypass(gm, bn_node, first_input(bn_node))
