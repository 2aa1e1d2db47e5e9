"""What one layer of a model costs: the planner's common currency.

A model, to the planner, is a list of layers run one after another (the units a
pipeline stage boundary may fall between). Each ``LayerCost`` is the cost of one
layer for ONE micro-batch of a stated size on ONE device (after any tensor-parallel
split), whichever way it was obtained: from the analytic transformer description
(``plait.plan.transformer``) or by tracing a real ``nn.Module``
(``plait.plan.trace``). The time of a layer on a device is then

    T = kernels · t_kernel + matmul FLOPs / (η · peak) + other bytes / (η_mem · bandwidth)

(``plait.plan.device``): matmuls are compute-bound, everything else (norms,
activations, softmax, adds, copies) is memory-bound, and every kernel pays a fixed
launch/dispatch cost.

FLOPs, bytes and activation memory grow linearly with the micro-batch (``scaled``);
kernel counts and parameters do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

__all__ = ["RECOMPUTE_MODES", "LayerCost", "check_recompute", "total"]


# activation recomputation, as plait train runs it (plait.parallel.recompute)
RECOMPUTE_MODES = ("none", "selective", "full")


def check_recompute(mode) -> str:
    if isinstance(mode, bool) or mode not in RECOMPUTE_MODES:
        hint = f" (recompute={mode} was the full recomputation switch: say 'full' or 'none')" if isinstance(mode, bool) else ""
        raise ValueError(f"recompute={mode!r} must be one of {', '.join(RECOMPUTE_MODES)}{hint}")
    return mode


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One layer, one micro-batch, one device.

    - ``params``: parameters this device holds for the layer (a count, not bytes).
    - ``forward_flops`` / ``backward_flops``: matmul FLOPs (2·m·n·k per product) of the
      forward and of the backward (input and weight gradients, about 2x forward).
    - ``forward_kernels`` / ``backward_kernels``: kernels (operators) launched.
    - ``forward_bytes`` / ``backward_bytes``: memory traffic of the non-matmul
      operators (bytes read plus bytes written).
    - ``activation_bytes``: bytes the forward keeps for the backward (saved tensors).
    - ``input_bytes``: bytes of the activation the layer takes in (what full
      recomputation keeps instead of ``activation_bytes``).
    - ``output_bytes``: bytes of the activation handed to the next layer (what a
      pipeline stage boundary after this layer sends, forward and, as its gradient,
      backward).
    - ``core_activation_bytes`` / ``core_forward_flops`` / ``core_forward_bytes``: the
      part of a transformer block that selective recomputation re-runs (the attention
      core: QKᵀ, softmax, dropout, ·V): the bytes of ``activation_bytes`` it keeps, its
      forward's matmul FLOPs and memory traffic (0 for other layers).
    - ``post_core_bytes``: the bytes of ``activation_bytes`` the block keeps for what
      follows its core, which its backward frees before the core's: a selective
      recompute's working set is the core less these.
    """

    name: str
    params: int = 0
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    forward_kernels: int = 0
    backward_kernels: int = 0
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    activation_bytes: float = 0.0
    input_bytes: float = 0.0
    output_bytes: float = 0.0
    core_activation_bytes: float = 0.0
    post_core_bytes: float = 0.0
    core_forward_flops: float = 0.0
    core_forward_bytes: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.name, str) or not self.name:
            problems.append(f"name={self.name!r} must be a non-empty string")
        for item in fields(self):
            if item.name == "name":
                continue
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                problems.append(f"{item.name}={value!r} must be a finite number >= 0")
        if problems:
            raise ValueError(f"invalid LayerCost {self.name!r}: " + "; ".join(problems))

    def scaled(self, factor: float) -> "LayerCost":
        """The same layer on ``factor`` times the micro-batch: FLOPs, bytes and
        activations scale, kernel counts and parameters do not."""
        if not (isinstance(factor, (int, float)) and factor > 0 and math.isfinite(factor)):
            raise ValueError(f"factor={factor!r} must be a finite number > 0")
        return replace(self, forward_flops=self.forward_flops * factor, backward_flops=self.backward_flops * factor,
                       forward_bytes=self.forward_bytes * factor, backward_bytes=self.backward_bytes * factor,
                       activation_bytes=self.activation_bytes * factor, input_bytes=self.input_bytes * factor,
                       output_bytes=self.output_bytes * factor,
                       core_activation_bytes=self.core_activation_bytes * factor,
                       post_core_bytes=self.post_core_bytes * factor,
                       core_forward_flops=self.core_forward_flops * factor,
                       core_forward_bytes=self.core_forward_bytes * factor)


def total(layers, name: str = "total") -> LayerCost:
    """The sum of ``layers`` as one LayerCost (``input_bytes`` is the first layer's,
    ``output_bytes`` the last one's: what enters and leaves the slice)."""
    layers = list(layers)
    if not layers:
        raise ValueError("total() needs at least one layer")
    summed = {item.name: sum(getattr(layer, item.name) for layer in layers)
              for item in fields(LayerCost) if item.name not in ("name", "input_bytes", "output_bytes")}
    return LayerCost(name=name, input_bytes=layers[0].input_bytes, output_bytes=layers[-1].output_bytes, **summed)
