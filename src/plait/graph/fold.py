"""FoldedCNN (Kosaian, Phanishayee, Philipose, Dey, Vinayak, ICML 2021): f images folded into
one input of f·C channels, internal widths × √f, output f × classes.

Folding. A batch of N images (N, C, H, W) becomes N/f inputs of f·C channels: image j of a
group of f occupies channels j·C … (j+1)·C − 1. The folded network's last Linear has f·k
outputs; image j's logits are outputs j·k … (j+1)·k − 1, so the wrapper returns (N, k) and
the loss stays per image. N not a multiple of f is padded with zero images (a warning says
how many); their logits are dropped.

Widths. Every Conv2d's out_channels w and every hidden Linear's out_features w become
round(w·√f) (nearest integer, halves up: ``floor(w·√f + 1/2)``); the first conv's
in_channels C become f·C; the last Linear's out_features k become f·k; BatchNorm follows
its input. A layer whose input and output are both widened by √f costs
(√f·a)(√f·b) = f·a·b multiply-adds per folded input, i.e. a·b per image: unchanged. Only
the first conv (f·C in, √f·w out: √f × per image) and the last Linear (√f·w in, f·k out:
√f × per image) cost more, as in the paper (it widens every layer but these two ends,
which fold the input and unfold the output), so

    FLOPs per image (folded) / FLOPs per image (original)
        = 1 + (√f − 1)·(share of the first conv + share of the last Linear) + rounding.

On a CNN whose first and last layers are a few percent of its FLOPs this stays within the
paper's +3.5 / +6.6 / +11.5 % for f = 2 / 3 / 4 (tests/graph/test_fold.py checks it).

FLOPs and bytes (analytic, from the layer shapes): a Conv2d costs 2·(C_in/groups)·K_h·K_w·
C_out·H_out·W_out FLOPs per image, a Linear 2·in·out (multiply-adds × 2; biases, BatchNorm,
ReLU and pooling are elementwise, a few percent here, and not counted, as CNN FLOP counts
conventionally do). Bytes moved by a layer in eager PyTorch (no fusion): its parameters and
buffers, read once per batch, plus its input and output activations, read and written once;
arithmetic intensity = FLOPs / bytes. Folding multiplies weight bytes by ≈ f and divides
activation bytes per image by ≈ √f, so at a batch of B images the intensity rises by ≈ √f
where activations dominate (large B) and falls by ≈ f where weights dominate (small B): folding
pays only past the batch where the folded model's activation bytes outweigh its weights.

Supported layers: Conv2d (groups = 1), BatchNorm2d, ReLU, MaxPool2d, AvgPool2d,
AdaptiveAvgPool2d, Flatten, Linear, Dropout (as modules; F.relu / torch.relu / torch.flatten
and the methods .relu() / .flatten(1) as calls), chained one after the other (traced with
torch.fx). The folded model is a new network (fresh weights): train it by distillation
(plait.graph.folded_data's ``distillation_loss``).
"""

from __future__ import annotations

import copy
import math
import operator
import warnings
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

PASS_THROUGH = (nn.ReLU, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Dropout)
SUPPORTED = "Conv2d (groups=1), BatchNorm2d, ReLU, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, Flatten, Linear, Dropout"
BYTES_PER_ELEMENT = 4  # float32


def widen(width: int, f: int) -> int:
    """round(width·√f), nearest integer with halves rounded up (never below 1)."""
    return max(1, math.floor(width * math.sqrt(f) + 0.5))


def check_factor(f) -> int:
    """``f`` if it is a positive integer, else a ValueError naming it."""
    if isinstance(f, bool) or not isinstance(f, int) or f < 1:
        raise ValueError(f"fold factor f={f!r} must be a positive integer (1, 2, 3, 4, ...): it is the number "
                         f"of images folded into one input")
    return f


def chain_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model``'s forward, in order, as modules (calls such as F.relu become
    nn.ReLU): traced with torch.fx; each step must consume the previous step's output only.
    Raises ValueError naming an unsupported layer, a branch, or a model with no conv."""
    if isinstance(model, nn.Sequential):
        layers = _flatten_sequential(model)
    else:
        layers = _traced_chain(model)
    for layer in layers:
        if isinstance(layer, nn.Conv2d) and layer.groups != 1:
            raise ValueError(f"unsupported layer {layer!r}: grouped convolutions (groups={layer.groups}) are not "
                             f"folded; supported: {SUPPORTED}")
        if not isinstance(layer, (nn.Conv2d, nn.BatchNorm2d, nn.Flatten, nn.Linear) + PASS_THROUGH):
            raise ValueError(f"unsupported layer {type(layer).__name__} ({layer!r}): fold supports {SUPPORTED}")
    if not any(isinstance(layer, nn.Conv2d) for layer in layers):
        raise ValueError(f"{type(model).__name__} has no Conv2d layer: FoldedCNN folds images into the channels "
                         f"of the first convolution; give a CNN")
    weighted = [layer for layer in layers if isinstance(layer, (nn.Conv2d, nn.Linear))]
    if not isinstance(weighted[-1], nn.Linear):
        raise ValueError(f"the last weighted layer is {weighted[-1]!r}: fold needs a final Linear (its k outputs "
                         f"become f·k, k per image)")
    if not isinstance(weighted[0], nn.Conv2d):
        raise ValueError(f"the first weighted layer is {weighted[0]!r}: fold needs a Conv2d first (its C input "
                         f"channels become f·C)")
    return layers


def _flatten_sequential(model: nn.Sequential) -> list[nn.Module]:
    layers = []
    for layer in model:
        layers.extend(_flatten_sequential(layer) if isinstance(layer, nn.Sequential) else [layer])
    return layers


def _traced_chain(model: nn.Module) -> list[nn.Module]:
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as error:  # torch.fx raises many kinds; the first line names the construct
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise ValueError(f"torch.fx cannot trace {type(model).__name__}: {first_line}; fold needs a forward that "
                         f"is a plain chain of {SUPPORTED}") from error
    modules = dict(model.named_modules())
    layers: list[nn.Module] = []
    previous = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if previous is not None:
                raise ValueError(f"{type(model).__name__}.forward takes more than one input ({node.name}): fold "
                                 f"needs one batch of images")
            previous = node
            continue
        if node.op == "output":
            break
        if node.all_input_nodes != [previous]:
            used = ", ".join(n.name for n in node.all_input_nodes) or "constants"
            raise ValueError(f"{node.name} ({node.format_node()}) reads {used}, not just {previous.name}: fold "
                             f"supports a chain of layers, not branches or residual connections")
        layers.append(_as_module(node, modules, type(model).__name__))
        previous = node
    return layers


def _as_module(node: torch.fx.Node, modules: dict[str, nn.Module], owner: str) -> nn.Module:
    if node.op == "call_module":
        return modules[node.target]
    flatten_start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
    if node.op == "call_function" and node.target in (F.relu, torch.relu):
        return nn.ReLU()
    if node.op == "call_method" and node.target == "relu":
        return nn.ReLU()
    if (node.op == "call_function" and node.target is torch.flatten) or (
            node.op == "call_method" and node.target == "flatten"):
        if flatten_start != 1:
            raise ValueError(f"{node.name}: flatten(start_dim={flatten_start}) in {owner} would mix images of a "
                             f"batch; use start_dim=1")
        return nn.Flatten()
    what = node.target if node.op != "call_function" else getattr(node.target, "__name__", node.target)
    if what is operator.getitem:
        what = "getitem"
    raise ValueError(f"unsupported layer {node.op} {what!r} ({node.name}) in {owner}: fold supports {SUPPORTED}")


def fold_layers(layers: list[nn.Module], f: int) -> nn.Sequential:
    """The folded architecture of ``layers`` (fresh weights): see the module docstring."""
    check_factor(f)
    weighted = [i for i, layer in enumerate(layers) if isinstance(layer, (nn.Conv2d, nn.Linear))]
    first, last = weighted[0], weighted[-1]
    folded = []
    channels = None  # (original, folded) width of the activation flowing between layers
    positions = None  # spatial positions per channel, known at a Flatten from the next Linear
    for index, layer in enumerate(layers):
        if isinstance(layer, nn.Conv2d):
            in_folded = layer.in_channels * f if index == first else channels[1]
            out_folded = widen(layer.out_channels, f)
            folded.append(nn.Conv2d(in_folded, out_folded, layer.kernel_size, stride=layer.stride,
                                    padding=layer.padding, dilation=layer.dilation, bias=layer.bias is not None,
                                    padding_mode=layer.padding_mode))
            channels = (layer.out_channels, out_folded)
        elif isinstance(layer, nn.BatchNorm2d):
            folded.append(nn.BatchNorm2d(channels[1], eps=layer.eps, momentum=layer.momentum, affine=layer.affine,
                                         track_running_stats=layer.track_running_stats))
        elif isinstance(layer, nn.Flatten):
            positions = "pending"
            folded.append(nn.Flatten())
        elif isinstance(layer, nn.Linear):
            if positions == "pending":
                if layer.in_features % channels[0]:
                    raise ValueError(f"{layer!r} follows a Flatten of {channels[0]} channels but its in_features "
                                     f"{layer.in_features} is not a multiple of them")
                in_folded = channels[1] * (layer.in_features // channels[0])
                positions = None
            else:
                in_folded = channels[1]
            out_folded = layer.out_features * f if index == last else widen(layer.out_features, f)
            folded.append(nn.Linear(in_folded, out_folded, bias=layer.bias is not None))
            channels = (layer.out_features, out_folded)
        else:
            folded.append(copy.deepcopy(layer))
    return nn.Sequential(*folded)


class FoldedCNN(nn.Module):
    """A folded network and its batch wrapper: (N, C, H, W) images -> (N, k) logits, one
    row per image (N padded to a multiple of f with zero images, a warning says so)."""

    def __init__(self, net: nn.Sequential, f: int, in_channels: int, classes: int):
        super().__init__()
        self.net, self.f, self.in_channels, self.classes = net, check_factor(f), in_channels, classes

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or images.shape[1] != self.in_channels:
            raise ValueError(f"FoldedCNN expects images (N, {self.in_channels}, H, W), got {tuple(images.shape)}")
        count = images.shape[0]
        padded = pad_to_multiple(images, self.f)
        if padded.shape[0] != count:
            warnings.warn(f"batch of {count} images is not a multiple of f={self.f}: padded with "
                          f"{padded.shape[0] - count} zero images (their logits are dropped)", stacklevel=2)
        return unfold_logits(self.net(fold_images(padded, self.f)), self.f)[:count]


def pad_to_multiple(images: torch.Tensor, f: int) -> torch.Tensor:
    """``images`` with zero images appended up to a multiple of ``f``."""
    missing = -images.shape[0] % f
    if not missing:
        return images
    return torch.cat([images, images.new_zeros((missing, *images.shape[1:]))])


def fold_images(images: torch.Tensor, f: int) -> torch.Tensor:
    """(N, C, H, W) -> (N/f, f·C, H, W): image j of group g at channels j·C … (j+1)·C − 1."""
    count, channels, height, width = images.shape
    if count % f:
        raise ValueError(f"{count} images do not fold by f={f}: pad to a multiple of {f} first")
    return images.reshape(count // f, f * channels, height, width)


def unfold_logits(logits: torch.Tensor, f: int) -> torch.Tensor:
    """(N/f, f·k) -> (N, k): image j of a group reads outputs j·k … (j+1)·k − 1."""
    groups, outputs = logits.shape
    return logits.reshape(groups * f, outputs // f)


def fold(model: nn.Module, f: int) -> FoldedCNN:
    """FoldedCNN of ``model`` with factor ``f`` (fresh weights, to be distilled from ``model``)."""
    check_factor(f)
    layers = chain_layers(model)
    first_conv = next(layer for layer in layers if isinstance(layer, nn.Conv2d))
    last_linear = [layer for layer in layers if isinstance(layer, nn.Linear)][-1]
    return FoldedCNN(fold_layers(layers, f), f, first_conv.in_channels, last_linear.out_features)


@dataclass(frozen=True)
class LayerCost:
    """One layer at batch 1 (of the network's own inputs: one folded input of f images
    for a folded network): FLOPs, weight bytes and activation bytes in and out."""

    name: str
    flops: float
    weight_bytes: float
    input_bytes: float
    output_bytes: float


def layer_costs(layers: list[nn.Module] | nn.Sequential, input_shape: tuple[int, int, int]) -> list[LayerCost]:
    """FLOPs and bytes of each layer for one input of ``input_shape`` (C, H, W); shapes are
    propagated by running the layers once on zeros, the costs come from the formulas."""
    costs = []
    activation = torch.zeros((1, *input_shape))
    with torch.no_grad():
        for layer in layers:
            was_training = layer.training
            layer.eval()
            output = layer(activation)
            layer.train(was_training)
            if isinstance(layer, nn.Conv2d):
                kernel_h, kernel_w = layer.kernel_size
                flops = 2.0 * (layer.in_channels // layer.groups) * kernel_h * kernel_w * output[0].numel()
            elif isinstance(layer, nn.Linear):
                flops = 2.0 * layer.in_features * layer.out_features
            else:
                flops = 0.0
            weight_elements = sum(t.numel() for t in list(layer.parameters()) + list(layer.buffers())
                                  if t.is_floating_point())
            costs.append(LayerCost(type(layer).__name__, flops, BYTES_PER_ELEMENT * weight_elements,
                                   BYTES_PER_ELEMENT * activation[0].numel(), BYTES_PER_ELEMENT * output[0].numel()))
            activation = output
    return costs


@dataclass(frozen=True)
class ModelCost:
    """A network's analytic cost: per image FLOPs and activation bytes, and weight bytes
    per batch (f images per folded input: per image = per input / f)."""

    images_per_input: int
    flops_per_image: float
    activation_bytes_per_image: float
    weight_bytes: float
    elementwise_bytes_per_image: float = 0.0  # activations in + out of the layers without FLOPs (BN, ReLU, pools)

    def arithmetic_intensity(self, batch_images: int) -> float:
        """FLOPs per byte moved for a batch of ``batch_images`` images (rounded up to whole
        inputs of images_per_input): weights once, activations per image."""
        images = math.ceil(batch_images / self.images_per_input) * self.images_per_input
        return (self.flops_per_image * images) / (self.weight_bytes + self.activation_bytes_per_image * images)


def model_cost(model: nn.Module, image_shape: tuple[int, int, int]) -> ModelCost:
    """Analytic ModelCost of an unfolded CNN or a FoldedCNN for images of ``image_shape``."""
    if isinstance(model, FoldedCNN):
        f, layers = model.f, list(model.net)
        input_shape = (image_shape[0] * f, *image_shape[1:])
    else:
        f, layers, input_shape = 1, chain_layers(model), image_shape
    costs = layer_costs(layers, input_shape)
    return ModelCost(images_per_input=f, flops_per_image=sum(c.flops for c in costs) / f,
                     activation_bytes_per_image=sum(c.input_bytes + c.output_bytes for c in costs) / f,
                     weight_bytes=sum(c.weight_bytes for c in costs),
                     elementwise_bytes_per_image=sum(c.input_bytes + c.output_bytes for c in costs if not c.flops) / f)
