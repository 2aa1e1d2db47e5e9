"""Price tensor parallelism of a user's model from the plan the trainer applies.

``PlannedModel`` is the planner's model (``TransformerModel``'s protocol, for
``plait.plan.search``) of a ``plait.plan.tp_trace.PlanTrace``: one traced forward and
backward of the unsharded model at micro-batch b0 under the plan that
``plait.parallel.tensor.parallelize`` applies. For micro-batch b, tp degree t and
sequence parallelism, one rank's cost of each layer is

    x_t = x_replicated + x_sequence / (t if sequence parallel else 1) + x_sharded / t

for matmul FLOPs, memory traffic and saved activations (kernel counts do not shrink;
parameters: replicated + sharded / t; under sequence parallelism a colwise module's
saved input is its all-gathered copy, kept whole). Given a second trace at b1 > b0
(``plan_model`` makes both), each figure is the straight line through the two, x(b) =
x(b0) + (b - b0)·(x(b1) - x(b0))/(b1 - b0), so what does not grow with the batch (a
causal mask, rotary tables, positions) stays put; with one trace x(b) = x(b0)·b/b0.
A trace run under torch.autocast (``plan_model(..., autocast=)``: plait train's mixed
precision) holds the bytes that precision keeps; otherwise bytes are scaled by the
planned element size over the traced one, as ``ModuleModel``.

Collectives per micro-batch, from each planned module's run, each call of the whole
tensor's bytes (DESIGN §6: a colwise/rowwise pair is Megatron's all-reduce forward and
one backward):
- colwise: backward all-reduce of its input gradient; under sequence parallelism a
  forward all-gather of its input and a backward reduce-scatter (unless its input is
  replicated); with ``gather_output`` a forward all-gather of the output (the backward
  keeps this rank's slice: no call). Each colwise module syncs its own input gradient,
  as torch's ColwiseParallel and plait's ColwiseLinear do (Llama's q, k, v: three).
- rowwise: forward all-reduce of the output; under sequence parallelism a forward
  reduce-scatter, a backward all-gather, and an all-reduce of its bias's gradient.
- vocab: forward all-reduce (a reduce-scatter and backward all-gather when its output
  is sequence-sharded).
- sequence (under sequence parallelism only): an ``entry``'s backward all-gather, an
  ``exit``'s forward all-gather, and one all-reduce per parameter gradient.
Full recomputation repeats the forward's. Layers are grouped as ``TransformerModel``
groups a GPT: [before + block 0], [block 1], ..., [block l-1 + after], so every
pipeline stage holds at least one block; full recomputation re-runs the blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from plait.plan.estimate import Unit
from plait.plan.layers import LayerCost, check_recompute
from plait.plan.precision import Precision
from plait.plan.tp_trace import PlanTrace, TracedLayer, trace_plan
from plait.plan.transformer import TensorParallelComm

__all__ = ["PlannedModel", "plan_model", "layer_at", "plan_lines", "step_collectives"]


def _collectives(layer: TracedLayer, tp: int, sp: bool, scale: float, grad_ratio: float) -> TensorParallelComm:
    """The layer's tp collectives per micro-batch (the module docstring): activation bytes
    x ``scale``, a sequence-parallel parameter gradient's bytes x ``grad_ratio``."""
    if tp == 1:
        return TensorParallelComm()
    forward, backward = [], []
    for kind, in_bytes, input_grad, out_bytes, param_bytes, flags in layer.collectives:
        in_bytes, out_bytes = in_bytes * scale, out_bytes * scale
        param_sums = [("all_reduce", nbytes * grad_ratio) for nbytes in param_bytes]  # one call per parameter
        if kind == "colwise":
            if sp and "input_replicated" not in flags:
                forward.append(("all_gather", in_bytes))
                backward.append(("reduce_scatter", in_bytes))
            elif input_grad:
                backward.append(("all_reduce", in_bytes))
            if "gather" in flags:  # its backward keeps this rank's slice: no call
                forward.append(("all_gather", out_bytes))
        elif kind == "rowwise" and sp and "output_replicated" not in flags \
                or kind == "vocab" and sp and "output_sequence" in flags:
            forward.append(("reduce_scatter", out_bytes))
            backward.append(("all_gather", out_bytes))
            backward += param_sums  # a bias added on the sequence shard
        elif kind in ("rowwise", "vocab"):
            forward.append(("all_reduce", out_bytes))
        elif sp:  # a sequence module: split on entry (the backward gathers), gathered at the exit
            backward += [("all_gather", in_bytes)] if "entry" in flags else []
            forward += [("all_gather", out_bytes)] if "exit" in flags else []
            backward += param_sums
    return TensorParallelComm(forward=tuple(forward), backward=tuple(backward), recompute=tuple(forward))


def layer_at(layer: TracedLayer, tp: int, sequence_parallel: bool) -> LayerCost:
    """One rank's cost of ``layer`` at the traced micro-batch and dtype (module docstring)."""
    rep, seq, sharded = (layer.parts[key] for key in ("replicated", "sequence", "sharded"))
    seq_div = tp if sequence_parallel and tp > 1 else 1

    def mix(key: str) -> float:
        return getattr(rep, key) + getattr(seq, key) / seq_div + getattr(sharded, key) / tp

    if seq_div > 1:  # what a colwise module saved is its gathered copy: whole
        sequence_acts = layer.sequence_elsewhere_bytes / seq_div + layer.gathered_bytes
    else:
        sequence_acts = seq.activation_bytes
    boundary = {key: getattr(rep, key) / (seq_div if in_sequence else 1)
                for key, in_sequence in (("input_bytes", layer.input_sequence),
                                         ("output_bytes", layer.output_sequence))}
    return LayerCost(name=layer.name, params=rep.params + sharded.params / tp,
                     forward_flops=mix("forward_flops"), backward_flops=mix("backward_flops"),
                     forward_kernels=rep.forward_kernels, backward_kernels=rep.backward_kernels,
                     forward_bytes=mix("forward_bytes"), backward_bytes=mix("backward_bytes"),
                     activation_bytes=rep.activation_bytes + sequence_acts + sharded.activation_bytes / tp,
                     **boundary)


@dataclass(frozen=True)
class PlannedModel:
    """The planner's model protocol (``TransformerModel``'s) for a traced plan."""

    trace: PlanTrace
    larger: PlanTrace | None = None  # the same model traced at a larger micro-batch (the module docstring)
    uneven = True  # its stages are split by Alpa's DP (plait.plan.search)

    @property
    def name(self) -> str:
        return self.trace.name

    @property
    def seq_len(self) -> int | None:
        return self.trace.seq_len

    @property
    def num_groups(self) -> int:
        layers = len(self.trace.layers)
        return layers - 2 if self.trace.with_ends else layers

    @property
    def end_modules(self) -> int:
        """Layers outside the blocks at each end (ZeRO 3 gathers each as a unit)."""
        return 1 if self.trace.with_ends else 0

    def num_parameters(self) -> int:
        return int(sum(layer.parts["replicated"].params + layer.parts["sharded"].params
                       for layer in self.trace.layers))

    def plan_text(self) -> str:
        return ", ".join(f"{count} {kind}" for kind, count in self.trace.kinds) or "no modules"

    def describe(self) -> str:
        return (f"{self.name}: {self.num_parameters():,} parameters, {self.num_groups} blocks, tp plan of "
                f"{self.plan_text()} ({self.training_flops(1, 'none'):.3g} FLOPs per sample per step)")

    def tensor_parallel_problem(self, tp: int) -> str | None:
        if tp == 1:
            return None
        if not any(kind in ("colwise", "rowwise", "vocab") for kind, _ in self.trace.kinds):
            return f"tp={tp}: the plan shards no module (no colwise, rowwise or vocab entry); use tp=1"
        bad = [f"{what}={size}" for what, size in self.trace.tp_sizes if size % tp]
        if not bad:
            return None
        common = math.gcd(*(size for _, size in self.trace.tp_sizes))
        valid = [d for d in range(1, common + 1) if common % d == 0]
        return f"tp={tp} does not divide {', '.join(bad[:4])} (valid tp: {', '.join(map(str, valid))})"

    def training_flops(self, batch: int, recompute: str) -> float:
        """Matmul FLOPs of the unsharded model on ``batch`` samples: forward and backward,
        plus the blocks' forward again under full recomputation (selective: none)."""
        check_recompute(recompute)
        flops = 0.0
        for layer in self.trace.layers:
            cost = layer_at(layer, 1, False)
            flops += cost.forward_flops + cost.backward_flops
            if recompute == "full" and layer.recomputable:
                flops += cost.forward_flops
        return flops * batch / self.trace.traced_batch

    def tied_embedding_params(self, tp: int) -> int:
        """Parameters the first and last layer share (a tied head), on one tp rank."""
        return int(sum(numel / (tp if sharded else 1) for numel, sharded in self.trace.tied))

    def _at_batch(self, micro_batch: int, cost: LayerCost, cost_larger: LayerCost | None) -> LayerCost:
        """``cost`` (traced at b0) at ``micro_batch``: on the line through the two traces,
        or scaled by b/b0 with one (the module docstring)."""
        if cost_larger is None:
            return cost.scaled(micro_batch / self.trace.traced_batch)
        b0, b1 = self.trace.traced_batch, self.larger.traced_batch
        weight = (micro_batch - b0) / (b1 - b0)
        fixed = ("name", "params", "forward_kernels", "backward_kernels", "forward_matmuls")
        return replace(cost, **{item.name: max(0.0, getattr(cost, item.name) + weight * (
            getattr(cost_larger, item.name) - getattr(cost, item.name))) for item in fields(LayerCost)
            if item.name not in fixed})

    def groups(self, micro_batch: int, tp: int, sequence_parallel: bool, precision: Precision,
               accounting: str) -> list[list[Unit]]:
        problem = self.tensor_parallel_problem(tp)
        if problem:
            raise ValueError(problem)
        scale = micro_batch / self.trace.traced_batch
        # a trace under autocast kept its precision's own mix of 16- and 32-bit tensors
        ratio = 1.0 if self.trace.autocast else precision.element_bytes / self.trace.element_bytes
        units = []
        larger = self.larger.layers if self.larger is not None else [None] * len(self.trace.layers)
        for layer, layer_larger in zip(self.trace.layers, larger):
            cost = self._at_batch(micro_batch, layer_at(layer, tp, sequence_parallel),
                                  None if layer_larger is None else layer_at(layer_larger, tp, sequence_parallel))
            cost = replace(cost, forward_bytes=cost.forward_bytes * ratio, backward_bytes=cost.backward_bytes * ratio,
                           activation_bytes=cost.activation_bytes * ratio, input_bytes=cost.input_bytes * ratio,
                           output_bytes=cost.output_bytes * ratio)
            comm = _collectives(layer, tp, sequence_parallel, scale * ratio,
                                precision.grad_bytes / self.trace.element_bytes)
            units.append(Unit(cost, comm, layer.recomputable))
        if not self.trace.with_ends:
            return [[unit] for unit in units]
        groups = [[unit] for unit in units[1:-1]]
        groups[0].insert(0, units[0])
        groups[-1].append(units[-1])
        return groups


def plan_model(model, sample, plan, *, name: str | None = None, autocast: str | None = None) -> PlannedModel:
    """``model`` under ``plan``, traced on ``sample`` (a tensor or a dict of keyword
    arguments; ``tp_trace.trace_plan``) and on the sample twice over (every tensor with
    the batch's first dimension repeated), so what does not grow with the batch is
    priced as such (the module docstring); ``autocast``: see ``tp_trace.trace_plan``."""
    import torch  # imported here: plait.plan loads without torch

    def doubled(value, batch):
        if isinstance(value, dict):
            return {key: doubled(item, batch) for key, item in value.items()}
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            return torch.cat([value, value])
        return value

    first = trace_plan(model, sample, plan, name=name, autocast=autocast)
    return PlannedModel(first, trace_plan(model, doubled(sample, first.traced_batch), plan, name=name,
                                          autocast=autocast))


def step_collectives(model: PlannedModel, layout, precision: Precision) -> dict[str, tuple[int, float]]:
    """{collective: (calls, bytes)} one tp rank makes in one optimizer step of
    ``layout`` (m micro-batches: forward, backward and, under full recomputation, the
    blocks' forward again), each call's bytes those of the whole tensor."""
    totals: dict[str, list] = {}
    for group in model.groups(layout.micro_batch, layout.tp, layout.sequence_parallel, precision, "plait"):
        for unit in group:
            calls = list(unit.comm.forward) + list(unit.comm.backward)
            if layout.recompute == "full" and unit.recomputable:
                calls += list(unit.comm.recompute)
            for collective, nbytes in calls:
                entry = totals.setdefault(collective, [0, 0.0])
                entry[0] += layout.num_microbatches
                entry[1] += nbytes * layout.num_microbatches
    return {name: (calls, nbytes) for name, (calls, nbytes) in sorted(totals.items())}


def plan_lines(model: PlannedModel, layout, precision: Precision) -> list[str]:
    """What the plan costs one tp rank at ``layout``: the modules per style, the sharded
    share of the matmul FLOPs and parameters, and the collectives of one step."""
    tp, sp = layout.tp, layout.sequence_parallel
    layers = model.trace.layers
    whole = sum(layer.parts[key].forward_flops for layer in layers for key in ("replicated", "sequence", "sharded"))
    split = sum(layer.parts["sharded"].forward_flops for layer in layers)
    params = sum(layer.parts["sharded"].params for layer in layers)
    lines = [f"tensor-parallel plan ({model.plan_text()}) at tp={tp}{' with sequence parallelism' if sp else ''}:",
             f"  matmul FLOPs split over tp: {100 * split / whole if whole else 0:.1f}% (the rest replicated on "
             f"every tp rank); parameters sharded: {params:,.0f} of {model.num_parameters():,} "
             f"({params / tp:,.0f} per rank)"]
    collectives = step_collectives(model, layout, precision)
    if not collectives:
        lines.append("  no tensor-parallel collectives (tp=1)")
    for name, (calls, nbytes) in collectives.items():
        lines.append(f"  {name} per step: {calls:,} calls of {nbytes:,.0f} bytes in all ({nbytes / 2**20:,.1f} MiB; "
                     "each call's whole tensor)")
    return lines
