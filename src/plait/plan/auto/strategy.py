"""One sharding choice of one operator, with what it costs on a mesh.

Costs are per device and per training step (forward + backward), in seconds and bytes:

- ``compute_s``: the operator's forward and backward kernels on its local shard;
- ``comm_s``: collectives the operator needs whatever its neighbours do: a gradient
  all-reduce of a parameter replicated along an axis the operator splits (data
  parallelism's), and the backward all-reduce of an input replicated along an axis the
  operator splits (Megatron's column-parallel input gradient);
- ``memory_bytes``: its parameters (+ gradients and optimizer state) and the
  activations it saves for backward, on one device.

Resharding between operators is priced separately, on the edges
(``plait.plan.auto.reshard_cost``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.names.placements import layout_text

__all__ = ["Strategy"]


@dataclass(frozen=True)
class Strategy:
    """``name`` (e.g. "column@1", "batch@0"), the ``output`` layout, one layout per
    ``inputs`` entry of the node, ``params`` ((parameter name, layout) pairs) and the
    costs above."""

    name: str
    output: tuple[str, ...]
    inputs: tuple[tuple[str, ...], ...]
    params: tuple[tuple[str, tuple[str, ...]], ...]
    compute_s: float
    comm_s: float
    memory_bytes: float

    def __post_init__(self) -> None:
        for key in ("compute_s", "comm_s", "memory_bytes"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"strategy {self.name!r}: {key}={value!r} must be finite and >= 0")

    def param_layout(self, name: str) -> tuple[str, ...]:
        return dict(self.params)[name]

    def text(self) -> str:
        return f"{self.name}: out {layout_text(self.output)}"
