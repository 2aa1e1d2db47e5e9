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

A layer may also carry the shapes of its forward's matmuls (``forward_matmuls``), so
a device calibrated per shape (``plait.plan.device_profile``) prices each product at
its own efficiency rather than one constant η. The backward of a product (m, n, k),
C[m, n] = A[m, k]·B[k, n], is its input gradient (m, k, n) and its weight gradient
(k, n, m) (``backward_matmuls``, ``weight_gradient_matmuls``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from plait.names.recompute import RECOMPUTE_MODES

__all__ = ["RECOMPUTE_MODES", "MATMUL_KINDS", "LayerCost", "check_recompute", "total", "matmul_flops",
           "backward_matmuls", "weight_gradient_matmuls"]

# a matmul entry: (kind, count, m, n, k); "gemm" a plain product (m the token dimension),
# "bmm" a batched one of ``count`` independent products (attention's QKᵀ and PV)
MATMUL_KINDS = ("gemm", "bmm")


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
    - ``forward_matmuls``: the forward's matmuls as (kind, count, m, n, k), kind "gemm"
      (count 1, m the token dimension) or "bmm" (``count`` products, the attention
      core's); empty when unknown (a traced layer). When given, Σ count·2mnk is
      ``forward_flops`` and the "bmm" entries are the core selective recomputation
      re-runs.
    - ``param_tensors`` / ``matrix_tensors``: how many tensors hold ``params`` (and of
      them, of >= 2 dims): an eager optimizer launches its kernels per tensor
      (``plait.plan.trainer_calls``); 0 when not known.
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
    forward_matmuls: tuple = ()
    param_tensors: int = 0  # parameter tensors (weights, biases); 0: not known
    matrix_tensors: int = 0  # of those, the ones of >= 2 dims (decoupled weight decay steps them)

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.name, str) or not self.name:
            problems.append(f"name={self.name!r} must be a non-empty string")
        for item in fields(self):
            if item.name in ("name", "forward_matmuls"):
                continue
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                problems.append(f"{item.name}={value!r} must be a finite number >= 0")
        problems += _matmul_problems(self.forward_matmuls)
        if problems:
            raise ValueError(f"invalid LayerCost {self.name!r}: " + "; ".join(problems))

    def scaled(self, factor: float) -> "LayerCost":
        """The same layer on ``factor`` times the micro-batch: FLOPs, bytes and
        activations scale, kernel counts and parameters do not; a gemm's token
        dimension m and a bmm's count scale."""
        if not (isinstance(factor, (int, float)) and factor > 0 and math.isfinite(factor)):
            raise ValueError(f"factor={factor!r} must be a finite number > 0")
        return replace(self, forward_flops=self.forward_flops * factor, backward_flops=self.backward_flops * factor,
                       forward_bytes=self.forward_bytes * factor, backward_bytes=self.backward_bytes * factor,
                       activation_bytes=self.activation_bytes * factor, input_bytes=self.input_bytes * factor,
                       output_bytes=self.output_bytes * factor,
                       core_activation_bytes=self.core_activation_bytes * factor,
                       post_core_bytes=self.post_core_bytes * factor,
                       core_forward_flops=self.core_forward_flops * factor,
                       core_forward_bytes=self.core_forward_bytes * factor,
                       forward_matmuls=tuple((kind, count * factor, m, n, k) if kind == "bmm"
                                             else (kind, count, m * factor, n, k)
                                             for kind, count, m, n, k in self.forward_matmuls))


def total(layers, name: str = "total") -> LayerCost:
    """The sum of ``layers`` as one LayerCost (``input_bytes`` is the first layer's,
    ``output_bytes`` the last one's: what enters and leaves the slice; the matmul
    shapes are concatenated)."""
    layers = list(layers)
    if not layers:
        raise ValueError("total() needs at least one layer")
    summed = {item.name: sum(getattr(layer, item.name) for layer in layers)
              for item in fields(LayerCost) if item.name not in ("name", "input_bytes", "output_bytes",
                                                                 "forward_matmuls")}
    return LayerCost(name=name, input_bytes=layers[0].input_bytes, output_bytes=layers[-1].output_bytes,
                     forward_matmuls=tuple(entry for layer in layers for entry in layer.forward_matmuls), **summed)


def matmul_flops(matmuls) -> float:
    """Σ count·2·m·n·k of (kind, count, m, n, k) entries."""
    return sum(2.0 * count * m * n * k for _, count, m, n, k in matmuls)


def backward_matmuls(matmuls) -> tuple:
    """The backward's products of forward ``matmuls``: each (m, n, k)'s input gradient
    (m, k, n) and weight gradient (k, n, m), a bmm's both with its count."""
    return tuple(entry for kind, count, m, n, k in matmuls
                 for entry in ((kind, count, m, k, n), (kind, count, k, n, m)))


def weight_gradient_matmuls(matmuls) -> tuple:
    """The weight-gradient half of ``backward_matmuls``: (k, n, m) of each (m, n, k)
    (for a bmm the gradient of its second operand, which zero_bubble defers alike)."""
    return tuple((kind, count, k, n, m) for kind, count, m, n, k in matmuls)


def _matmul_problems(matmuls) -> list[str]:
    if not isinstance(matmuls, tuple):
        return [f"forward_matmuls={matmuls!r} must be a tuple of (kind, count, m, n, k)"]
    problems = []
    for entry in matmuls:
        if not (isinstance(entry, tuple) and len(entry) == 5 and entry[0] in MATMUL_KINDS
                and all(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                        for v in entry[1:])):
            problems.append(f"forward_matmuls entry {entry!r} must be (kind in {'/'.join(MATMUL_KINDS)}, "
                            "count, m, n, k) with finite numbers > 0")
    return problems
