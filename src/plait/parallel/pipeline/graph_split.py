"""Automatic pipeline split of any model: ``split(model, example_inputs, stages=N)``.

The model is traced once (``graph_trace``: its own submodules, at least the repeated
blocks, stay leaf calls) and its leaf calls, in execution order, are cut into
contiguous stages:

- ``stages=N``: balanced by ``balance`` ("flops": each leaf call's forward FLOPs on the
  example, as ``FlopCounterMode`` counts them; "params": its parameters, a shared one
  at its first leaf, ``partition.layer_costs``), with ``partition.balanced_boundaries``
  (the split minimising the most expensive stage);
- ``split_points=["model.layers.2", ...]``: a stage starts at the first call of each
  named module (the glue before it stays in the stage before); a point inside a leaf
  (``"transformer.h.1.mlp"``) opens that leaf, its children becoming leaves.

Each stage is a ``StageModule`` holding the user's own module objects (and the
parameters and buffers the glue reads) under their ORIGINAL qualified names, so
``stage.named_parameters()`` says "transformer.h.1.attn.c_attn.weight", a plan of
wildcards applies to it, and the engine pairs a weight two stages share (GPT-2's tied
``transformer.wte.weight`` / ``lm_head.weight``) by its name in the whole model
(``PipelineEngine(..., model=model)``).

What crosses a boundary is every tensor made before it and used after it (hidden
states, position ids, masks, rotary cos/sin, ...): a stage takes and returns a tuple
(one tensor alone when only one crosses). The last stage returns the logits.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plait.parallel.pipeline.graph_trace import (Attr, Ref, TracedModel, TraceError, default_leaves, flatten,
                                                 map_structure,
                                                 trace_model)
from plait.parallel.pipeline.partition import balanced_boundaries, layer_costs

SPLIT_BALANCES = ("flops", "params")
_MUTATING = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")


def _name(target) -> str:
    return getattr(target, "__name__", "")


class StageModule(nn.Module):
    """One stage: the recorded calls of its part of the model, run on the boundary
    tensors it receives; the user's modules attached under their qualified names."""

    def __init__(self, traced: TracedModel, stage: int, nodes: list, inputs: list[Ref], outputs: list[Ref]):
        super().__init__()
        self.stage = stage
        self._nodes = nodes
        self._inputs, self._outputs = list(inputs), list(outputs)
        self._input_specs = [traced.value_specs[ref] for ref in inputs]
        self._glue = traced.glue_modules
        model = traced.model
        for node in nodes:
            if node.kind == "leaf":
                _attach(self, node.target, model.get_submodule(node.target))
            for _, item in flatten((node.args, node.kwargs)):
                if isinstance(item, Attr):
                    if item.name in traced.constants:
                        if not hasattr(self, item.name):
                            self.register_buffer(item.name, traced.constants[item.name], persistent=False)
                    else:
                        _attach(self, item.name, _lookup(model, item.name))
        self._model = [model]  # a list: not a submodule (its parameters are not this stage's)

    def forward(self, *values):
        if len(values) != len(self._inputs):
            raise TypeError(f"stage {self.stage} takes {len(self._inputs)} tensors (the boundary it receives), got "
                            f"{len(values)}")
        for ref, value, (dtype, shape) in zip(self._inputs, values, self._input_specs):
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"stage {self.stage} was traced with {shape} for this input and got {got}: split "
                                 "fixes the shapes the model's forward reads; split again with example inputs of "
                                 "the micro-batch shape you train on")
        model = self._model[0]
        changed = [name for name, training in self._glue.items() if model.get_submodule(name).training != training]
        if changed:
            raise RuntimeError(f"{changed[0] or 'the model'} was traced in "
                               f"{'training' if self._glue[changed[0]] else 'eval'} mode and is now in the other: its "
                               "forward's branches on self.training were fixed then; split again after model.train() "
                               "/ model.eval()")
        env: dict = {}
        known = dict(zip(self._inputs, values))

        def resolve(item):
            if isinstance(item, Ref):
                if item in known:
                    return known[item]
                value = env[item.node]
                for key in item.path:
                    value = value[key]
                return value
            if isinstance(item, Attr):
                return _lookup(self, item.name)
            return item

        for node in self._nodes:
            args = map_structure(node.args, resolve)
            kwargs = map_structure(node.kwargs, resolve)
            if node.kind == "leaf":
                env[node.index] = self.get_submodule(node.target)(*args, **kwargs)
            else:
                env[node.index] = node.target(*args, **kwargs)
        outputs = tuple(resolve(ref) for ref in self._outputs)
        return outputs[0] if len(outputs) == 1 else outputs


def _lookup(module: nn.Module, name: str):
    owner, _, attribute = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attribute)


def _attach(root: nn.Module, name: str, value) -> None:
    """Set ``value`` (a module, parameter or buffer) at ``name`` under ``root``, making
    empty parents as needed (as fx.GraphModule does): the original qualified name."""
    *path, last = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if isinstance(value, nn.Module):
        if module._modules.get(last) is not value:
            module.add_module(last, value)
    elif isinstance(value, nn.Parameter):
        if last not in module._parameters and last not in module._modules:
            module.register_parameter(last, value)
    elif last not in module._buffers and last not in module._modules:
        module.register_buffer(last, value)


@dataclass
class PipelineSplit:
    """What ``split`` returns: one module per stage (``modules``), the leaf modules each
    runs (``leaves``), the tensors crossing each boundary (``boundaries[k]``: between
    stage k and k+1, as (dtype, shape)), and ``shared``: parameter name (in the model)
    -> the stages holding it, for those held by more than one; ``tied``: those as
    ``PipelineEngine(tied=...)`` groups of (stage, its name in that stage's module), e.g.
    [[(0, "transformer.wte.weight"), (1, "lm_head.weight")]] (for stages whose modules were
    converted after the split, e.g. by a tensor-parallel plan, where ``model=`` no longer
    holds their parameters)."""

    model: nn.Module
    modules: list[StageModule]
    leaves: list[list[str]]
    boundaries: list[list[tuple]]
    shared: dict[str, tuple[int, ...]]
    tied: list[list[tuple[int, str]]]  # the same, as PipelineEngine's tied= groups of (stage, name in that stage)

    def stage_modules(self, schedule_or_stages, rank: int | None = None) -> dict[int, StageModule]:
        """{stage: module} for ``rank`` of a PipelineSchedule, or for the given stage ids."""
        if rank is not None:
            stages = [stage for _, stage in schedule_or_stages.stages_of(rank)]
            if schedule_or_stages.stages != len(self.modules):
                raise ValueError(f"schedule {schedule_or_stages.name} has {schedule_or_stages.stages} stages, the "
                                 f"split {len(self.modules)}: split with stages={schedule_or_stages.stages}")
        else:
            stages = list(schedule_or_stages)
        return {stage: self.modules[stage] for stage in stages}


def split(model: nn.Module, example_inputs, *, stages: int | None = None, split_points=None, balance: str = "flops",
          leaves=(), kwargs=None) -> PipelineSplit:
    """Cut ``model`` into pipeline stages (see the module docstring). ``example_inputs``:
    one micro-batch of the model's positional inputs (a tensor or a tuple); ``kwargs``:
    constant keyword arguments of every call (e.g. ``{"use_cache": False}`` for an HF
    model); ``leaves``: more modules to keep whole (names, fnmatch patterns or classes)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"split: model must be an nn.Module, got {type(model).__name__}")
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError("split: example_inputs must be a tensor or a tuple of tensors (one micro-batch of the "
                        f"model's positional inputs), got {type(example_inputs).__name__}")
    if (stages is None) == (split_points is None):
        raise ValueError("split: pass stages=N (balanced) or split_points=[module names] (a stage starts before "
                         "each), one of the two")
    if balance not in SPLIT_BALANCES:
        raise ValueError(f"split: balance={balance!r} must be one of {', '.join(map(repr, SPLIT_BALANCES))}")
    known = dict(model.named_modules())
    for point in split_points or ():
        if point not in known or not point:
            near = difflib.get_close_matches(str(point), [name for name in known if name], n=3)
            raise ValueError(f"split: split point {point!r} names no module of {type(model).__name__}"
                             f"{' (did you mean ' + ', '.join(map(repr, near)) + '?)' if near else ''}")
    leaf_names = default_leaves(model, leaves)
    for point in split_points or ():  # a point inside a leaf opens it: its children become the leaves
        while (outer := next((leaf for leaf in leaf_names if point.startswith(leaf + ".")), None)) is not None:
            children = [f"{outer}.{name}" for name, _ in known[outer].named_children()]
            leaf_names = (leaf_names - {outer}) | set(children)
    traced = trace_model(model, inputs, dict(kwargs or {}), leaf_names)
    _prune(traced)
    calls = traced.leaves()
    if split_points is not None:
        starts = []
        for point in split_points:
            first = next((i for i, node in enumerate(calls) if node.target == point or
                          node.target.startswith(point + ".") or point.startswith(node.target + ".")), None)
            if first is None:
                raise ValueError(f"split: split point {point!r} is not called in the forward on these inputs")
            if point.startswith(calls[first].target + "."):
                raise ValueError(f"split: split point {point!r} is inside leaf {calls[first].target!r}, which runs "
                                 f"whole in one stage: split before {calls[first].target!r} or a sibling")
            starts.append(first)
        if starts != sorted(set(starts)) or 0 in starts:
            raise ValueError(f"split: split_points {list(split_points)} must name modules called in this order, "
                             "each after the first leaf call")
        bounds = [0, *starts, len(calls)]
    else:
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"split: stages={stages!r} must be a positive int")
        if stages > len(calls):
            raise ValueError(f"split: stages={stages} is more than the {len(calls)} leaf module calls of "
                             f"{type(model).__name__} ({', '.join(node.target for node in calls)}): use at most "
                             f"{len(calls)} stages")
        if balance == "flops":
            costs = [float(node.flops) for node in calls]
        else:
            costs = layer_costs([model.get_submodule(node.target) for node in calls], "params")
        bounds = balanced_boundaries(costs, stages)
    return _build(traced, calls, bounds)


def _mutates(node) -> bool:
    """A glue call that writes into its first argument (x[i] = v, x += v, x.add_(v))."""
    name = _name(node.target)
    return node.kind == "call" and (name in _MUTATING or name.endswith("_") and not name.endswith("__"))


def _prune(traced: TracedModel) -> None:
    """Drop glue calls whose results nothing uses (a check's comparison) and that write nothing."""
    used: set[int] = set()
    kept = []
    for node in reversed(traced.nodes):
        needed = node.kind in ("output", "leaf", "input") or node.index in used or _mutates(node)
        if needed:
            kept.append(node)
            used.update(ref.node for ref in node.refs)
    traced.nodes = kept[::-1]


def _build(traced: TracedModel, calls: list, bounds: list[int]) -> PipelineSplit:
    count = len(bounds) - 1
    stage_of: dict[int, int] = {}
    stage = 0
    starts = {calls[bound].index: k for k, bound in enumerate(bounds[1:-1], start=1)}
    for node in traced.nodes:
        stage = starts.get(node.index, stage)
        stage_of[node.index] = stage if node.kind != "input" else 0
    stage_of[traced.nodes[-1].index] = count - 1
    for node in traced.nodes:  # an in-place write belongs with the value it writes (one stage)
        if _mutates(node) and node.refs and stage_of[node.refs[0].node] != stage_of[node.index]:
            raise TraceError(f"the glue writes in place into a tensor made in stage {stage_of[node.refs[0].node]} "
                             f"from stage {stage_of[node.index]}: choose split points around it")
    last_use: dict[Ref, int] = {}
    for node in traced.nodes:
        for ref in node.refs:
            last_use[ref] = max(last_use.get(ref, 0), stage_of[node.index])
    crossing = [[ref for ref in sorted(last_use, key=lambda r: (r.node, str(r.path)))
                 if stage_of[ref.node] <= k < last_use[ref]] for k in range(count - 1)]
    modules = []
    for k in range(count):
        nodes = [node for node in traced.nodes if stage_of[node.index] == k and node.kind in ("leaf", "call")]
        inputs = crossing[k - 1] if k else [Ref(node.index) for node in traced.nodes if node.kind == "input"]
        outputs = crossing[k] if k < count - 1 else [traced.nodes[-1].args[0]]
        modules.append(StageModule(traced, k, nodes, inputs, outputs))
    name_of = {id(param): name for name, param in traced.model.named_parameters()}
    holders: dict[str, set] = {}
    names: dict[str, list] = {}  # model name -> (stage, name in the stage) pairs
    for k, module in enumerate(modules):
        for name, param in module.named_parameters():
            holders.setdefault(name_of[id(param)], set()).add(k)
            names.setdefault(name_of[id(param)], []).append((k, name))
    shared = {name: tuple(sorted(ks)) for name, ks in holders.items() if len(ks) > 1}
    return PipelineSplit(
        model=traced.model, modules=modules,
        leaves=[[node.target for node in calls[bounds[k]:bounds[k + 1]]] for k in range(count)],
        boundaries=[[traced.value_specs[ref] for ref in refs] for refs in crossing],
        shared=shared, tied=[names[name] for name in shared])


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face's causal-LM loss as the engine's ``loss_fn(logits, labels)``: token t
    predicts label t+1 (labels are the inputs, shifted here), mean over the labels not
    ``ignore_index``; equal to ``model(input_ids, labels=labels).loss``."""
    return F.cross_entropy(logits[..., :-1, :].reshape(-1, logits.shape[-1]).float() if logits.dtype in
                           (torch.float16, torch.bfloat16) else logits[..., :-1, :].reshape(-1, logits.shape[-1]),
                           labels[..., 1:].reshape(-1), ignore_index=ignore_index)
