"""inplace_relu: a ReLU whose input is a fresh tensor nobody else reads runs in place.

This is plait's "conv/linear + bias + ReLU fusion" on eager CPU. PyTorch's eager CPU
backend has no fused conv+ReLU (or linear+ReLU) kernel to call: conv and bias already run
as one oneDNN/BLAS call, and the ReLU is a second pass over the output either way. What can
be saved is the ReLU's output allocation: ``torch.relu_`` overwrites the conv's output
instead of writing a new tensor of the same size. Predicted gain: 0 FLOPs, and the N·itemsize
bytes of the new output (memory allocated and first-touched) that disappear.

Applied to nn.ReLU / nn.ReLU6 modules (the node is rewritten, the module itself is left
alone because it may be shared), F.relu / torch.relu / F.relu6 and ``x.relu()``. Refused
when the input is a graph input or a parameter/buffer (in place would modify the caller's
tensor or the weights), is also read by another node (it would see the ReLU'd values), or
comes from an op not known to return a fresh tensor: in place on a view would overwrite
the tensor it views. Known fresh producers: conv, linear, normalisation and pooling modules
and functions, and out-of-place arithmetic.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from plait.graph.rule import Match, Rule, bypass, first_input, label, module_of, other_users

RELU_MODULES = (nn.ReLU, nn.ReLU6)
RELU_FUNCTIONS = (F.relu, torch.relu, F.relu6)
FRESH_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                 nn.Linear, nn.Bilinear, nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
                 nn.modules.instancenorm._InstanceNorm, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
                 nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                 nn.AdaptiveAvgPool3d, nn.Embedding)
FRESH_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.matmul, operator.neg,
                   torch.add, torch.sub, torch.mul, torch.div, torch.matmul, torch.mm, torch.bmm, torch.cat,
                   torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d, F.linear,
                   F.batch_norm, F.layer_norm, F.group_norm, F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d}
FRESH_METHODS = {"add", "sub", "mul", "div", "matmul", "mm", "bmm", "neg"}


def is_relu(gm, node) -> bool:
    module = module_of(gm, node)
    if module is not None:
        return isinstance(module, RELU_MODULES) and not module.inplace
    if node.op == "call_function" and node.target in RELU_FUNCTIONS:
        return not node.kwargs.get("inplace", False) and not (len(node.args) > 1 and node.args[1] is True)
    return node.op == "call_method" and node.target == "relu"


def is_relu6(gm, node) -> bool:
    return isinstance(module_of(gm, node), nn.ReLU6) or (node.op == "call_function" and node.target is F.relu6)


def is_fresh(gm, node) -> bool:
    if node.op == "call_module":
        return isinstance(module_of(gm, node), FRESH_MODULES)
    if node.op == "call_function":
        return node.target in FRESH_FUNCTIONS
    return node.op == "call_method" and node.target in FRESH_METHODS


class InplaceRelu(Rule):
    """ReLU on a fresh tensor with no other reader runs in place (saves the output allocation)."""

    name = "inplace_relu"

    def find(self, gm, shapes):
        matches = []
        for node in gm.graph.nodes:
            producer = first_input(node)
            if producer is not None and is_relu(gm, node):
                matches.append(Match(gm, shapes, (producer, node), f"{label(producer)} -> {label(node)}",
                                     nodes_removed=0))
        return matches

    def check(self, match):
        producer, relu = match.nodes
        if producer.op == "placeholder":
            return f"{label(relu)}'s input {producer.name} is a graph input (in place would modify the caller's tensor)"
        if producer.op == "get_attr":
            return f"{label(relu)}'s input {producer.target} is a parameter/buffer (in place would modify it)"
        reason = other_users(producer, relu)
        if reason:
            return reason
        if not is_fresh(match.gm, producer):
            kind = type(module_of(match.gm, producer)).__name__ if producer.op == "call_module" else producer.target
            return (f"{label(relu)}'s input comes from {label(producer)} ({getattr(kind, '__name__', kind)}), "
                    f"not a conv/linear or another op known to return a fresh tensor "
                    f"(in place could overwrite a tensor it views)")
        return None

    def gain(self, match):
        producer, relu = match.nodes
        return 0.0, float(match.shapes[relu].nbytes) if relu in match.shapes else 0.0

    def apply(self, gm, match):
        producer, relu = match.nodes
        with gm.graph.inserting_before(relu):
            if is_relu6(gm, relu):
                inplace = gm.graph.call_function(F.relu6, (producer,), {"inplace": True})
            else:
                inplace = gm.graph.call_function(torch.relu_, (producer,))
        bypass(gm, relu, inplace)
