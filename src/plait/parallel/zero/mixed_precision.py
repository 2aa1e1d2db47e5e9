"""ZeRO's mixed-precision policy, FSDP2's ``MixedPrecisionPolicy`` by field and meaning:
float32 master weights and optimizer state, 16-bit parameters for the forward and the
backward, gradients reduced in a dtype of their own.

- ``param_dtype``: the dtype of the gathered parameters the forward and backward compute
  with (``torch.bfloat16``). The shards the optimizer steps stay in the parameters' own
  dtype (wrap a float32 model: float32 master weights, float32 optimizer state); after
  each step the parameters are cast from them (all-gathered in ``param_dtype``). None:
  the parameters' own dtype, no master copy.
- ``reduce_dtype``: the dtype the gradients are reduce-scattered in (``torch.float32``: the
  16-bit gradients cast up first; ``torch.bfloat16``: half the bytes). None: ``param_dtype``.
  The average is added into the master shard's gradient in the master's dtype.
- ``output_dtype``: floating outputs of the forward cast to it (None: as computed).
- ``cast_forward_inputs``: floating inputs of the forward cast to ``param_dtype`` (True,
  as FSDP2), so that a float32 batch meets 16-bit weights.

Each dtype may be a ``torch.dtype`` or plait's name for it ("fp32", "bf16", "fp16", as
``plait train --grad-reduce-dtype`` spells them). ``ZeRO(..., mp_policy=)`` takes this
class or torch's own ``torch.distributed.fsdp.MixedPrecisionPolicy``.

The step is then what one process does by hand: ``master -= update(grad.float())``,
``param = master.to(param_dtype)``. Unlike ``torch.autocast`` (plait train's
``--precision bf16-mixed``, which keeps float32 parameters and casts per op), every op of
the module runs in ``param_dtype``, LayerNorm and the loss included, unless the module
casts itself.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

from plait.names.precision import REDUCE_DTYPE_NAMES

FIELDS = ("param_dtype", "reduce_dtype", "output_dtype")


def _as_dtype(field: str, value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value in REDUCE_DTYPE_NAMES:
        dtype = getattr(torch, REDUCE_DTYPE_NAMES[value])
    else:
        raise ValueError(f"MixedPrecisionPolicy: {field}={value!r} must be a torch dtype, one of "
                         f"{sorted(REDUCE_DTYPE_NAMES)}, or None")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"MixedPrecisionPolicy: {field}={dtype} must be a floating-point dtype "
                         "(torch.bfloat16, torch.float16 or torch.float32)")
    return dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed-precision policy for plait's ZeRO (see the module docstring)."""
    param_dtype: torch.dtype | str | None = None
    reduce_dtype: torch.dtype | str | None = None
    output_dtype: torch.dtype | str | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in FIELDS:  # names to dtypes; every bad one named at once would hide none
            object.__setattr__(self, field, _as_dtype(field, getattr(self, field)))
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(f"MixedPrecisionPolicy: cast_forward_inputs={self.cast_forward_inputs!r} must be "
                             "True or False")


def as_policy(policy) -> MixedPrecisionPolicy | None:
    """plait's policy from ``mp_policy=``: None, plait's own, or torch's FSDP2 one."""
    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy
    if isinstance(policy, TorchMixedPrecisionPolicy):
        return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                    output_dtype=policy.output_dtype,
                                    cast_forward_inputs=policy.cast_forward_inputs)
    raise TypeError(f"ZeRO: mp_policy={type(policy).__name__} must be a plait.parallel.zero.MixedPrecisionPolicy "
                    "or torch.distributed.fsdp.MixedPrecisionPolicy, e.g. "
                    "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")


def cast_floating(value, dtype: torch.dtype | None):
    """``value`` with every floating-point tensor in it (through tuples, lists, dicts and
    their subclasses, e.g. Hugging Face's ModelOutput) cast to ``dtype``; None: unchanged."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(cast_floating(item, dtype) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        out = copy.copy(value)  # the same class (a ModelOutput keeps its attributes in step)
        for key, item in value.items():
            out[key] = cast_floating(item, dtype)
        return out
    return value


__all__ = ["MixedPrecisionPolicy", "as_policy", "cast_floating"]
