"""Models the graph-rewrite tests run: the whole networks (ResNet-18-shaped, MobileNet-style,
plait's GPT in eval, the pytorch#104593 case, from plait.graph.examples, which `plait optimize`
shows users too) and one small module per rule pattern and per precondition.

Every BatchNorm gets random statistics and affine parameters (randomize_batchnorm), so a
fold that got the algebra wrong changes the outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.graph.examples import (GPT_LEAF_MODULES, conv_bn_shared, conv_called_twice, gpt_eval, mobilenet_like,
                                  randomize_batchnorm, resnet18_like)

__all__ = ["GPT_LEAF_MODULES", "conv_bn_shared", "conv_called_twice", "gpt_eval", "mobilenet_like",
           "resnet18_like", "prepare", "relative_error", "TOLERANCE"]

# ‖out − ref‖/‖ref‖ allowed after a rewrite. A rewrite computes new weights in float64 and
# rounds them once to the model's dtype, and reorders a few sums: the error is a few units
# of the dtype's rounding (2^-53 ≈ 1.1e-16, 2^-24 ≈ 6e-8) times a modest growth through the
# layers, far below these bounds; a wrong formula (a missing eps, a wrong channel) is ~1e-3
# or more.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def prepare(module: nn.Module, dtype: torch.dtype, seed: int = 0, train: bool = False) -> nn.Module:
    """Random BatchNorm statistics, the dtype, and eval mode (or train mode)."""
    generator = torch.Generator().manual_seed(seed)
    randomize_batchnorm(module, generator)
    # a larger spread than examples' N(0, 0.1²) means: a fold that drops μ shows clearly
    for norm in module.modules():
        if isinstance(norm, nn.modules.batchnorm._BatchNorm) and norm.track_running_stats:
            with torch.no_grad():
                norm.running_mean.add_(torch.randn(norm.num_features, generator=generator))
                norm.running_var.mul_(0.05 + 2 * torch.rand(norm.num_features, generator=generator))
    return module.to(dtype).train(train)


class ConvBn(nn.Module):
    """conv -> bn -> relu with any conv: the fold_conv_bn pattern."""

    def __init__(self, conv: nn.Module, bn: nn.Module):
        super().__init__()
        self.conv, self.bn = conv, bn

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class BnConv(nn.Module):
    """bn -> conv: the fold_bn_conv pattern."""

    def __init__(self, bn: nn.Module, conv: nn.Module):
        super().__init__()
        self.bn, self.conv = bn, conv

    def forward(self, x):
        return self.conv(self.bn(x))


class BnUsedTwice(nn.Module):
    def __init__(self, channels: int = 4):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, channels, 3)

    def forward(self, x):
        y = self.bn(x)
        return self.conv(y) + y[:, :, 1:-1, 1:-1]


class TiedConvs(nn.Module):
    """conv_a -> bn, conv_b shares conv_a's weight (tied parameters)."""

    def __init__(self):
        super().__init__()
        self.conv_a = nn.Conv2d(3, 4, 3, padding=1)
        self.conv_b = nn.Conv2d(3, 4, 3, padding=1)
        self.conv_b.weight = self.conv_a.weight
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv_a(x)) + self.conv_b(x)


class LinearBn(nn.Module):
    def __init__(self, features_in: int = 6, features_out: int = 5, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(features_in, features_out, bias=bias)
        self.bn = nn.BatchNorm1d(features_out)

    def forward(self, x):
        return self.bn(self.linear(x))


class TwoLinears(nn.Module):
    """Linear(in -> mid) -> Linear(mid -> out), nothing between."""

    def __init__(self, features_in: int, middle: int, features_out: int, bias1: bool = True, bias2: bool = True):
        super().__init__()
        self.first = nn.Linear(features_in, middle, bias=bias1)
        self.second = nn.Linear(middle, features_out, bias=bias2)

    def forward(self, x):
        return self.second(self.first(x))


class TwoLinearsShared(TwoLinears):
    def forward(self, x):
        hidden = self.first(x)
        return self.second(hidden) + hidden.sum(-1, keepdim=True)


class LinearsAroundDropout(nn.Module):
    """Linear -> Dropout -> Linear: merge_linear fires only once the dropout is gone."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.5)
        self.second = nn.Linear(32, 8)

    def forward(self, x):
        return self.second(self.drop(self.first(x)))


class FunctionalDropout(nn.Module):
    def __init__(self, training: bool):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.dropout_training = training

    def forward(self, x):
        return F.dropout(self.linear(x), 0.3, training=self.dropout_training) * 2


class WithIdentity(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.keep = nn.Identity()

    def forward(self, x):
        return self.keep(self.linear(x)) + 1


class ParameterArithmetic(nn.Module):
    """Computations on parameters only: weight.t(), scale * 2 + 1, a @ b."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 6))
        self.scale = nn.Parameter(torch.rand(5) + 0.5)
        self.left = nn.Parameter(torch.randn(5, 3))
        self.right = nn.Parameter(torch.randn(3, 5))

    def forward(self, x):  # (b, 6) -> (b, 5)
        y = x @ self.weight.t()
        return y * (self.scale * 2 + 1) + y @ (self.left @ self.right)


class RandomParameterNoise(nn.Module):
    """A parameter-only computation that is random: must never be folded."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x + torch.randn_like(self.weight)


class Permutes(nn.Module):
    """permute then its inverse; transpose twice; a pair that does not cancel."""

    def forward(self, x):  # (a, b, c)
        cancelled = x.permute(2, 0, 1).permute(1, 2, 0)
        swapped = torch.transpose(x.transpose(0, 2), 2, 0)
        kept = x.permute(1, 0, 2).permute(0, 2, 1)  # (b, c, a): not the identity
        return cancelled + swapped + kept.sum()


class PermuteUsedTwice(nn.Module):
    def forward(self, x):
        inner = x.permute(0, 2, 1)
        return inner.permute(0, 2, 1) + inner.sum()


class ReluKinds(nn.Module):
    """relu after a conv (module), after a linear (F.relu), after an add (method)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):  # (b, 3, 6, 6)
        y = self.relu(self.conv(x))  # (b, 4, 4, 4)
        z = F.relu(self.linear(y.mean((2, 3))))  # (b, 4)
        return (z + 1).relu()


class ReluRefusals(nn.Module):
    """relu of the graph input, of a tensor also used elsewhere, of a view of a tensor also
    used elsewhere (the view's only reader is the relu, but in place would change g too)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):  # (b, 4)
        a = torch.relu(x)
        h = self.linear(x)
        b = torch.relu(h) + h
        g = self.linear(a)
        c = torch.relu(g.view(-1))
        return a.sum() + b.sum() + c.sum() * g.sum()


class DataDependentControlFlow(nn.Module):
    """Python `if` on a tensor's value: torch.fx cannot trace it."""

    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


class HasUntraceableBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = DataDependentControlFlow()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.block(self.bn(self.conv(x)))
