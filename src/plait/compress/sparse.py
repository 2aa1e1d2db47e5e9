"""Sparsification: send k of n elements as (values, indices) pairs.

Both compressors keep k = max(1, ceil(ratio·n)) elements (all of them when n <= k)
and send ``values`` in the gradient's dtype plus ``indices`` as int32 (int64 when
n >= 2**31): k·(itemsize + 4) bytes. The average of p such payloads is a
scatter-add of every rank's values at its indices, divided by p:

    avg[j] = (1/p) Σ_r Σ_{i: idx_r[i] = j} val_r[i]

- :class:`TopK` keeps the k largest |x_i| (Aji & Heafield 2017; Lin et al. 2018
  with error feedback). Biased: use it inside ErrorFeedback.
- :class:`RandomK` keeps k indices drawn uniformly without replacement from a
  generator seeded (seed, rank, step, key), unscaled (E[C(x)] = (k/n)·x), which is
  what error feedback expects (Stich et al. 2018).
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from plait.compress.base import (
    Payload,
    PayloadCompressor,
    accumulate_dtype,
    check_floating,
    check_ratio,
    generator_for,
)


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices address up to 2**31 - 1 elements; larger tensors need int64."""
    return torch.int32 if numel < 2**31 else torch.int64


class SparseCompressor(PayloadCompressor):
    """Shared wire format and aggregation of the (values, indices) compressors."""

    def __init__(self, ratio: float):
        self.ratio_kept = check_ratio(type(self).__name__, ratio)

    def kept(self, numel: int) -> int:
        """k = max(1, ceil(ratio·n)), at most n. The 1e-9 absorbs binary rounding of
        ratio·n (0.07·100 is 7.000000000000001 in floating point, and means 7)."""
        if numel <= 0:
            return 0
        return min(numel, max(1, math.ceil(self.ratio_kept * numel - 1e-9)))

    def payload_layout(self, numel, dtype):
        k = self.kept(numel)
        return {"values": ((k,), dtype), "indices": ((k,), index_dtype(numel))}

    @abstractmethod
    def select(self, flat: torch.Tensor, k: int, *, rank: int, step: int, key: int | None) -> torch.Tensor:
        """The k indices to keep (1-D int64, distinct): TopK's largest magnitudes,
        RandomK's seeded draw."""

    def compress(self, flat, *, rank=0, step=0, key=None) -> Payload:
        check_floating(self.describe(), flat.dtype)
        flat = flat.detach().reshape(-1)
        numel = flat.numel()
        indices = self.select(flat, self.kept(numel), rank=rank, step=step, key=key)
        values = flat[indices]
        return Payload({"values": values, "indices": indices.to(index_dtype(numel))}, numel, flat.dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        values = payload.tensors["values"]
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=values.device)
        out[payload.tensors["indices"].long()] = values.to(payload.dtype)
        return out

    def aggregate(self, payloads: list[Payload]) -> torch.Tensor:
        """Scatter-add every rank's values at its indices (in rank order), divide by p."""
        numel, dtype = self.check_payloads(payloads)
        device = payloads[0].tensors["values"].device
        total = torch.zeros(numel, dtype=accumulate_dtype(dtype), device=device)
        for payload in payloads:
            total.index_add_(0, payload.tensors["indices"].long(), payload.tensors["values"].to(total.dtype))
        return total.div_(len(payloads)).to(dtype)


class TopK(SparseCompressor):
    """Keep the k = max(1, ceil(ratio·n)) largest-magnitude elements; k·(itemsize+4) bytes.

    Selection is ``torch.topk`` on |x|, O(n log k); ties at the k-th magnitude are
    broken by torch. Deterministic, so no seed.
    """

    name = "topk"

    def select(self, flat, k, *, rank, step, key):
        if k == flat.numel():
            return torch.arange(k, device=flat.device)
        return torch.topk(flat.abs(), k, sorted=False).indices

    def describe(self) -> str:
        return f"topk(ratio={self.ratio_kept:g})"


class RandomK(SparseCompressor):
    """Keep k = max(1, ceil(ratio·n)) uniformly random distinct elements, unscaled.

    Rank r at step s draws its indices from a generator seeded (seed, r, s, key), so
    ranks pick different elements and any rank can replay another's choice.
    E[C(x)] = (k/n)·x: meant for ErrorFeedback, which re-sends what was dropped.
    """

    name = "randomk"

    def __init__(self, ratio: float, seed: int = 0):
        super().__init__(ratio)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"RandomK seed must be an int, got {seed!r}")
        self.seed = seed

    def select(self, flat, k, *, rank, step, key):
        generator = generator_for(flat.device, self.seed, rank, step, -1 if key is None else key)
        chosen = torch.randperm(flat.numel(), generator=generator, device=flat.device)[:k]
        return chosen.sort().values  # ascending: the scatter walks memory in order

    def describe(self) -> str:
        return f"randomk(ratio={self.ratio_kept:g})"
