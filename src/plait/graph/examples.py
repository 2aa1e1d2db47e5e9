"""Example models for `plait optimize` and the graph-rewrite tests, each a function
returning ``(module in eval mode, example_inputs tuple)`` — the contract of
``plait optimize PKG.MOD:FUNCTION``.

    plait optimize plait.graph.examples:resnet18_like --bench
    plait optimize plait.graph.examples:gpt_eval --leaf plait.graph.examples:GPT_LEAF_MODULES

- ``resnet18_like``: ResNet-18's shape (a 3x3 stem, four stages of two basic blocks
  conv-BN-ReLU-conv-BN + residual add, 1x1 conv + BN downsampling, global average pool,
  fc) at small widths and 32x32 inputs. Folds: every conv + BN (20 of them).
- ``mobilenet_like``: MobileNet-v1-style depthwise-separable blocks (3x3 depthwise
  conv + BN + ReLU6, then 1x1 pointwise conv + BN + ReLU), and a head
  Linear -> BatchNorm1d -> ReLU -> Dropout -> Identity -> Linear -> Linear.
- ``gpt_eval``: plait's GPT in eval behind a wrapper that fixes the sequence length
  (GPT.forward checks the token shape in Python, which torch.fx cannot trace); its
  token embedding and transformer blocks must be leaves (``GPT_LEAF_MODULES``).
- ``conv_bn_shared``: pytorch#104593: ``y = conv(x); return bn(y) + y``. The conv's
  output feeds the BN AND the add, so folding the BN into the conv would change the add's
  input: it must not fold. torch 2.13's torch.fx.experimental.optimization.fuse now skips
  it (it checks the conv's users); torch.ao.quantization.fuse_modules, given the names
  ["conv", "bn"], folds it and is wrong.
- ``conv_called_twice``: one conv module called at two sites, BN after only one:
  ``bn(conv(x)) + conv(2x)``. torch.fx.experimental.optimization.fuse replaces the conv
  module itself, so the second call gets the BN too: wrong (relative error ~0.26).

BatchNorm statistics and affine parameters are drawn at random (seeded), not left at
their initial mean 0 / var 1 / γ 1 / β 0, so that a wrong fold shows in the outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.models.gpt import GPT, GPTConfig, TransformerBlock
from plait.parallel.tensor import VocabParallelEmbedding

SEED = 0
IMAGE_SIZE = 32  # pixels per side of the example images
RESNET_WIDTHS = (8, 16, 32, 64)  # channels of the four stages (ResNet-18 has 64..512)
MOBILENET_WIDTHS = (16, 32, 64, 128)  # output channels of the stem and the three separable blocks
CLASSES = 10
GPT_CONFIG = GPTConfig(layers=2, hidden=32, heads=2, seq_len=16, vocab=64)
# the GPT modules torch.fx must not trace into (Python checks of token dtype, attention core)
GPT_LEAF_MODULES = (VocabParallelEmbedding, TransformerBlock)


def randomize_batchnorm(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """Give every BatchNorm running mean ~ N(0, 0.1²), running var ~ U(0.5, 1.5),
    weight γ ~ U(0.5, 1.5), bias β ~ N(0, 0.1²): statistics a trained net could have."""
    for norm in module.modules():
        if isinstance(norm, nn.modules.batchnorm._BatchNorm):
            channels = norm.num_features
            with torch.no_grad():
                if norm.track_running_stats:
                    norm.running_mean.copy_(0.1 * torch.randn(channels, generator=generator))
                    norm.running_var.copy_(0.5 + torch.rand(channels, generator=generator))
                if norm.affine:
                    norm.weight.copy_(0.5 + torch.rand(channels, generator=generator))
                    norm.bias.copy_(0.1 * torch.randn(channels, generator=generator))
    return module


def conv_bn(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1
            ) -> nn.Sequential:
    """Conv2d (no bias, 'same'-style padding) then BatchNorm2d: the pair fold_conv_bn folds."""
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, kernel_size, stride, kernel_size // 2,
                                   groups=groups, bias=False),
                         nn.BatchNorm2d(out_channels))


class BasicBlock(nn.Module):
    """ResNet basic block: relu(bn2(conv2(relu(bn1(conv1 x)))) + shortcut(x)), the shortcut
    a 1x1 conv + BN where the stride or width changes, else the identity."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = (conv_bn(in_channels, out_channels, 1, stride)
                           if stride != 1 or in_channels != out_channels else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class ResNet18Like(nn.Module):
    """ResNet-18's layout (stem, 4 stages x 2 basic blocks, avgpool, fc) at ``widths``."""

    def __init__(self, widths: tuple[int, ...] = RESNET_WIDTHS, classes: int = CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)  # CIFAR-style stem for 32x32 inputs
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        stages, in_channels = [], widths[0]
        for index, width in enumerate(widths):
            stride = 1 if index == 0 else 2
            stages.append(nn.Sequential(BasicBlock(in_channels, width, stride), BasicBlock(width, width, 1)))
            in_channels = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, 3, 32, 32) -> (b, classes)
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class MobileNetLike(nn.Module):
    """MobileNet-v1-style: stem conv-BN-ReLU6, depthwise-separable blocks (depthwise 3x3
    conv-BN-ReLU6, pointwise 1x1 conv-BN-ReLU), then a head with a Linear + BatchNorm1d
    (fold_linear_bn), dropout and an identity (removed in eval) and two linears with
    nothing between (merge_linear: 128 -> 64 -> 10 is not a bottleneck, 64 > 128·10/138)."""

    def __init__(self, widths: tuple[int, ...] = MOBILENET_WIDTHS, classes: int = CLASSES):
        super().__init__()
        layers: list[nn.Module] = [*conv_bn(3, widths[0], 3, 2), nn.ReLU6()]
        for in_channels, out_channels in zip(widths, widths[1:]):
            layers += [*conv_bn(in_channels, in_channels, 3, 2, groups=in_channels), nn.ReLU6(),
                       *conv_bn(in_channels, out_channels, 1), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(widths[-1], widths[-1]), nn.BatchNorm1d(widths[-1]),
                                  nn.ReLU(), nn.Dropout(0.2), nn.Identity(),
                                  nn.Linear(widths[-1], widths[-1] // 2), nn.Linear(widths[-1] // 2, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, 3, 32, 32) -> (b, classes)
        return self.head(self.pool(self.features(x)))


class GPTEval(nn.Module):
    """plait's GPT forward at a fixed sequence length: embedding + positions, the blocks,
    the final LayerNorm and the tied head. Same outputs as ``GPT.forward`` (tp = 1), but
    the sequence length is a Python int, so torch.fx can trace it (with the blocks and
    the embedding as leaves: ``GPT_LEAF_MODULES``). ``position[:s].unsqueeze(1)`` reads
    only a parameter: a fold_constants candidate."""

    def __init__(self, gpt: GPT, sequence: int):
        super().__init__()
        if not 0 < sequence <= gpt.config.seq_len:
            raise ValueError(f"sequence={sequence} must be in [1, seq_len={gpt.config.seq_len}]")
        self.gpt, self.sequence = gpt, sequence

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (b, s) int -> (b, s, vocab)
        x = self.gpt.embedding(tokens.t()) + self.gpt.position[:self.sequence].unsqueeze(1)  # (s, b, h)
        for block in self.gpt.blocks:
            x = block(x, self.sequence)
        return self.gpt.logits(x)


def resnet18_like(batch: int = 2, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A ResNet-18-shaped network in eval and a (batch, 3, 32, 32) input."""
    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    model = randomize_batchnorm(ResNet18Like(), generator).to(dtype).eval()
    return model, (torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=dtype),)


def mobilenet_like(batch: int = 2, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A MobileNet-style depthwise-separable network in eval and a (batch, 3, 32, 32) input."""
    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    model = randomize_batchnorm(MobileNetLike(), generator).to(dtype).eval()
    return model, (torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=dtype),)


def gpt_eval(batch: int = 2, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """plait's GPT (GPT_CONFIG) in eval behind GPTEval, and (batch, seq_len) tokens.
    Trace it with ``leaf_modules=GPT_LEAF_MODULES``."""
    config = GPTConfig(**{**GPT_CONFIG.__dict__, "dtype": str(dtype).removeprefix("torch.")})
    model = GPTEval(GPT(config, seed=SEED), config.seq_len).eval()
    generator = torch.Generator().manual_seed(SEED)
    return model, (torch.randint(0, config.vocab, (batch, config.seq_len), generator=generator),)


class ConvBNShared(nn.Module):
    """pytorch#104593: the conv's output is used by the BN and by the add."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)  # (b, c, h, w), read twice below
        return self.bn(y) + y


def conv_bn_shared(batch: int = 2, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The pytorch#104593 case in eval (a fold would be wrong) and a (batch, 3, 16, 16) input."""
    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    model = randomize_batchnorm(ConvBNShared(), generator).to(dtype).eval()
    return model, (torch.randn(batch, 3, 16, 16, generator=generator, dtype=dtype),)


class ConvCalledTwice(nn.Module):
    """One conv at two call sites, the BN after only the first (its weight is shared)."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) + self.conv(2 * x)


def conv_called_twice(batch: int = 2, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A conv called at two sites, BN after one (fx's fuse folds it: wrong), and a (batch, 3, 16, 16) input."""
    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    model = randomize_batchnorm(ConvCalledTwice(), generator).to(dtype).eval()
    return model, (torch.randn(batch, 3, 16, 16, generator=generator, dtype=dtype),)


EXAMPLES = {"resnet18_like": resnet18_like, "mobilenet_like": mobilenet_like, "gpt_eval": gpt_eval,
            "conv_bn_shared": conv_bn_shared, "conv_called_twice": conv_called_twice}
