"""Training precisions as the planner prices them: bytes per activation element and
per parameter (the parameter, its gradient, the optimizer's state), and which dtype's
matmul peak applies. Two trainers: Megatron-style 16-bit weights with fp32 master
copies (ZeRO's 2 + 2 + 12 bytes), and plait train's autocast over fp32 weights."""

from __future__ import annotations

from dataclasses import dataclass, replace

from plait.names.precision import AUTOCAST_DTYPE_NAMES, BF16_MIXED, FP16_MIXED, FP32

__all__ = ["Precision", "PRECISIONS", "AUTOCAST_PRECISIONS", "precision_for"]


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per element and per parameter of a training precision."""

    name: str
    dtype: str                # the matmul dtype (selects the device peak)
    element_bytes: int        # activations
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int      # per parameter: Adam's states (+ fp32 master weights when mixed)
    optimizer_traffic_bytes: int  # read + written per parameter by one optimizer step
    residual_bytes: int | None = None  # the residual stream's element (None: element_bytes)
    weight_copy_bytes: int = 0  # a 16-bit copy of each matmul weight kept per forward (autocast)
    softmax_bytes: int | None = None  # kept per attention-probability element (None: element_bytes)


PRECISIONS = {
    # ZeRO's accounting (Rajbhandari et al. 2020): 2 + 2 + 12 = 16 bytes per parameter
    BF16_MIXED: Precision(name=BF16_MIXED, dtype=AUTOCAST_DTYPE_NAMES[BF16_MIXED], element_bytes=2, param_bytes=2, grad_bytes=2,
                            optimizer_bytes=12, optimizer_traffic_bytes=32),
    FP16_MIXED: Precision(name=FP16_MIXED, dtype=AUTOCAST_DTYPE_NAMES[FP16_MIXED], element_bytes=2, param_bytes=2, grad_bytes=2,
                            optimizer_bytes=12, optimizer_traffic_bytes=32),
    # plain float32 AdamW (plait train's default dtype): 4 + 4 + 8
    FP32: Precision(name=FP32, dtype="float32", element_bytes=4, param_bytes=4, grad_bytes=4,
                      optimizer_bytes=8, optimizer_traffic_bytes=28),
}

# What plait train's --precision runs (torch.autocast over fp32 weights, plait.memory.precision):
# parameters, gradients and AdamW's two states stay float32 (4 + 4 + 8 bytes per parameter),
# the residual stream stays float32, matmuls save their 16-bit inputs and a 16-bit copy of
# their weights (plait.plan.transformer's module docstring)
AUTOCAST_PRECISIONS = {
    name: Precision(name=name, dtype=dtype, element_bytes=2, param_bytes=4, grad_bytes=4, optimizer_bytes=8,
                    optimizer_traffic_bytes=28, residual_bytes=4, weight_copy_bytes=2)
    for name, dtype in AUTOCAST_DTYPE_NAMES.items() if dtype is not None
}

# Autocast differs by device: CUDA's runs softmax in float32 (its fp32 op list), so the
# attention keeps the float32 probabilities (softmax's backward) and the 16-bit copy the
# PV matmul multiplied: 4 + 2 bytes per element where the CPU's bf16 softmax keeps 2
# (found on an H200, bench/gpu/results/run2-memory.json; checked on other runs,
# run3-memory4*.json: exact to the byte without recomputation).
CUDA_AUTOCAST_SOFTMAX_BYTES = 4 + 2
DEVICE_TYPES = ("cpu", "cuda")


def precision_for(name: str, accounting: str, device_type: str = "cpu") -> Precision:
    """The bytes of precision ``name`` as the accounting's trainer keeps them: under
    "plait" (plait train) a mixed precision is autocast over fp32 weights (on
    ``device_type``'s autocast); under "megatron", 16-bit weights with fp32 master
    copies in the optimizer (ZeRO's 2+2+12)."""
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r} must be one of {', '.join(PRECISIONS)}")
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type={device_type!r} must be one of {', '.join(DEVICE_TYPES)}")
    if accounting == "plait" and name in AUTOCAST_PRECISIONS:
        chosen = AUTOCAST_PRECISIONS[name]
        return replace(chosen, softmax_bytes=CUDA_AUTOCAST_SOFTMAX_BYTES) if device_type == "cuda" else chosen
    return PRECISIONS[name]
