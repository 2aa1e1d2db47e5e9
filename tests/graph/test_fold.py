"""FoldedCNN (plait.graph.fold): the folded architecture and its FLOP budget per f, the
batch wrapper's layout and per-image outputs, bad input, the red-square data and a
distillation smoke test.

Tolerances: FLOP counts are integers, compared exactly (the analytic count against torch's
FlopCounterMode, an independent count of the ops that run). Outputs of unaffected images
are compared exactly (the same float operations on the same values); the block-diagonal
layout check is float64 to 1e-12 relative (one matmul of 2·C terms)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from plait.graph import fold
from plait.graph.fold import FoldedCNN, fold_images, layer_costs, model_cost, unfold_logits, widen
from plait.graph.folded_data import (IMAGE_SHAPE, distillation_loss, red_square_cnn, red_square_dataset, train)

# the paper's FLOP overheads per image for f = 2 / 3 / 4 (Kosaian et al., ICML 2021)
PAPER_OVERHEAD = {2: 0.035, 3: 0.066, 4: 0.115}


class ChainCNN(nn.Module):
    """The red-square CNN written as a forward with functional calls (traced by torch.fx)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 8 * 8, 40)
        self.fc2 = nn.Linear(40, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(self.fc1(torch.flatten(x, 1)).relu())


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc((self.conv(x) + x).mean(dim=(2, 3)))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        return self.fc(self.conv(x).mean(dim=(2, 3)))


def counted_flops_per_image(model: nn.Module, f: int) -> float:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()(torch.zeros(2 * f, *IMAGE_SHAPE))
    return counter.get_total_flops() / (2 * f)


@pytest.mark.parametrize("f", [1, 2, 3, 4])
def test_folded_architecture(f):
    folded = fold(red_square_cnn(), f)
    convs = [m for m in folded.net if isinstance(m, nn.Conv2d)]
    linears = [m for m in folded.net if isinstance(m, nn.Linear)]
    norms = [m for m in folded.net if isinstance(m, nn.BatchNorm2d)]
    assert convs[0].in_channels == 3 * f
    assert [c.out_channels for c in convs] == [widen(w, f) for w in (16, 32, 64, 64)]
    assert [c.in_channels for c in convs[1:]] == [c.out_channels for c in convs[:-1]]
    assert [n.num_features for n in norms] == [c.out_channels for c in convs]
    assert (linears[-1].in_features, linears[-1].out_features) == (widen(64, f), 2 * f)
    assert (convs[0].stride, convs[1].stride) == ((2, 2), (1, 1))


def test_widths_round_to_nearest():
    # 16·√2 = 22.63 -> 23, 32·√2 = 45.25 -> 45, 64·√3 = 110.85 -> 111, 64·√4 = 128
    assert [widen(16, 2), widen(32, 2), widen(64, 3), widen(64, 4), widen(7, 1)] == [23, 45, 111, 128, 7]


@pytest.mark.parametrize("f", [2, 3, 4])
def test_flops_per_image_within_the_papers_overhead(f):
    model = red_square_cnn()
    folded = fold(model, f)
    base, cost = model_cost(model, IMAGE_SHAPE), model_cost(folded, IMAGE_SHAPE)
    # the analytic count is the count of the ops that run
    assert base.flops_per_image == counted_flops_per_image(model, 1)
    assert cost.flops_per_image == counted_flops_per_image(folded, f)
    overhead = cost.flops_per_image / base.flops_per_image - 1
    assert 0 < overhead <= PAPER_OVERHEAD[f]
    # where it comes from, exactly: per image the first conv grows by widen(16)/16 ≈ √f, the last
    # Linear by widen(64)/64 ≈ √f, a middle conv a -> b by widen(a)·widen(b)/(f·a·b) = 1 + rounding
    flops = [c.flops for c in layer_costs(list(model), IMAGE_SHAPE) if c.flops]
    growth = [widen(16, f) / 16] + [widen(a, f) * widen(b, f) / (f * a * b) for a, b in ((16, 32), (32, 64), (64, 64))]
    growth.append(widen(64, f) / 64)
    predicted = sum(share * (g - 1) for share, g in zip(flops, growth)) / base.flops_per_image
    assert abs(overhead - predicted) <= 1e-12
    assert abs(growth[0] - math.sqrt(f)) < 0.5 / 16 and abs(growth[-1] - math.sqrt(f)) < 0.5 / 64


def test_layer_costs_by_hand():
    # Conv2d(3, 4, 3, padding 1) on 8x8: 2·3·9·4·64 FLOPs, 4·3·9 + 4 weights; Linear 256 -> 2
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 64, 2)]
    conv, flat, linear = layer_costs(layers, (3, 8, 8))
    assert (conv.flops, conv.weight_bytes, conv.input_bytes, conv.output_bytes) == (
        2 * 3 * 9 * 4 * 64, 4 * (4 * 27 + 4), 4 * 3 * 64, 4 * 4 * 64)
    assert (flat.flops, flat.weight_bytes) == (0, 0)
    assert (linear.flops, linear.weight_bytes, linear.output_bytes) == (2 * 256 * 2, 4 * (512 + 2), 8)


def test_arithmetic_intensity_rises_with_batch_and_with_folding():
    base = model_cost(red_square_cnn(), IMAGE_SHAPE)
    folded = model_cost(fold(red_square_cnn(), 4), IMAGE_SHAPE)
    assert base.arithmetic_intensity(1) < base.arithmetic_intensity(64) < base.flops_per_image / base.activation_bytes_per_image
    # weights: every internal tensor scales by (√f)² = f, up to rounding
    assert 3.9 < folded.weight_bytes / base.weight_bytes < 4.2
    # activations per image shrink by ≈ √f (the input image's bytes do not)
    assert folded.activation_bytes_per_image < 0.6 * base.activation_bytes_per_image
    assert folded.arithmetic_intensity(1024) > 1.5 * base.arithmetic_intensity(1024)


def test_elementwise_bytes_halve_at_f4():
    # BN, ReLU and pools read and write widened activations: (√4·w channels) for 4 images, i.e.
    # w/2 per image, exactly (every width doubles without rounding at f = 4)
    base = model_cost(red_square_cnn(), IMAGE_SHAPE)
    folded = model_cost(fold(red_square_cnn(), 4), IMAGE_SHAPE)
    assert folded.elementwise_bytes_per_image == base.elementwise_bytes_per_image / 2


def test_traced_chain_folds_like_a_sequential():
    folded = fold(ChainCNN(), 2)
    kinds = [type(m).__name__ for m in folded.net]
    assert kinds == ["Conv2d", "BatchNorm2d", "ReLU", "Conv2d", "ReLU", "MaxPool2d", "Flatten", "Linear", "ReLU",
                     "Linear"]
    assert folded.net[7].in_features == widen(32, 2) * 64 and folded.net[7].out_features == widen(40, 2)
    assert folded.net[9].out_features == 10
    assert folded(torch.rand(4, *IMAGE_SHAPE)).shape == (4, 5)


def test_wrapper_returns_one_row_per_image_and_pads():
    torch.manual_seed(0)
    folded = fold(red_square_cnn(), 3).eval()
    images = torch.rand(6, *IMAGE_SHAPE)
    assert folded(images).shape == (6, 2)
    with pytest.warns(UserWarning, match="batch of 5 images is not a multiple of f=3: padded with 1 zero image"):
        five = folded(images[:5])
    padded = folded(torch.cat([images[:5], torch.zeros(1, *IMAGE_SHAPE)]))
    assert five.shape == (5, 2) and torch.equal(five, padded[:5])


def test_images_of_other_groups_do_not_change_an_images_logits():
    torch.manual_seed(0)
    folded = fold(red_square_cnn(), 2).eval()
    images = torch.rand(6, *IMAGE_SHAPE)
    changed = images.clone()
    changed[0] = torch.rand(*IMAGE_SHAPE)
    before, after = folded(images), folded(changed)
    assert not torch.equal(before[:2], after[:2])  # image 0's group: images 0 and 1
    assert torch.equal(before[2:], after[2:])


def test_fold_layout_image_j_at_channels_j_and_logits_j():
    # a folded net that maps image j's channel means to logits j·k … (j+1)·k − 1 (block diagonal)
    f, channels, classes = 3, 3, 2
    weight = torch.randn(classes, channels, dtype=torch.float64)
    linear = nn.Linear(f * channels, f * classes, bias=False).double()
    with torch.no_grad():
        linear.weight.copy_(torch.block_diag(*[weight] * f))
    folded = FoldedCNN(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), linear), f, channels, classes)
    images = torch.rand(6, channels, 5, 5, dtype=torch.float64)
    expected = images.mean(dim=(2, 3)) @ weight.T
    assert torch.linalg.norm(folded(images) - expected) <= 1e-12 * torch.linalg.norm(expected)
    assert torch.equal(unfold_logits(fold_images(images, f).mean(dim=(2, 3)), f), images.mean(dim=(2, 3)))


@pytest.mark.parametrize("f", [0, -2, 1.5, "2", True, None])
def test_bad_fold_factor_is_named(f):
    with pytest.raises(ValueError, match=f"fold factor f={f!r} must be a positive integer"):
        fold(red_square_cnn(), f)


@pytest.mark.parametrize("model,message", [
    (nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 2)), "has no Conv2d layer"),
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(4 * 900, 2)),
     r"unsupported layer Sigmoid \(Sigmoid\(\)\)"),
    (nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(4 * 900, 2)),
     "grouped convolutions .groups=2. are not folded"),
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)), "fold needs a final Linear"),
    (Residual(), "reads conv, x, not just conv: fold supports a chain of layers"),
    (Branchy(), "torch.fx cannot trace Branchy: symbolically traced variables cannot be used as inputs to control"),
])
def test_unsupported_models_are_named(model, message):
    with pytest.raises(ValueError, match=message):
        fold(model, 2)


def test_red_square_data_is_seeded_balanced_and_labelled_by_the_square():
    images, labels = red_square_dataset(200, seed=3)
    again, _ = red_square_dataset(200, seed=3)
    assert torch.equal(images, again) and images.shape == (200, 3, 32, 32)
    assert labels.sum().item() == 100
    # a red pixel (r >= 0.75, g and b <= 0.25) appears exactly in the images that have the square
    red = ((images[:, 0] >= 0.75) & (images[:, 1] <= 0.25) & (images[:, 2] <= 0.25)).flatten(1).sum(dim=1)
    assert torch.equal(red >= 16, labels.bool()) and torch.equal(red > 0, labels.bool())


def test_distillation_loss_formula():
    torch.manual_seed(0)
    student, teacher = torch.randn(5, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 0, 1])
    temperature, alpha = 3.0, 0.6
    p_teacher = torch.softmax(teacher / temperature, dim=1)
    kl = (p_teacher * (p_teacher.log() - torch.log_softmax(student / temperature, dim=1))).sum() / 5
    expected = alpha * temperature ** 2 * kl + (1 - alpha) * F.cross_entropy(student, labels)
    got = distillation_loss(student, teacher, labels, temperature=temperature, alpha=alpha)
    assert abs(got.item() - expected.item()) <= 1e-12 * abs(expected.item())
    # a student equal to its teacher pays only the hard term
    same = distillation_loss(teacher, teacher, labels, temperature=temperature, alpha=alpha)
    assert abs(same.item() - (1 - alpha) * F.cross_entropy(teacher, labels).item()) <= 1e-12


def test_a_few_distillation_steps_lower_the_loss():
    images, labels = red_square_dataset(96, seed=0)
    torch.manual_seed(0)
    teacher = red_square_cnn()
    train(teacher, images, labels, epochs=4, seed=0, batch_size=96, learning_rate=3e-2)
    # one batch of all 96 images per step (train mode, BatchNorm on batch statistics): the same
    # images every step, so the steps' losses compare; a smoke test, so a clear drop (by a fifth)
    # of the last three steps' mean below the first step's loss, not convergence
    losses = train(fold(teacher, 2), images, labels, epochs=10, seed=0, teacher=teacher, batch_size=96,
                   learning_rate=3e-2)
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
