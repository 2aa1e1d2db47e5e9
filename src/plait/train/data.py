"""Data that ships with a package: scikit-learn's handwritten digits (1,797 8x8
images, 10 classes), no download. Standardised per pixel with the training split's
statistics, split deterministically, and cut into per-rank batches so that the
data-parallel ranks together see exactly the batch one process would."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Dataset:
    """Features (n, 64) and integer labels (n,)."""

    inputs: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


def load_digits(*, dtype: torch.dtype = torch.float32, test_fraction: float = 0.2,
                seed: int = 0) -> tuple[Dataset, Dataset]:
    """(train, test) splits of the digits, shuffled with ``seed``."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    order = np.random.default_rng(seed).permutation(len(bunch.target))
    inputs = bunch.data[order].astype(np.float64)
    labels = bunch.target[order].astype(np.int64)
    n_test = int(round(len(labels) * test_fraction))
    train_x, test_x = inputs[n_test:], inputs[:n_test]
    mean = train_x.mean(axis=0)
    std = train_x.std(axis=0) + 1e-6  # corner pixels are always 0
    def make(x, y):
        return Dataset(torch.from_numpy((x - mean) / std).to(dtype), torch.from_numpy(y))
    return make(train_x, labels[n_test:]), make(test_x, labels[:n_test])


def global_batch(dataset: Dataset, step: int, batch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``step``-th global batch of ``batch_size`` samples: an epoch-wise
    permutation drawn from (seed, epoch), so every rank computes the same batch."""
    if batch_size <= 0 or batch_size > len(dataset):
        raise ValueError(f"batch_size must be in 1..{len(dataset)}, got {batch_size}")
    per_epoch = len(dataset) // batch_size
    epoch, index = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(dataset), generator=generator)[index * batch_size : (index + 1) * batch_size]
    return dataset.inputs[order], dataset.labels[order]


def rank_batch(dataset: Dataset, step: int, batch_size: int, rank: int, world_size: int, *,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous 1/world_size slice of the global batch (``batch_size``
    is the global size and must divide evenly)."""
    if batch_size % world_size:
        raise ValueError(f"global batch_size {batch_size} is not divisible by world_size {world_size}; "
                         f"use a multiple of {world_size}")
    inputs, labels = global_batch(dataset, step, batch_size, seed=seed)
    per_rank = batch_size // world_size
    return inputs[rank * per_rank : (rank + 1) * per_rank], labels[rank * per_rank : (rank + 1) * per_rank]
