"""Linear casts: send the gradient in 16-bit floating point, 2 bytes per element.

Casting commutes with summation up to rounding, so unlike the other compressors
these all-reduce instead of all-gathering: each rank sends c_r = cast(x_r / p) and
the group sums the c_r in the 16-bit dtype,

    avg ≈ Σ_r cast(x_r / p),

which costs a ring all-reduce of 2n bytes, 2(p-1)/p · 2n · b, independent of p's
gather growth. Dividing by p *before* casting keeps the partial sums within the
range of x, so float16 (max 65504) overflows only if the average itself would.
Rounding: each cast and each of the p-1 additions of the reduction rounds to the
16-bit format (unit roundoff 2^-11 for float16, 2^-8 for bfloat16).

``compress``/``decompress``/``aggregate`` still exist (the parameter server moves
payloads point to point): there the average is taken after decoding, in float32.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.compress.base import GradBucket, Payload, PayloadCompressor, check_floating, group_rank_and_size


class Cast(PayloadCompressor):
    """Send ``wire_dtype`` values: n · itemsize(wire_dtype) bytes."""

    wire_dtype: torch.dtype = torch.float16
    collectives = ("all_reduce",)  # reduce() all-reduces the cast values

    def payload_layout(self, numel, dtype):
        return {"values": ((numel,), self.wire_dtype)}

    def compress(self, flat, *, rank=0, step=0, key=None) -> Payload:
        check_floating(self.describe(), flat.dtype)
        flat = flat.detach().reshape(-1)
        return Payload({"values": flat.to(self.wire_dtype, copy=True)}, flat.numel(), flat.dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.tensors["values"].to(payload.dtype)

    def reduce(self, bucket: GradBucket, group=None, *, algorithm="auto") -> int:
        """All-reduce (SUM) cast(buffer / p) in the wire dtype and copy the sum back."""
        _, world_size = group_rank_and_size(group)
        if world_size == 1:
            return 0
        buffer = bucket.buffer
        check_floating(self.describe(), buffer.dtype)
        wire = (buffer / world_size).to(self.wire_dtype)
        comm.all_reduce(wire, comm.ReduceOp.SUM, group, algorithm=algorithm)
        buffer.copy_(wire)
        return wire.numel() * wire.element_size()

    def describe(self) -> str:
        return self.name


class FP16(Cast):
    """IEEE half precision on the wire (10-bit mantissa, range ±65504)."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16(Cast):
    """bfloat16 on the wire (7-bit mantissa, float32's range)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
