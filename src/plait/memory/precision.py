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

from plait.names.precision import AUTOCAST_DTYPE_NAMES, GRAD_REDUCE_DTYPES, PRECISIONS, REDUCE_DTYPE_NAMES

# the names' torch dtypes (plait.names.precision spells them torch-free)
AUTOCAST_DTYPE = {name: None if dtype is None else getattr(torch, dtype)
                  for name, dtype in AUTOCAST_DTYPE_NAMES.items()}
REDUCE_DTYPE = {name: getattr(torch, dtype) for name, dtype in REDUCE_DTYPE_NAMES.items()}


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
