"""Mixed precision as plait train runs it: fp32 master weights and optimizer state,
16-bit compute through ``torch.autocast`` around every stage's forward (matmuls in
16 bits; the residual stream, LayerNorm inputs and the vocab-parallel cross-entropy
stay in fp32), gradients accumulated in fp32 and reduced over data parallelism in
fp32 or, with ``grad_reduce_dtype``, in 16 bits. fp16 adds dynamic loss scaling
(``plait.memory.loss_scale``); bf16 has fp32's exponent range and needs none.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
GRAD_REDUCE_DTYPES = ("fp32", "bf16", "fp16")
AUTOCAST_DTYPE = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
REDUCE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` in ``dtype`` on ``device``'s type, or nothing when dtype is None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def check_device(precision: str, device: torch.device) -> None:
    """Run a linear layer and a LayerNorm forward and backward under ``precision`` on
    ``device``; a device or op that cannot do it raises ValueError naming both."""
    dtype = AUTOCAST_DTYPE[precision]
    if dtype is None:
        return
    for op in ("linear", "layer_norm"):
        try:
            weight = torch.ones(8, 8, device=device, requires_grad=True)
            x = torch.ones(4, 8, device=device)
            with torch.autocast(device_type=device.type, dtype=dtype):
                y = F.linear(x, weight) if op == "linear" else F.layer_norm(x @ weight, (8,))
            y.float().sum().backward()
        except RuntimeError as error:
            raise ValueError(f"precision={precision!r}: {op} cannot run in {dtype} under autocast on {device} "
                             f"({error}); use precision=fp32 or another device") from error


__all__ = ["AUTOCAST_DTYPE", "autocast", "GRAD_REDUCE_DTYPES", "PRECISIONS", "REDUCE_DTYPE", "check_device"]
