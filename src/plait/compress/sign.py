"""signSGD: one bit per element (Bernstein et al. 2018; Karimireddy et al. 2019).

Each element's sign is one bit, packed 8 to a byte: bit 1 for x_i < 0, bit 0 for
x_i >= 0, so **zero encodes as +1** (a 1-bit code has no room for a third value).
The wire holds ceil(n/8) bytes, 1/32 of float32.

- ``Sign(scaled=False)``: signSGD with majority vote. The average of p payloads is
  the element-wise vote sign(Σ_r s_r,i) ∈ {-1, 0, +1} (0 on a tie, possible for
  even p): the direction most ranks agree on, magnitude 1 (the optimiser's learning
  rate sets the step).
- ``Sign(scaled=True)``: also sends a float32 scale = mean |x| = ||x||_1 / n (4
  bytes), decodes to scale·sign(x) and averages the decoded tensors. Inside
  :class:`~plait.compress.ErrorFeedback` this is EF-signSGD (Karimireddy et al.
  2019), which converges like SGD where plain signSGD can fail.
"""

from __future__ import annotations

import torch

from plait.compress.base import Payload, PayloadCompressor, check_floating
from plait.compress.packing import pack_bits, packed_nbytes, unpack_bits


class Sign(PayloadCompressor):
    """1-bit sign compression; ``scaled`` adds the float32 ||x||_1/n scale (EF-signSGD)."""

    def __init__(self, scaled: bool = False):
        if not isinstance(scaled, bool):
            raise ValueError(f"Sign scaled must be True or False, got {scaled!r}")
        self.scaled = scaled
        self.name = "sign"

    def payload_layout(self, numel, dtype):
        layout = {"bits": ((packed_nbytes(numel, 1),), torch.uint8)}
        if self.scaled:
            layout["scale"] = ((1,), torch.float32)
        return layout

    def compress(self, flat, *, rank=0, step=0, key=None) -> Payload:
        check_floating(self.describe(), flat.dtype)
        flat = flat.detach().reshape(-1)
        tensors = {"bits": pack_bits((flat < 0).to(torch.uint8), 1)}
        if self.scaled:
            # ||x||_1 / n summed in float64 so a large float16/32 bucket does not lose the tail
            scale = flat.abs().sum(dtype=torch.float64) / max(flat.numel(), 1)
            tensors["scale"] = scale.to(torch.float32).reshape(1)
        return Payload(tensors, flat.numel(), flat.dtype)

    def signs(self, payload: Payload) -> torch.Tensor:
        """The ±1 signs as int8 (bit 0 -> +1, bit 1 -> -1)."""
        bits = unpack_bits(payload.tensors["bits"], 1, payload.numel)
        return 1 - 2 * bits.to(torch.int8)

    def decompress(self, payload: Payload) -> torch.Tensor:
        signs = self.signs(payload).to(payload.dtype)
        if self.scaled:
            return signs.mul_(payload.tensors["scale"].to(payload.dtype))
        return signs

    def aggregate(self, payloads: list[Payload]) -> torch.Tensor:
        """Unscaled: majority vote sign(Σ_r s_r) (ties -> 0). Scaled: mean of scale_r·s_r."""
        if self.scaled:
            return super().aggregate(payloads)
        _, dtype = self.check_payloads(payloads)
        votes = None
        for payload in payloads:
            signs = self.signs(payload).to(torch.int32)
            votes = signs if votes is None else votes.add_(signs)
        return torch.sign(votes).to(dtype)

    def describe(self) -> str:
        return "sign(scaled)" if self.scaled else "sign"
