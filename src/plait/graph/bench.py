"""Measure a graph rewrite: equivalence, latency and throughput before/after, and the peers.

Equivalence. For each output tensor (a model may return a tensor or nested tuples, lists
and dicts of them) the relative error is ‖out − ref‖₂ / ‖ref‖₂; a model's error is the
largest over its outputs. Tolerances (RELATIVE_TOLERANCE): a fold reorders a few
roundings per output element (e.g. (x·W)·γ/σ becomes x·(W·γ/σ)); each costs at most the
unit roundoff u (float32 u = 2⁻²⁴ ≈ 6e-8, float64 u = 2⁻⁵³ ≈ 1.1e-16), and through a few
dozen layers of a well-conditioned network the norm-wise error stays within ~10²·u:
1e-5 for float32 and 1e-12 for float64 leave about 100x of headroom over that. A
rewrite that changes the function (a wrong fold) gives errors of order 1e-2..1.

Timing (torch.inference_mode, torch's default thread count: the machine's cores). Each
variant is called ``iterations`` times per sample so one sample lasts at least
``sample_s`` (calibrated on the first variant), the variants alternate within every
repeat (the order rotated each repeat, so none always runs first after another's cache
footprint), and each reports the median per-call latency over ``repeats`` samples with
its spread (min..max). Throughput = batch / median latency (items per second). A
speedup is paired: the median over the repeats of baseline sample / variant sample from
the same repeat, so a slow spell of the machine (another process, a frequency change)
that lasts a few repeats hits both sides of a ratio rather than one.

Peers, on the same model in the same run:
- ``torch.fx.experimental.optimization.fuse`` folds Conv{1,2,3}d + BatchNorm and
  Linear + BatchNorm1d. It traces with ``torch.fx.symbolic_trace``; where that fails
  (a model needing leaf modules) it is given a fresh GraphModule over plait's leaf-traced
  graph (``no_trace=True, inplace=True``: the new module's containers are its own, the
  leaf modules shared and never modified, since fuse builds new fused modules).
  It replaces the conv MODULE, so a conv called at two sites is folded at both: wrong.
- ``torch.ao.quantization.fuse_modules`` fuses the module names it is given. The names
  are found the way a user reading the traced graph would list them: every chain of
  module calls Conv/Linear -> BatchNorm (-> nn.ReLU), each module called at one site
  (a name shared by several calls cannot be fused by name). It does not look at the
  graph, so where the conv's output is also used elsewhere (pytorch#104593) it is wrong.
Both peers' outputs are checked against the original's like plait's.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.ao.quantization
import torch.fx.experimental.optimization
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
DEFAULT_REPEATS = 7
DEFAULT_WARMUP_CALLS = 3
DEFAULT_SAMPLE_S = 0.05  # seconds each timing sample lasts at least

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
# (first, batchnorm) pairs torch.ao.quantization.fuse_modules knows, by dimension
FUSABLE_PAIRS = ((nn.Conv1d, nn.BatchNorm1d), (nn.Conv2d, nn.BatchNorm2d), (nn.Conv3d, nn.BatchNorm3d),
                 (nn.Linear, nn.BatchNorm1d))


def tolerance_for(dtype: torch.dtype) -> float:
    """The relative-error tolerance of the equivalence check for outputs of ``dtype``."""
    if dtype not in RELATIVE_TOLERANCE:
        raise ValueError(f"no equivalence tolerance for {dtype}: the outputs must be float32 or float64 "
                         f"(use --dtype float32 or --dtype float64)")
    return RELATIVE_TOLERANCE[dtype]


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors of a model's output, in order (tensor, or nested tuple/list/dict of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [tensor for key in output for tensor in output_tensors(output[key])]
    if isinstance(output, (tuple, list)):
        return [tensor for item in output for tensor in output_tensors(item)]
    return []


def run_model(model: nn.Module, inputs: tuple):
    """One inference call (torch.inference_mode)."""
    with torch.inference_mode():
        return model(*inputs)


@dataclass(frozen=True)
class Difference:
    """How far a model's output is from the reference: the largest relative error
    ‖out − ref‖/‖ref‖ over the output tensors, and the single element that differs most."""

    relative_error: float
    tolerance: float
    max_abs_difference: float
    where: str  # e.g. "output 0 [1, 3]" or "output 0: shape (2, 10) vs (2, 5)"
    reference_value: float
    value: float

    @property
    def ok(self) -> bool:
        return self.relative_error <= self.tolerance

    def describe(self) -> str:
        verdict = "ok" if self.ok else "OUTPUTS CHANGED"
        text = f"relative error {self.relative_error:.3g} (tolerance {self.tolerance:g}): {verdict}"
        if not self.ok:
            text += (f"; largest difference {self.max_abs_difference:.6g} at {self.where}: "
                     f"reference {self.reference_value:.8g}, got {self.value:.8g}")
        return text

    def as_dict(self) -> dict:
        return {"relative_error": self.relative_error, "tolerance": self.tolerance, "ok": self.ok,
                "max_abs_difference": self.max_abs_difference, "where": self.where,
                "reference_value": self.reference_value, "value": self.value}


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    difference = float(torch.linalg.vector_norm((value - reference).double()))
    scale = float(torch.linalg.vector_norm(reference.double()))
    if math.isnan(difference):
        return math.inf
    if scale == 0.0:
        return 0.0 if difference == 0.0 else math.inf
    return difference / scale


def compare_outputs(reference, output, tolerance: float) -> Difference:
    """The Difference of ``output`` from ``reference`` (both raw model outputs)."""
    references, values = output_tensors(reference), output_tensors(output)
    if len(references) != len(values):
        return Difference(math.inf, tolerance, math.inf,
                          f"{len(values)} output tensors instead of {len(references)}", math.nan, math.nan)
    worst = Difference(0.0, tolerance, 0.0, "no output tensors", math.nan, math.nan)
    for index, (ref, value) in enumerate(zip(references, values)):
        if ref.shape != value.shape:
            return Difference(math.inf, tolerance, math.inf,
                              f"output {index}: shape {tuple(value.shape)} instead of {tuple(ref.shape)}",
                              math.nan, math.nan)
        error = _relative_error(value, ref)
        if ref.numel() == 0 or (error <= worst.relative_error and index > 0):
            continue
        absolute = (value.double() - ref.double()).abs().nan_to_num(nan=math.inf)
        flat = int(absolute.argmax())
        position = [int(i) for i in torch.unravel_index(torch.tensor(flat), ref.shape)]
        worst = Difference(error, tolerance, float(absolute.flatten()[flat]), f"output {index} {position}",
                           float(ref.flatten()[flat]), float(value.flatten()[flat]))
    return worst


@dataclass(frozen=True)
class Timing:
    """Per-call latency samples of one variant (seconds) at ``batch`` items per call."""

    name: str
    batch: int
    latencies_s: tuple[float, ...]
    iterations: int  # calls per sample

    @property
    def median_s(self) -> float:
        ordered = sorted(self.latencies_s)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    @property
    def min_s(self) -> float:
        return min(self.latencies_s)

    @property
    def max_s(self) -> float:
        return max(self.latencies_s)

    @property
    def throughput_per_s(self) -> float:
        return self.batch / self.median_s

    def as_dict(self) -> dict:
        return {"name": self.name, "batch": self.batch, "median_s": self.median_s, "min_s": self.min_s,
                "max_s": self.max_s, "throughput_per_s": self.throughput_per_s, "iterations": self.iterations,
                "latencies_s": list(self.latencies_s)}


def paired_speedup(baseline: Timing, variant: Timing) -> float:
    """Median over the repeats r of baseline.latencies_s[r] / variant.latencies_s[r]."""
    if len(baseline.latencies_s) != len(variant.latencies_s):
        raise ValueError(f"paired_speedup needs samples from the same repeats: {baseline.name} has "
                         f"{len(baseline.latencies_s)}, {variant.name} {len(variant.latencies_s)}")
    ratios = tuple(b / v for b, v in zip(baseline.latencies_s, variant.latencies_s))
    return Timing("ratio", 1, ratios, 1).median_s


def iterations_for(call_s: float, sample_s: float) -> int:
    """Calls per timing sample so that one sample lasts at least ``sample_s``."""
    if call_s <= 0:
        return 1
    return max(1, math.ceil(sample_s / call_s))


def measure_latency(models: dict[str, nn.Module], inputs: tuple, batch: int, *, repeats: int = DEFAULT_REPEATS,
                    warmup_calls: int = DEFAULT_WARMUP_CALLS, sample_s: float = DEFAULT_SAMPLE_S
                    ) -> dict[str, Timing]:
    """Median-of-``repeats`` per-call latency of each model, the models alternating (see the
    module docstring). ``batch`` is the number of items one call processes."""
    if repeats < 1 or warmup_calls < 0 or sample_s < 0:
        raise ValueError(f"repeats={repeats} must be >= 1, warmup_calls={warmup_calls} and sample_s={sample_s} "
                         f">= 0")
    if not models:
        raise ValueError("measure_latency needs at least one model")
    names = list(models)
    with torch.inference_mode():
        for model in models.values():
            for _ in range(warmup_calls):
                model(*inputs)
        start_s = time.perf_counter()
        models[names[0]](*inputs)
        iterations = iterations_for(time.perf_counter() - start_s, sample_s)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for repeat in range(repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for name in order:
                model = models[name]
                start_s = time.perf_counter()
                for _ in range(iterations):
                    model(*inputs)
                samples[name].append((time.perf_counter() - start_s) / iterations)
    return {name: Timing(name, batch, tuple(samples[name]), iterations) for name in names}


def counted_flops(model: nn.Module, inputs: tuple) -> int:
    """FLOPs of one forward as torch.utils.flop_counter counts them (matmuls, convs and
    attention only: elementwise work such as BatchNorm is not counted). Under no_grad, not
    inference_mode: FlopCounterMode's module hooks need ordinary tensors."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    return int(counter.get_total_flops())


@dataclass
class Peer:
    """A peer optimizer's result on the model: its module, or why it was skipped."""

    name: str
    module: nn.Module | None
    detail: str  # what it did (or why it was skipped)

    @property
    def skipped(self) -> bool:
        return self.module is None


def fx_fuse_peer(module: nn.Module, traced: fx.GraphModule) -> Peer:
    """torch.fx.experimental.optimization.fuse on ``module``; on plait's leaf-traced graph
    ``traced`` where symbolic_trace cannot trace the module."""
    name = "torch.fx fuse"
    try:
        return Peer(name, torch.fx.experimental.optimization.fuse(module), "fuse(model)")
    except Exception as error:  # symbolic_trace raises TraceError, TypeError, ... by construct
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        try:
            fresh = fx.GraphModule(traced, copy.deepcopy(traced.graph))
            fused = torch.fx.experimental.optimization.fuse(fresh, inplace=True, no_trace=True)
        except Exception as second:
            return Peer(name, None, f"skipped: fuse failed ({type(second).__name__}: {second})")
        return Peer(name, fused, f"fuse(plait's leaf-traced graph, no_trace=True): symbolic_trace fails "
                                 f"({type(error).__name__}: {first_line})")


def fuse_modules_groups(traced: fx.GraphModule) -> list[list[str]]:
    """The name lists to give torch.ao.quantization.fuse_modules: each chain of module calls
    Conv/Linear -> BatchNorm (-> nn.ReLU) in ``traced``, every module in it called at one
    site only. The conv's other users are NOT checked: fuse_modules does not look at them."""
    modules = dict(traced.named_modules())
    sites: dict[str, int] = {}
    for node in traced.graph.nodes:
        if node.op == "call_module":
            sites[node.target] = sites.get(node.target, 0) + 1

    def single_call(node) -> bool:
        return isinstance(node, fx.Node) and node.op == "call_module" and sites[node.target] == 1

    groups = []
    for node in traced.graph.nodes:
        if not (single_call(node) and node.args and single_call(node.args[0])):
            continue
        first, norm = modules[node.args[0].target], modules[node.target]
        if not any(type(first) is a and type(norm) is b for a, b in FUSABLE_PAIRS):
            continue
        group = [node.args[0].target, node.target]
        relus = [user for user in node.users if single_call(user) and type(modules[user.target]) is nn.ReLU]
        if isinstance(first, CONV_TYPES) and len(node.users) == 1 and relus:  # no Linear+BN+ReLU fuser
            group.append(relus[0].target)
        groups.append(group)
    return groups


def fuse_modules_peer(module: nn.Module, traced: fx.GraphModule) -> Peer:
    """torch.ao.quantization.fuse_modules with the groups fuse_modules_groups finds."""
    name = "fuse_modules"
    groups = fuse_modules_groups(traced)
    if not groups:
        return Peer(name, None, "skipped: no Conv/Linear -> BatchNorm (-> ReLU) module chains to name")
    if module.training:
        return Peer(name, None, "skipped: the model is in training mode (fuse_modules would prepare QAT)")
    try:
        fused = torch.ao.quantization.fuse_modules(module, groups)
    except Exception as error:
        return Peer(name, None, f"skipped: fuse_modules failed ({type(error).__name__}: {error})")
    shown = ", ".join("+".join(group) for group in groups[:3]) + (", ..." if len(groups) > 3 else "")
    return Peer(name, fused, f"{len(groups)} groups: {shown}")


def format_latency(timing: Timing) -> str:
    """'1.234 ms (1.200-1.300)': the median and the spread of the samples."""
    return f"{timing.median_s * 1e3:.3f} ms ({timing.min_s * 1e3:.3f}-{timing.max_s * 1e3:.3f})"
