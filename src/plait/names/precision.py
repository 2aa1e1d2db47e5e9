"""Training precisions and gradient-reduce dtypes, as ``plait train --precision`` /
``--grad-reduce-dtype`` and the planner spell them, with the torch dtype each means
(by name: this module stays torch-free)."""

from __future__ import annotations

FP32 = "fp32"
BF16_MIXED = "bf16-mixed"
FP16_MIXED = "fp16-mixed"
PRECISIONS = (FP32, BF16_MIXED, FP16_MIXED)

# the dtype the data-parallel gradient all-reduce sends
GRAD_REDUCE_DTYPES = ("fp32", "bf16", "fp16")

# the 16-bit compute dtype torch.autocast runs under each precision (None: no autocast)
AUTOCAST_DTYPE_NAMES = {FP32: None, BF16_MIXED: "bfloat16", FP16_MIXED: "float16"}
REDUCE_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# a 16-bit gradient reduce needs the precision that computes in that dtype
PRECISION_FOR_REDUCE_DTYPE = {"bf16": BF16_MIXED, "fp16": FP16_MIXED}

__all__ = ["AUTOCAST_DTYPE_NAMES", "BF16_MIXED", "FP16_MIXED", "FP32", "GRAD_REDUCE_DTYPES", "PRECISIONS",
           "PRECISION_FOR_REDUCE_DTYPE", "REDUCE_DTYPE_NAMES"]
