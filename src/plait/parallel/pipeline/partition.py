"""Stage partitioning: split a sequential model into contiguous pipeline chunks.

A model is a list of L layers run one after another (``sequential_layers`` makes
one from an ``nn.Sequential`` or a plait GPT). ``split_layers`` cuts it into
S = stages·virtual contiguous, non-empty chunks in pipeline order, minimising the
most expensive chunk: with c_i the cost of layer i and boundaries
0 = b_0 < b_1 < ... < b_S = L, it picks

    argmin_b  max_k  sum_{b_k <= i < b_{k+1}} c_i

because a pipeline runs at the pace of its slowest stage. Costs are parameter
counts, analytic forward FLOPs or measured forward+backward times
(``layer_costs``), or the caller gives layers per chunk outright.

Placement follows Megatron-LM's interleaving: chunk c lives on rank c mod stages,
so rank r holds chunks r, r + stages, ..., r + (virtual-1)·stages and a
micro-batch visits every rank ``virtual`` times (virtual = 1: chunk c = rank c).
"""

from __future__ import annotations

import abc
import math
import numbers
import statistics
import time
from collections import OrderedDict

import torch
from torch import nn

from plait.parallel.tensor import (
    ColumnParallelLinear,
    ConsistentDropout,
    ParallelAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
)

BALANCES = ("params", "flops", "time")

# Per-module forward FLOP rules (see layer_costs): f(module, input, output) -> flops.
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d,
          nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm, *([nn.RMSNorm] if hasattr(nn, "RMSNorm") else []))
_ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
                nn.Tanh, nn.Sigmoid, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softmax,
                nn.LogSoftmax, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_FREE = (nn.Embedding, VocabParallelEmbedding, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
         nn.AlphaDropout, ConsistentDropout, nn.Identity, nn.Flatten, nn.Unflatten)


def _rows(x: torch.Tensor) -> int:
    """Vectors of the last dim in ``x``: b·s for an (s, b, h) activation."""
    return x.numel() // x.shape[-1] if x.dim() else 1


def _attention_core_flops(module: ParallelAttention, x: torch.Tensor) -> int:
    """QKᵀ and PV of this rank's heads: 2 matmuls of 2·b·s²·(h/p) each."""
    sequence = x.shape[0] * (module.tp.size if module.tp.sequence_parallel else 1)
    return 4 * x.shape[1] * sequence ** 2 * module.local_heads * module.head_dim


_RULES = (
    ((nn.Linear, ColumnParallelLinear), lambda m, x, y: 2 * _rows(y) * m.weight.numel()),
    ((RowParallelLinear,), lambda m, x, y: 2 * _rows(x) * m.weight.numel()),  # output may be a (y, bias) pair
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d),
     lambda m, x, y: 2 * y.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)),
    ((ParallelAttention,), lambda m, x, y: _attention_core_flops(m, x)),  # its qkv and proj count themselves
    (_NORMS, lambda m, x, y: 5 * y.numel()),
    (_ELEMENTWISE, lambda m, x, y: y.numel()),
    (_FREE, lambda m, x, y: 0),
)


def balanced_boundaries(costs: list[float], parts: int) -> list[int]:
    """Contiguous split of ``costs`` into ``parts`` non-empty groups minimising the
    largest group sum; returns b_0 = 0 < b_1 < ... < b_parts = len(costs) (group k is
    [b_k, b_{k+1})). Exact: B* = best[parts][L] from best[k][j] = min_i max(best[k-1][i],
    c[i:j]), where best[k-1][i] rises and c[i:j] falls with i, so a bisection finds
    the crossing: O(parts·L·log L). Ties go to the earliest boundaries: among all
    splits reaching B*, the lexicographically smallest (b_1, ..., b_{parts-1}), so
    later groups take the slack."""
    values = _check_costs(costs)
    if isinstance(parts, bool) or not isinstance(parts, int):
        raise TypeError(f"parts must be an int, got {parts!r}")
    layers = len(values)
    if parts < 1:
        raise ValueError(f"parts={parts} must be at least 1")
    if parts > layers:
        raise ValueError(f"{layers} layers cannot fill {parts} parts (stages x virtual stages): use at most "
                         f"{layers} parts or a model with more layers")
    prefix = [0]
    for value in values:
        prefix.append(prefix[-1] + value)  # ints stay exact; every comparison below uses this one subtraction

    def group(i: int, j: int):
        return prefix[j] - prefix[i]

    best = [group(0, j) for j in range(layers + 1)]  # best[j]: bottleneck of [0, j) in k parts
    for k in range(2, parts + 1):
        previous, best = best, [math.inf] * (layers + 1)
        for j in (range(k, layers + 1) if k < parts else (layers,)):
            # first i in [k-1, j) with previous[i] >= group(i, j); the optimum is there or just before
            crossing = _first_true(k - 1, j, lambda i: previous[i] >= group(i, j))
            best[j] = min(max(previous[i], group(i, j)) for i in (crossing - 1, crossing) if k - 1 <= i < j)
    bottleneck = best[layers]

    # fewest groups <= bottleneck covering [i, L): greedy, each group as long as it may be
    fewest = [0] * (layers + 1)
    for i in range(layers - 1, -1, -1):
        fewest[i] = 1 + fewest[_first_true(i + 1, layers + 1, lambda j: group(i, j) > bottleneck) - 1]
    boundaries = [0]
    for remaining in range(parts - 1, 0, -1):
        # earliest cut after which [cut, L) still splits into `remaining` groups <= bottleneck
        cut = _first_true(boundaries[-1] + 1, layers + 1, lambda j: fewest[j] <= remaining)
        assert cut <= layers - remaining and group(boundaries[-1], cut) <= bottleneck, (costs, parts, cut)
        boundaries.append(cut)
    boundaries.append(layers)
    return boundaries


def _first_true(lo: int, hi: int, predicate) -> int:
    """Smallest i in [lo, hi) with predicate(i), predicate monotone false -> true; hi if none."""
    while lo < hi:
        mid = (lo + hi) // 2
        if predicate(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _check_costs(costs) -> list:
    if isinstance(costs, (str, bytes)) or not hasattr(costs, "__len__"):
        raise TypeError(f"costs must be a list of numbers, one per layer, got {type(costs).__name__}")
    wrong_type = [f"costs[{i}]={value!r}" for i, value in enumerate(costs)
                  if isinstance(value, bool) or not isinstance(value, numbers.Real)]
    if wrong_type:
        raise TypeError("costs must be real numbers: " + ", ".join(wrong_type))
    bad = [f"costs[{i}]={value}" for i, value in enumerate(costs) if not (math.isfinite(value) and value >= 0)]
    if bad:
        raise ValueError("costs must be finite and >= 0: " + ", ".join(bad))
    return [value if isinstance(value, int) else float(value) for value in costs]


def layer_costs(layers, balance: str, *, sample_input=None, repeats: int = 3) -> list[float]:
    """Cost of each layer of a sequential model, for ``balanced_boundaries``.

    - "params": parameters per layer, a parameter shared by several layers counted
      once, at its first layer.
    - "flops": forward FLOPs of one pass on ``sample_input`` (each layer fed the
      previous one's output; no_grad, eval mode, modes restored), summed by forward
      hooks. A module with a ``flops(input, output)`` method (input: its first
      argument) declares its own and its children are not counted. Otherwise:
      Linear and column/row-parallel linear 2·rows·in·out (local weight shape; bias
      adds ignored); Conv{1,2,3}d 2·out_elems·(in/groups)·prod(kernel); embeddings,
      dropout, reshapes 0; norms 5·numel; activations, softmax, pooling 1·numel (of the output);
      ParallelAttention adds 4·b·s²·h for QKᵀ and PV; a plait TransformerBlock declares
      Megatron's 2·b·s·(4h² + 2h·ffn) + 4·b·s²·h = 24·b·s·h² + 4·b·s²·h at ffn = 4h.
      Other parameter-free modules count 0 (work done by functional calls is not
      seen); a module holding parameters with no rule is refused.
    - "time": seconds of forward + backward per layer on ``sample_input`` (median of
      ``repeats`` after one warm-up; backward by autograd.grad, so no ``.grad`` is
      touched; RNG, buffers and dropout streams restored afterwards).
    """
    layers = _check_layers(layers)
    if not isinstance(balance, str):
        raise TypeError(f"balance={balance!r}: layer_costs takes 'params', 'flops' or 'time'; an explicit list "
                        f"of layers per chunk goes to split_layers")
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r} must be one of {', '.join(map(repr, BALANCES))} or a list of "
                         f"layers per chunk")
    if balance == "params":
        seen: set[int] = set()
        costs = []
        for layer in layers:
            fresh = [param for param in layer.parameters() if id(param) not in seen]
            seen.update(id(param) for param in fresh)
            costs.append(float(sum(param.numel() for param in fresh)))
        return costs
    if sample_input is None:
        raise ValueError(f"balance={balance!r} runs the layers: pass sample_input= (one micro-batch, the first "
                         f"layer's input), or use balance='params'")
    if balance == "flops":
        return _count_flops(layers, sample_input)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a positive int")
    return _time_layers(layers, sample_input, repeats)


def _check_layers(layers) -> list[nn.Module]:
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList)):
        raise TypeError(f"layers must be a list of modules, got one {type(layers).__name__}: use "
                        f"sequential_layers(model)")
    layers = list(layers)
    bad = [f"layers[{i}] is a {type(layer).__name__}" for i, layer in enumerate(layers)
           if not isinstance(layer, nn.Module)]
    if bad:
        raise TypeError("layers must all be nn.Module: " + ", ".join(bad))
    return layers


def _register_flop_hooks(module: nn.Module, name: str, add, handles: list, hooked: set[int]) -> None:
    """Hook ``module`` once (a module shared by several layers counts for the layer
    that runs it), then its children unless its count already covers them."""
    if id(module) in hooked:
        return
    hooked.add(id(module))
    declared = getattr(module, "flops", None)
    if callable(declared):
        handles.append(module.register_forward_hook(lambda m, args, out: add(declared(args[0] if args else None,
                                                                                      out))))
        return
    rule = next((rule for types, rule in _RULES if isinstance(module, types)), None)
    if rule is not None:
        handles.append(module.register_forward_hook(lambda m, args, out: add(rule(m, args[0], out))))
    elif next(module.parameters(recurse=False), None) is not None:
        raise ValueError(f"cannot estimate the FLOPs of {name} ({type(module).__name__}): give it a "
                         f"flops(input, output) method returning its forward FLOPs, or use balance='params' or "
                         f"'time'")
    for child_name, child in module.named_children():
        _register_flop_hooks(child, f"{name}.{child_name}", add, handles, hooked)


def _count_flops(layers: list[nn.Module], sample_input) -> list[float]:
    counts = [0] * len(layers)
    running = [0]  # index of the layer being run: hooks charge it

    def add(flops):
        counts[running[0]] += flops

    modes = [(module, module.training) for layer in layers for module in layer.modules()]
    handles: list = []
    hooked: set[int] = set()
    try:
        for index, layer in enumerate(layers):
            _register_flop_hooks(layer, f"layers[{index}]", add, handles, hooked)
            layer.eval()
        with torch.no_grad():
            x = sample_input
            for index, layer in enumerate(layers):
                running[0] = index
                x = _run_layer(layer, index, x)
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes:
            module.training = training
    return [float(count) for count in counts]


def _run_layer(layer: nn.Module, index: int, x):
    try:
        return layer(x)
    except Exception as error:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        error.add_note(f"while running layers[{index}] ({type(layer).__name__}) on {shape}")
        raise


def _time_layers(layers: list[nn.Module], sample_input, repeats: int) -> list[float]:
    device = sample_input.device if isinstance(sample_input, torch.Tensor) else torch.device("cpu")
    buffers = [(buffer, buffer.detach().clone()) for layer in layers for buffer in layer.buffers()]
    streams = [(module, module.calls) for layer in layers for module in layer.modules()
               if isinstance(module, ConsistentDropout)]
    costs = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            x = sample_input
            for index, layer in enumerate(layers):
                if index and isinstance(x, torch.Tensor) and x.is_floating_point():
                    x = x.detach().requires_grad_()  # a later stage sends the gradient of its input back
                inputs = [x] if isinstance(x, torch.Tensor) and x.requires_grad else []
                params = [param for param in layer.parameters() if param.requires_grad]
                times_s = []
                for _ in range(repeats + 1):  # the first is the warm-up
                    start_s = time.perf_counter()
                    output = _run_layer(layer, index, x)
                    if isinstance(output, torch.Tensor) and output.grad_fn is not None and inputs + params:
                        torch.autograd.grad(output, inputs + params, torch.ones_like(output), allow_unused=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times_s.append(time.perf_counter() - start_s)
                costs.append(statistics.median(times_s[1:]))
                x = output.detach() if isinstance(output, torch.Tensor) else output
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            for module, calls in streams:
                module.calls = calls
    return costs


def split_layers(layers, stages: int, *, balance="params", virtual: int = 1, sample_input=None) -> list[list[int]]:
    """Layer indices of each of the stages·virtual model chunks, in pipeline order;
    chunk c runs on rank c mod stages (Megatron's interleaving). ``balance`` is
    "params", "flops" or "time" (see ``layer_costs``; the last two run
    ``sample_input``) for a min-max split (``balanced_boundaries``), or a list of
    layers per chunk."""
    layers = _check_layers(layers)
    for name, value in (("stages", stages), ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    chunks, count = stages * virtual, len(layers)
    if count < chunks:
        if virtual == 1:
            fix = f"use at most {count} stages"
        else:
            options = [f"at most {count // virtual} stages with virtual={virtual}"] if count >= virtual else []
            options += [f"virtual <= {count // stages} with {stages} stages"] if count >= stages else []
            fix = "use " + ", or ".join(options + [f"virtual=1 with at most {count} stages"])
        chunk_text = f" x {virtual} virtual stages = {chunks} model chunks" if virtual > 1 else ""
        raise ValueError(f"{count} layers cannot fill {stages} stages{chunk_text}: {fix}, or a model with more "
                         f"layers")
    if not isinstance(balance, (str, list, tuple)):
        raise TypeError(f"balance={balance!r} must be 'params', 'flops', 'time' or a list of layers per model chunk")
    if isinstance(balance, (list, tuple)):
        sizes = list(balance)
        if len(sizes) != chunks:
            raise ValueError(f"balance={sizes} gives layers per model chunk: it needs stages({stages}) * "
                             f"virtual({virtual}) = {chunks} entries, got {len(sizes)}")
        bad = [f"balance[{i}]={size!r}" for i, size in enumerate(sizes)
               if isinstance(size, bool) or not isinstance(size, int) or size < 1]
        if bad:
            raise ValueError("every model chunk needs a positive int number of layers: " + ", ".join(bad))
        if sum(sizes) != count:
            raise ValueError(f"balance={sizes} sums to {sum(sizes)} layers but the model has {count}: make the "
                             f"counts add up to {count}")
        boundaries = [0]
        for size in sizes:
            boundaries.append(boundaries[-1] + size)
    else:
        boundaries = balanced_boundaries(layer_costs(layers, balance, sample_input=sample_input), chunks)
    return [list(range(start, end)) for start, end in zip(boundaries, boundaries[1:])]


def build_stage(layers, indices) -> nn.Sequential:
    """One model chunk: the listed layers run in order, each registered under its
    index in the whole model ("5.attention..."), so state-dict keys name the layer.
    Layers sharing a parameter (a tied embedding and head) may land in chunks on
    different pipeline ranks: give ``PipelineEngine`` the whole model (``model=``, as
    ``plait.parallel.hybrid.build_hybrid`` does) and it finds them by identity and sums
    their gradients; without it, such parameters are refused unless declared (``tied=``)."""
    layers = _check_layers(layers)
    indices = list(indices)
    if not indices:
        raise ValueError("a stage needs at least one layer index")
    bad = [repr(i) for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"layer indices {', '.join(bad)} are not in [0, {len(layers)})")
    if len(set(indices)) != len(indices):
        raise ValueError(f"layer indices {indices} repeat a layer")
    return nn.Sequential(OrderedDict((str(i), layers[i]) for i in indices))


class LayeredModel(abc.ABC):
    """A model that lists its own layers for pipeline stages, as plait's GPT does (it
    subclasses this): ``sequential_layers`` returns its ``pipeline_layers()``. So the
    splitter needs no model class, and ``plait.models`` (above this layer) none of its."""

    @abc.abstractmethod
    def pipeline_layers(self) -> list[nn.Module]:
        """The model's layers, run one after another, sharing its parameters."""


def sequential_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` as a list run one after another: an nn.Sequential's
    children, or a LayeredModel's ``pipeline_layers()``: for a plait GPT (at any
    tensor-parallel degree), tokens (b, s) -> [GPTEmbeddingLayer] -> (s, b, h) ->
    [GPTBlockLayer] x l -> [GPTHeadLayer] -> logits (b, s, V'/tp) (``plait.models.gpt_layers``).
    The layers share the model's parameters (an optimiser on the model trains them);
    under sequence parallelism the activations between layers are this rank's (s/tp, b, h)
    sequence shard."""
    if isinstance(model, nn.Sequential):
        return list(model)
    if isinstance(model, LayeredModel):
        return model.pipeline_layers()
    raise TypeError(f"sequential_layers takes an nn.Sequential or a plait GPT, got {type(model).__name__}: wrap "
                    f"the model's layers in nn.Sequential or pass a list of modules to split_layers")
