"""The specialised task FoldedCNN is measured on, its CNN, and training by distillation.

Task ("does this 32×32 RGB image contain a red square?", generated from a seed, offline):
every image is uniform noise in [0, 0.3] per channel with 1–3 rectangles of other colours
(sides 3–12 px; a colour that would be red, r > 0.5 with g, b < 0.5, gets g or b raised to
≥ 0.6); exactly half (a seeded permutation) also get a red square on top (side 4–10 px,
r ∈ [0.75, 1], g, b ∈ [0, 0.25]) at a uniform position. Label 1 = red square present.

The CNN (``red_square_cnn``): a stride-2 3×3 conv (3→16) on 32×32, then 3×3 convs 16→32,
32→64, 64→64 with BatchNorm + ReLU and 2×2 max pools, global average pool, Linear 64→2:
≈ 6.1 MFLOPs per image, of which the first conv and the last Linear are ≈ 3.6 %, so its
fold costs ≈ 1 + (√f − 1)·3.6 % per image (plait.graph.fold).

Distillation (Hinton et al. 2015, as the FoldedCNN paper trains its folded networks from the
original): per image, with student logits s, teacher logits t, label y, temperature T and
weight α,

    loss = α · T² · KL(softmax(t/T) ‖ softmax(s/T)) + (1 − α) · CE(s, y),

averaged over images (T² keeps the soft term's gradient on the scale of the hard one).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SHAPE = (3, 32, 32)
CLASSES = 2


def red_square_dataset(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images (count, 3, 32, 32) float32 in [0, 1] and labels (count,) int64."""
    if count < 1:
        raise ValueError(f"count={count} images: give at least 1")
    rng = np.random.default_rng(seed)
    channels, height, width = IMAGE_SHAPE
    images = rng.uniform(0.0, 0.3, size=(count, channels, height, width)).astype(np.float32)
    labels = (rng.permutation(count) % 2).astype(np.int64)
    for index in range(count):
        for _ in range(rng.integers(1, 4)):
            colour = rng.uniform(0.0, 1.0, size=3)
            if colour[0] > 0.5 and colour[1] < 0.5 and colour[2] < 0.5:  # reddish: make it another colour
                colour[rng.integers(1, 3)] = rng.uniform(0.6, 1.0)
            _paint(images[index], rng, colour, side_h=rng.integers(3, 13), side_w=rng.integers(3, 13))
        if labels[index]:
            red = np.array([rng.uniform(0.75, 1.0), rng.uniform(0.0, 0.25), rng.uniform(0.0, 0.25)])
            side = rng.integers(4, 11)
            _paint(images[index], rng, red, side_h=side, side_w=side)
    return torch.from_numpy(images), torch.from_numpy(labels)


def _paint(image: np.ndarray, rng: np.random.Generator, colour: np.ndarray, *, side_h: int, side_w: int) -> None:
    top = rng.integers(0, image.shape[1] - side_h + 1)
    left = rng.integers(0, image.shape[2] - side_w + 1)
    image[:, top:top + side_h, left:left + side_w] = colour[:, None, None]


def red_square_cnn() -> nn.Sequential:
    """The specialised CNN of the task (see the module docstring)."""
    def block(inputs: int, outputs: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(outputs),
                nn.ReLU()]

    return nn.Sequential(*block(3, 16, stride=2), *block(16, 32), nn.MaxPool2d(2), *block(32, 64),
                         nn.MaxPool2d(2), *block(64, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, CLASSES))


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, labels: torch.Tensor, *,
                      temperature: float = 4.0, alpha: float = 0.7) -> torch.Tensor:
    """The loss of the module docstring, mean over images; without a teacher, CE(s, y)."""
    hard = F.cross_entropy(student_logits, labels)
    if teacher_logits is None:
        return hard
    soft = F.kl_div(F.log_softmax(student_logits / temperature, dim=1),
                    F.log_softmax(teacher_logits / temperature, dim=1), log_target=True, reduction="batchmean")
    return alpha * temperature ** 2 * soft + (1.0 - alpha) * hard


def train(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, epochs: int, seed: int,
          teacher: nn.Module | None = None, batch_size: int = 96, learning_rate: float = 3e-3,
          temperature: float = 4.0, alpha: float = 0.7, max_steps: int | None = None) -> list[float]:
    """Adam on ``distillation_loss`` (hard labels only without ``teacher``), shuffled each
    epoch from ``seed`` (so a folded model sees new groups of f images every epoch);
    returns the loss of every step. ``batch_size`` images per step (a multiple of f)."""
    teacher_logits = None
    if teacher is not None:
        teacher.eval()
        with torch.inference_mode():
            teacher_logits = torch.cat([teacher(chunk) for chunk in images.split(512)])
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate,
                                                   total_steps=epochs * (len(images) // batch_size))
    model.train()
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images) - batch_size + 1, batch_size):
            chosen = order[start:start + batch_size]
            loss = distillation_loss(model(images[chosen]), None if teacher_logits is None else teacher_logits[chosen],
                                     labels[chosen], temperature=temperature, alpha=alpha)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if max_steps is not None and len(losses) >= max_steps:
                return losses
    return losses


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 480) -> float:
    """Fraction of ``images`` whose argmax logit is the label (eval mode)."""
    model.eval()
    with torch.inference_mode():
        predictions = torch.cat([model(chunk).argmax(dim=1) for chunk in images.split(batch_size)])
    return (predictions == labels).float().mean().item()
