"""A multi-layer perceptron and a small CNN for 8x8 images (scikit-learn's digits).

``build_model(name, seed=..., dtype=...)`` constructs one from a seed so that every
rank (and the single-process reference) starts from identical weights.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Linear layers with ReLU between them: sizes[0] -> ... -> sizes[-1].
    Parameters: sum over layers of in*out + out."""

    def __init__(self, sizes: tuple[int, ...] = (64, 256, 256, 10)):
        super().__init__()
        if len(sizes) < 2 or any(int(size) <= 0 for size in sizes):
            raise ValueError(f"MLP sizes must be >= 2 positive widths, got {sizes}")
        layers: list[nn.Module] = []
        for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(fan_in, fan_out))
            if index < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, sizes[0])
        return self.net(x.flatten(1))


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and a linear classifier for (batch, 1, 8, 8) images."""

    def __init__(self, channels: int = 32, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # (batch, 2c, 4, 4)
        )
        self.classifier = nn.Linear(2 * channels * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 64) or (batch, 1, 8, 8)
        return self.classifier(self.features(x.reshape(-1, 1, 8, 8)).flatten(1))


# name -> (constructor, description); "mlp-large" is the few-million-parameter
# model the data-parallel benchmark trains.
MODELS = {
    "mlp": (lambda: MLP((64, 256, 256, 10)), "MLP 64-256-256-10 (85 K parameters)"),
    "mlp-large": (lambda: MLP((64, 1024, 1024, 1024, 10)), "MLP 64-1024x3-10 (2.2 M parameters)"),
    "cnn": (lambda: SmallCNN(32), "CNN 2x conv3x3 (32, 64 channels) + linear (29 K parameters)"),
}


def build_model(name: str = "mlp", *, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The named model with weights drawn from ``seed`` (identical on every rank)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = MODELS[name][0]()
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype)
