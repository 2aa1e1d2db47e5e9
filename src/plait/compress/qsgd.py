"""QSGD: unbiased stochastic quantisation to s levels (Alistarh et al. 2017).

The tensor is cut into chunks of ``chunk_size`` elements (the paper's "bucket size"
d, 512 by default as in its experiments), each with its own norm. With
norm = ||x||_2 of the element's chunk and s levels, each element becomes

    q_i = norm · sign(x_i) · ξ_i / s,   ξ_i = floor(s|x_i|/norm) + Bernoulli(frac_i),
    frac_i = s|x_i|/norm - floor(s|x_i|/norm),

so E[ξ_i] = s|x_i|/norm and E[q] = x (unbiased), with per-element variance
(norm/s)² · frac_i(1 - frac_i) <= (norm/s)²/4. Summed over a chunk the variance is
at most min(d/s², √d/s)·||x||²: chunking bounds it by the chunk size d instead of the
whole tensor's n (with one norm for 85 K elements and s = 7 the variance is ~40x the
gradient's own squared norm, and SGD diverges; with d = 512, ~3x).

Wire format: a ``bits``-bit code per element, the top bit the sign and the low
bits-1 bits the level ξ_i ∈ 0..s, packed with :func:`pack_bits`, plus the float32
norm per chunk: ceil(n·bits/8) + 4·ceil(n/d) bytes. bits ∈ {2, 4, 8} gives s <= 1, 7, 127.

Numerics: the norm and the quantisation are computed in float64 (any input dtype).
The norm is rounded *up* to float32 (``nextafter``) before quantising, so
|x_i| <= norm_sent, every level stays <= s, and q is unbiased with respect to the
norm the receivers actually see. Decoding is done in float64, then cast to dtype.
Randomness: a generator seeded (seed, rank, step, key), so runs are reproducible.
"""

from __future__ import annotations

import math

import torch

from plait.compress.base import Payload, PayloadCompressor, check_floating, check_int, generator_for
from plait.compress.packing import pack_bits, packed_nbytes, unpack_bits

BITS = (2, 4, 8)


class QSGD(PayloadCompressor):
    """Stochastic quantisation: 1 sign bit + (bits-1) level bits per element, plus a float32 norm."""

    name = "qsgd"

    def __init__(self, bits: int = 4, levels: int | None = None, seed: int = 0, chunk_size: int = 512):
        if isinstance(bits, bool) or bits not in BITS:
            raise ValueError(f"QSGD bits must be 2, 4 or 8 (1 sign bit + 1, 3 or 7 level bits), got {bits!r}")
        most = (1 << (bits - 1)) - 1
        if levels is None:
            levels = most
        levels = check_int("QSGD", f"levels for bits={bits}", levels, 1, most,
                           hint="; use more bits for more levels (bits=8 allows 127)")
        chunk_size = check_int("QSGD", "chunk_size", chunk_size, 1, 1 << 62,
                               hint=" (elements per norm; 512 as in the paper)")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"QSGD seed must be an int, got {seed!r}")
        self.bits = bits
        self.levels = levels
        self.seed = seed
        self.chunk_size = chunk_size

    def payload_layout(self, numel, dtype):
        chunks = -(-numel // self.chunk_size)
        return {"codes": ((packed_nbytes(numel, self.bits),), torch.uint8), "norm": ((chunks,), torch.float32)}

    def compress(self, flat, *, rank=0, step=0, key=None) -> Payload:
        check_floating(self.describe(), flat.dtype)
        flat = flat.detach().reshape(-1)
        x = flat.to(torch.float64)
        n = x.numel()
        d = max(min(self.chunk_size, n), 1)  # a chunk never needs to be longer than the tensor
        chunks = -(-n // d)
        padded = torch.zeros(chunks * d, dtype=torch.float64, device=x.device)
        padded[:n] = x
        norms = torch.linalg.vector_norm(padded.view(chunks, d), dim=1)  # (chunks,) float64
        sent = norms.to(torch.float32)
        low = sent.to(torch.float64) < norms  # round up, so |x_i| / norm_sent <= 1
        sent = torch.where(low, torch.nextafter(sent, torch.full_like(sent, math.inf)), sent)
        if not bool(torch.isfinite(sent).all()):
            raise ValueError(f"QSGD: a chunk's L2 norm ({float(norms.max())}) is not a finite float32; "
                             f"check for inf/nan gradients or scale the loss down")
        levels = torch.zeros(n, dtype=torch.float64, device=x.device)
        if n:
            per_element = sent.to(torch.float64).repeat_interleave(d)[:n]
            safe = torch.where(per_element > 0, per_element, torch.ones_like(per_element))
            scaled = x.abs().div_(safe).mul_(self.levels)  # s|x_i|/norm in [0, s] (0 where the chunk is 0)
            floor = scaled.floor()
            generator = generator_for(x.device, self.seed, rank, step, -1 if key is None else key)
            uniform = torch.rand(n, generator=generator, dtype=torch.float64, device=x.device)
            levels = floor.add_((uniform < scaled - floor).to(torch.float64)).clamp_(max=self.levels)
        levels = levels.to(torch.uint8)
        negative = ((x < 0) & (levels > 0)).to(torch.uint8)
        codes = levels | (negative << (self.bits - 1))
        tensors = {"codes": pack_bits(codes, self.bits), "norm": sent.to(x.device)}
        return Payload(tensors, flat.numel(), flat.dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        """q_i = sign_i · level_i · (norm / s), in float64, cast to the payload's dtype."""
        codes = unpack_bits(payload.tensors["codes"], self.bits, payload.numel)
        level_mask = (1 << (self.bits - 1)) - 1
        levels = (codes & level_mask).to(torch.float64)
        signs = 1.0 - 2.0 * (codes >> (self.bits - 1)).to(torch.float64)
        norms = payload.tensors["norm"].to(torch.float64)
        d = max(min(self.chunk_size, payload.numel), 1)
        step_size = norms.repeat_interleave(d)[: payload.numel] / self.levels
        return (signs * levels * step_size).to(payload.dtype)

    def describe(self) -> str:
        return f"qsgd(bits={self.bits},levels={self.levels},chunk={self.chunk_size})"
