"""Dropout whose mask is each rank's slice of the unsharded model's mask.

Every call draws the mask of the full (unsharded) activation from a generator
seeded by (module seed, call number) and keeps this rank's slice. So:
- in replicated regions every rank of the group draws the same mask;
- in sharded regions (attention heads, sequence shards) rank r drops exactly
  the elements the unsharded model drops in its part;
and a tensor-parallel run matches the unsharded run bit for bit with dropout on.
The price is drawing the full mask on every rank (b·heads·s² for attention).
Megatron-LM instead draws independent masks in sharded regions: cheaper, but not
comparable with a single device.

The stream position (``calls``) advances with every training forward and is not
in the state dict: recomputing a forward (activation checkpointing) would draw a
different mask, and a resumed run continues with fresh streams. Both want the
(seed, calls) of each mask kept with its activation; nothing in plait recomputes yet.
"""

from __future__ import annotations

import torch
from torch import nn


class ConsistentDropout(nn.Module):
    """Inverted dropout with rate ``p``; ``forward(x, full_shape, dim, index)``
    applies chunk ``index`` (along ``dim``) of the mask drawn for ``full_shape``."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        self.p = float(p)
        self.seed = 0
        self.calls = 0  # masks drawn so far: the next mask's stream

    def reseed(self, seed: int) -> None:
        self.seed = int(seed)
        self.calls = 0

    def forward(self, x: torch.Tensor, full_shape=None, dim: int = 0, index: int = 0) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        full_shape = tuple(x.shape) if full_shape is None else tuple(full_shape)
        generator = torch.Generator(device=x.device)
        generator.manual_seed((self.seed * 1_000_003 + self.calls) % (1 << 63))
        self.calls += 1
        keep = torch.rand(full_shape, generator=generator, device=x.device) >= self.p
        if keep.shape != x.shape:
            parts = full_shape[dim] // x.shape[dim]
            keep = keep.chunk(parts, dim=dim)[index]
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
