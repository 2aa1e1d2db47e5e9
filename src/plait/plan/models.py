"""The models the planner prices: an analytic transformer or a traced module, both
seen as layer groups (``plait.plan.estimate.Unit`` lists a stage boundary may not cut).

``TransformerModel`` wraps a ``TransformerSpec``: groups [embedding + block 0],
[block 1], ..., [block l-1 + head], so every pipeline chunk holds at least one block
and the embedding and head ride with the first and last. ``ModuleModel`` wraps the
per-layer costs ``plait.plan.trace`` measured on a real module at one batch size,
each layer its own group, scaled linearly to other micro-batch sizes; it runs with
tp = 1 only (tensor parallelism needs a model that knows how to shard itself, like
plait's GPT).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from plait.plan.estimate import Unit
from plait.plan.precision import Precision
from plait.plan.layers import LayerCost, check_recompute
from plait.plan.transformer import TensorParallelComm, TransformerSpec

__all__ = ["TransformerModel", "ModuleModel"]

_NO_COMM = TensorParallelComm()


@dataclass(frozen=True)
class TransformerModel:
    spec: TransformerSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_groups(self) -> int:
        return self.spec.layers

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    def describe(self) -> str:
        return self.spec.describe()

    def num_parameters(self) -> int:
        return self.spec.num_parameters()

    def tensor_parallel_problem(self, tp: int) -> str | None:
        return self.spec.tensor_parallel_problem(tp)

    def training_flops(self, batch: int, recompute: str) -> float:
        return self.spec.training_flops(batch, recompute=recompute)

    def tied_embedding_params(self, tp: int) -> int:
        return self.spec.padded_vocab(tp) // tp * self.spec.hidden if self.spec.tied_head else 0

    @property
    def end_modules(self) -> int:
        """Modules outside the layer groups at each end: the embedding before the first
        block, the head after the last (ZeRO 3 gathers each as a unit of its own)."""
        return 1

    def groups(self, micro_batch: int, tp: int, sequence_parallel: bool, precision: Precision,
               accounting: str) -> list[list[Unit]]:
        costs = self.spec.layer_costs(micro_batch, tp=tp, sequence_parallel=sequence_parallel,
                                      element_bytes=precision.element_bytes, accounting=accounting,
                                      residual_bytes=precision.residual_bytes,
                                      weight_copy_bytes=precision.weight_copy_bytes,
                                      softmax_bytes=precision.softmax_bytes)
        comm = self.spec.tensor_parallel_comm(micro_batch, tp=tp, sequence_parallel=sequence_parallel,
                                              element_bytes=precision.element_bytes)
        embedding = Unit(costs[0], comm["embedding"], False)
        head = Unit(costs[-1], comm["head"], False)
        blocks = [Unit(cost, comm["block"], True) for cost in costs[1:-1]]
        groups = [[block] for block in blocks]
        groups[0].insert(0, embedding)
        groups[-1].append(head)
        return groups


@dataclass(frozen=True)
class ModuleModel:
    """Layers traced at ``traced_batch`` samples (``plait.plan.trace.describe_layers``);
    ``flops_per_sample`` derived from them."""

    name: str
    layers: tuple[LayerCost, ...]
    traced_batch: int
    seq_len: int | None = None
    traced_element_bytes: int = 4
    uneven = True  # its stages are split by Alpa's DP (plait.plan.search)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a ModuleModel needs at least one traced layer")
        if isinstance(self.traced_batch, bool) or not isinstance(self.traced_batch, int) or self.traced_batch < 1:
            raise ValueError(f"traced_batch={self.traced_batch!r} must be a whole number >= 1")

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    def describe(self) -> str:
        return (f"{self.name}: {self.num_parameters():,} parameters in {len(self.layers)} traced layers "
                f"({self.training_flops(1, 'none'):.3g} FLOPs per sample per step)")

    def num_parameters(self) -> int:
        return sum(layer.params for layer in self.layers)

    def tensor_parallel_problem(self, tp: int) -> str | None:
        if tp == 1:
            return None
        return (f"tp={tp}: a traced module has no tensor-parallel split; use tp=1 (tensor parallelism needs a "
                "model that shards itself, such as --model gpt)")

    def training_flops(self, batch: int, recompute: str) -> float:
        """A traced layer has no attention core of its own: selective recomputes nothing."""
        check_recompute(recompute)
        scale = batch / self.traced_batch
        flops = sum(layer.forward_flops + layer.backward_flops for layer in self.layers)
        if recompute == "full":
            flops += sum(layer.forward_flops for layer in self.layers)
        return flops * scale

    def tied_embedding_params(self, tp: int) -> int:
        return 0

    @property
    def end_modules(self) -> int:
        """Every traced layer is a group of its own: nothing outside them."""
        return 0

    def groups(self, micro_batch: int, tp: int, sequence_parallel: bool, precision: Precision,
               accounting: str) -> list[list[Unit]]:
        problem = self.tensor_parallel_problem(tp)
        if problem:
            raise ValueError(problem)
        scale = micro_batch / self.traced_batch
        # activations, boundaries and non-matmul traffic move to the planned precision's
        # element size (the trace ran in its own dtype); FLOPs and kernels do not change
        ratio = precision.element_bytes / self.traced_element_bytes
        return [[Unit(replace(layer.scaled(scale), forward_bytes=layer.forward_bytes * scale * ratio,
                              backward_bytes=layer.backward_bytes * scale * ratio,
                              activation_bytes=layer.activation_bytes * scale * ratio,
                              input_bytes=layer.input_bytes * scale * ratio,
                              output_bytes=layer.output_bytes * scale * ratio), _NO_COMM, True)]
                for layer in self.layers]
