"""Trace a user's model under a tensor-parallel plan: what each of t ranks would run.

``trace_plan`` runs one forward and backward of the *unsharded* model (the plan read
by ``plait.plan.tp_styles``) under a dispatch mode that follows the sharding through
the data flow. Built under torch's FakeTensorMode it costs no memory and runs the
real device's kernels (the CPU's and GPU's fused attention keep O(s) per head, where
the meta device's math path keeps the s² probabilities). Each operator, and each
storage autograd saves, falls in one of three parts:

- sharded: a colwise module's weight and bias, a rowwise module's weight, a vocab
  embedding's table, and every tensor an operator makes from a sharded input. Such an
  operator runs on 1/t of the data on each of t ranks: its matmul FLOPs, memory traffic
  and saved tensors are /t (the attention core between a colwise qkv and a rowwise
  projection works on local heads, so it shrinks too).
- replicated: the rest; a rowwise or vocab module's output (summed over the ranks), a
  colwise module's input gradient (summed) and a gathered output (a colwise
  ``gather_output``, a sequence ``exit``) are whole again; their gradients flowing back
  are this rank's slice.
- sequence: replicated tensors downstream of a rowwise output or a sequence ``entry``
  (the residual stream, the norms): under sequence parallelism each rank holds 1/t of
  the sequence, except the input a colwise module saves, which it all-gathered
  (``gathered_bytes``: kept whole, once per colwise module: each gathers its own copy).

Kernel counts never shrink. Each planned module's run is recorded (``collectives``)
for ``plait.plan.tp_plan`` to price its collectives. The model is cut into layers a
pipeline boundary may fall between: an nn.Sequential's children, else [what runs
before the blocks, block 0, ..., block l-1, what runs after] with the blocks the
nn.ModuleList holding the most parameters (HF's ``transformer.h`` / ``model.layers``,
as plait train's hf_model finds them); a backward operator belongs to the block whose
output gradient arrived last.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

from plait.plan.layers import LayerCost
from plait.plan.tp_styles import KINDS, match_plan, sharded_dims, style_flags
from plait.plan.trace import METADATA_OPS, Snapshot, addressed_nbytes, flop_formulas, storage_key

__all__ = ["PARTS", "TracedLayer", "PlanTrace", "layer_modules", "trace_plan"]

PARTS = ("replicated", "sequence", "sharded")


@dataclass(frozen=True)
class TracedLayer:
    """One layer of a traced model under a plan, at the traced micro-batch and dtype.
    ``parts`` maps "replicated", "sequence", "sharded" (the module docstring) to a
    LayerCost each (kernels are all in "replicated"; ``params``: sharded ones in
    "sharded"); ``gathered_bytes``: sequence-region bytes a colwise module saves (kept
    whole under sequence parallelism); ``input_sequence`` / ``output_sequence``: whether
    the boundary tensors lie in the sequence region; ``collectives``: (kind, input
    bytes, input needs a gradient, output bytes, the bytes of each parameter whose
    gradient sequence parallelism sums, ``style_flags``) per planned module run."""

    name: str
    parts: dict
    gathered_bytes: float = 0.0
    sequence_elsewhere_bytes: float = 0.0
    input_sequence: bool = False
    output_sequence: bool = False
    recomputable: bool = False
    collectives: tuple = ()


def layer_modules(model) -> tuple[list, bool]:
    """(blocks, with_ends): an nn.Sequential's children (no ends), else the children of
    the nn.ModuleList holding the most parameters (with the layers before and after),
    else [model]."""
    from torch import nn  # imported here: plait.plan loads without torch

    if isinstance(model, nn.Sequential):
        return list(model.children()), False
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList) and len(module)]
    if not lists:
        return [model], False
    return list(max(lists, key=lambda found: sum(param.numel() for param in found.parameters()))), True


class _Tracer:
    """State of one trace: the sharded and sequence-region storages (held so a freed
    address is not reused while tracing), the current layer and phase, the counts."""

    def __init__(self, count: int):
        self.sharded: dict = {}
        self.sequence: dict = {}
        self.layer, self.phase, self.gathering = 0, "forward", []  # colwise modules gathering their input
        self.stats = [{} for _ in range(count)]
        self.saved: dict = {}  # storage key -> [layer, nbytes, part, saved inside colwise, saved elsewhere]
        self.exclude: set = set()
        self.held: list = []
        self.collectives = [[] for _ in range(count)]
        self.boundary = [[None, None] for _ in range(count)]  # (nbytes, in sequence region) of input, output

    def add(self, part: str, key: str, value: float) -> None:
        stats = self.stats[self.layer]
        stats[(part, key)] = stats.get((part, key), 0.0) + value

    def part_of(self, tensors) -> str:
        keys = [storage_key(t) for t in tensors]
        if any(key in self.sharded for key in keys):
            return "sharded"
        return "sequence" if any(key in self.sequence for key in keys) else "replicated"

    def mark(self, tensors, part: str) -> None:
        for tensor in tensors:
            key = storage_key(tensor)
            self.sharded.pop(key, None)
            self.sequence.pop(key, None)
            if part != "replicated":
                (self.sharded if part == "sharded" else self.sequence)[key] = tensor.untyped_storage()

    def pack(self, tensor):
        key = storage_key(tensor)
        if key not in self.exclude:
            self.held.append(tensor.untyped_storage())  # no address reuse while tracing
            entry = self.saved.setdefault(key, [self.layer, tensor.untyped_storage().nbytes(),
                                                self.part_of([tensor]), set(), False])
            if self.gathering:  # each gathers its own copy of its input, which it saves
                entry[3].add(self.gathering[-1])
            else:
                entry[4] = True
        return tensor.detach()


@functools.cache
def _mode_type():
    """The dispatch mode that counts and propagates (built on first use: torch is lazy)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    formulas = {**flop_registry, **{op: shape_wrapper(f) for op, f in flop_formulas().items()}}

    class ShardingFlow(TorchDispatchMode):
        def __init__(self, tracer: _Tracer):
            super().__init__()
            self.tracer = tracer

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if getattr(func, "is_view", False) or func.name().split(".")[0] in METADATA_OPS:
                return out
            tracer = self.tracer
            inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
            outputs = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
            part = tracer.part_of(inputs)
            tracer.mark(outputs, part)
            phase = tracer.phase
            tracer.add("replicated", f"{phase}_kernels", 1)
            if func.overloadpacket in formulas:
                tracer.add(part, f"{phase}_flops", formulas[func.overloadpacket](*args, **kwargs, out_val=out))
            else:
                tracer.add(part, f"{phase}_bytes", sum(addressed_nbytes(t) for t in inputs + outputs))
            return out

    return ShardingFlow


def _first_tensor(value):
    import torch
    from torch.utils._pytree import tree_leaves

    return next((leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()),
                None)


def _install_hooks(model, tracer: _Tracer, matched, blocks, with_ends) -> list:
    """Forward hooks: a sharded module's output and a colwise module's input gradient
    leave the sharded part; the layer moves with the blocks, forward and backward."""
    handles = []
    modules = dict(model.named_modules())
    last = len(tracer.stats) - 1

    def set_layer(index):
        def hook(grad):
            tracer.layer = index
        return hook

    def planned(name, kind, style):
        flags = style_flags(style)
        gathers_input = kind == "colwise" and "input_replicated" not in flags  # under sequence parallelism

        def before(module, args, kwargs):
            if gathers_input:
                tracer.gathering.append(id(module))
            x = _first_tensor((args, kwargs))
            if "entry" in flags and x is not None:
                tracer.mark([x], "sequence")  # split along the sequence as it enters
            if kind == "colwise" and x is not None and x.requires_grad:
                # the input gradient is summed over tp (reduce-scattered under sequence parallelism)
                x.register_hook(lambda grad: tracer.mark([grad], "sequence" if gathers_input else "replicated"))

        def after(module, args, kwargs, out):
            if gathers_input:
                tracer.gathering.pop()
            x, y = _first_tensor((args, kwargs)), _first_tensor(out)
            if y is None:
                return
            gathered = kind == "colwise" and "gather" in flags or kind == "sequence" and "exit" in flags
            if gathered and y.requires_grad:  # its backward keeps this rank's slice of the gradient
                y.register_hook(lambda grad: tracer.mark([grad], "sharded" if kind == "colwise" else "sequence"))
            if gathered or kind == "vocab" and "output_sequence" not in flags \
                    or kind == "rowwise" and "output_replicated" in flags:
                tracer.mark([y], "replicated")
            elif kind in ("rowwise", "vocab") or "entry" in flags:
                tracer.mark([y], "sequence")
            # a sequence module answers for its own parameters only (a whole block may be the entry)
            param_bytes = tuple(p.numel() * p.element_size() for key, p in module.named_parameters(recurse=False)
                                if kind == "sequence" or kind == "rowwise" and key == "bias")
            tracer.collectives[tracer.layer].append((kind, _nbytes(x) if x is not None else 0,
                                                     bool(x is not None and x.requires_grad), _nbytes(y),
                                                     param_bytes, flags))
        return before, after

    for name, (kind, style) in matched.items():
        before, after = planned(name, kind, style)
        handles.append(modules[name].register_forward_pre_hook(before, with_kwargs=True))
        handles.append(modules[name].register_forward_hook(after, with_kwargs=True))

    offset = 1 if with_ends else 0
    for index, block in enumerate(blocks):
        def enter(module, args, kwargs, index=index + offset):
            tracer.layer = index
            x = _first_tensor((args, kwargs))
            if x is not None:
                tracer.boundary[index][0] = (x.numel() * x.element_size(), tracer.part_of([x]) == "sequence")
                if with_ends and index == 1 and x.requires_grad:
                    x.register_hook(set_layer(0))

        def leave(module, args, kwargs, out, index=index + offset):
            y = _first_tensor(out)
            if y is not None:
                tracer.boundary[index][1] = (y.numel() * y.element_size(), tracer.part_of([y]) == "sequence")
                if y.requires_grad:
                    y.register_hook(set_layer(index))
            tracer.layer = min(index + 1, last)
        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(block.register_forward_hook(leave, with_kwargs=True))
    return handles


@dataclass(frozen=True)
class PlanTrace:
    """What ``trace_plan`` saw: the layers, the traced micro-batch, element size and
    sequence length, the tied parameters (numel, sharded) shared by the first and last
    layer, the sizes tp must divide, and the plan's module count per kind."""

    name: str
    layers: tuple
    traced_batch: int
    element_bytes: int
    seq_len: int | None
    with_ends: bool
    tied: tuple = ()
    tp_sizes: tuple = ()
    kinds: tuple = ()
    autocast: str | None = None  # the dtype the forward ran under torch.autocast in (None: none)


def _layer_cost(name: str, stats: dict, part: str, params: float, activation_bytes: float) -> LayerCost:
    get = lambda key: stats.get((part, key), 0.0)  # noqa: E731
    return LayerCost(name=name, params=params, forward_flops=get("forward_flops"), backward_flops=get("backward_flops"),
                     forward_kernels=int(get("forward_kernels")), backward_kernels=int(get("backward_kernels")),
                     forward_bytes=get("forward_bytes"), backward_bytes=get("backward_bytes"),
                     activation_bytes=activation_bytes)


def trace_plan(model, sample, plan, *, name: str | None = None, autocast: str | None = None) -> PlanTrace:
    """Trace ``model`` (called as ``model(**sample)`` for a dict, else ``model(sample)``)
    forward and backward under ``plan`` (the module docstring); its loss is the output's
    ``.loss`` when it has one, else the first floating output, back-propagated with ones.
    ``autocast``: a torch dtype name ("bfloat16"): the forward runs under torch.autocast
    on the sample's device, as plait train's mixed precision does (what it saves is then
    the 16-bit copies and float32 tensors autocast keeps). Restores training flags,
    grads, buffers and RNG streams afterwards (``trace``)."""
    import torch

    matched = match_plan(model, plan)
    blocks, with_ends = layer_modules(model)
    names = ["before"] * with_ends + [f"block{i}" for i in range(len(blocks))] + ["after"] * with_ends
    if not with_ends and len(blocks) > 1:
        names = [f"{i}:{type(block).__name__}" for i, block in enumerate(blocks)]
    tracer = _Tracer(len(names))
    modules = dict(model.named_modules())
    params, buffers = list(model.parameters()), list(model.buffers())
    tracer.exclude = {storage_key(t) for t in params + buffers}
    sharded = [tensor for module_name, (kind, _) in matched.items() for key, tensor in
               modules[module_name].named_parameters(recurse=False) if kind in ("colwise", "vocab")
               or (kind == "rowwise" and key == "weight")]
    tracer.mark(sharded, "sharded")
    sharded_ids = {id(p) for p in sharded}
    owner: dict = {}  # id(param) -> layers using it

    def own(module, args):
        for param in module.parameters(recurse=False):
            owner.setdefault(id(param), (param, []))[1].append(tracer.layer)

    handles = _install_hooks(model, tracer, matched, blocks, with_ends)
    handles += [module.register_forward_pre_hook(own) for module in model.modules()
                if next(module.parameters(recurse=False), None) is not None]
    snapshot = Snapshot(list(model.modules()), params, buffers)
    devices = [sample.device] if isinstance(sample, torch.Tensor) else []
    try:
        snapshot.clear_grads()
        model.train()
        with torch.random.fork_rng(devices=[d for d in devices if d.type == "cuda"]), _mode_type()(tracer):
            mixed = contextlib.nullcontext() if autocast is None else \
                torch.autocast(_sample_tensor(sample).device.type, dtype=getattr(torch, autocast))
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t), mixed:
                out = model(**sample) if isinstance(sample, dict) else model(sample)
            loss = getattr(out, "loss", None)
            loss = _first_tensor(out) if loss is None else loss
            if loss is None or not loss.requires_grad:
                raise ValueError(f"{type(model).__name__}'s output has no floating tensor needing a gradient to "
                                 "back-propagate: return a loss or logits computed from the parameters")
            tracer.phase, tracer.layer = "backward", len(names) - 1
            loss.backward(torch.ones_like(loss))
        tracer.boundary[0][0] = tracer.boundary[0][0] or (_nbytes(_sample_tensor(sample)), False)
        if with_ends:  # the ends' inner boundaries are the blocks'
            tracer.boundary[0][1], tracer.boundary[-1][0] = tracer.boundary[1][0], tracer.boundary[-2][1]
        tracer.boundary[-1][1] = tracer.boundary[-1][1] or (_nbytes(loss), False)
    finally:
        for handle in handles:
            handle.remove()
        snapshot.restore()
    trace = _collect(tracer, names, owner, sharded_ids, matched, blocks, with_ends, model, sample,
                     name or type(model).__name__)
    return trace if autocast is None else replace(trace, autocast=autocast)


def _sample_tensor(sample):
    """The sample's first tensor (its first dimension is the batch)."""
    import torch
    from torch.utils._pytree import tree_leaves

    return next(leaf for leaf in tree_leaves(sample) if isinstance(leaf, torch.Tensor))


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _collect(tracer, names, owner, sharded_ids, matched, blocks, with_ends, model, sample, name) -> PlanTrace:
    count = len(names)
    params = [{"replicated": 0, "sharded": 0} for _ in range(count)]
    tied = []
    for param, used in owner.values():
        params[used[0]]["sharded" if id(param) in sharded_ids else "replicated"] += param.numel()
        if with_ends and used[0] == 0 and count - 1 in used:
            tied.append((param.numel(), id(param) in sharded_ids))
    activation = [{"replicated": 0.0, "sequence": 0.0, "sharded": 0.0, "colwise": 0.0, "elsewhere": 0.0}
                  for _ in range(count)]
    for layer, nbytes, part, in_colwise, elsewhere in tracer.saved.values():
        activation[layer][part] += nbytes
        if part == "sequence":
            activation[layer]["colwise"] += nbytes * len(in_colwise)
            activation[layer]["elsewhere"] += nbytes * elsewhere
    layers = []
    for index, layer_name in enumerate(names):
        stats, acts = tracer.stats[index], activation[index]
        parts = {part: _layer_cost(layer_name, stats, part, params[index].get(part, 0), acts[part]) for part in PARTS}
        (in_bytes, in_seq), (out_bytes, out_seq) = [b or (0, False) for b in tracer.boundary[index]]
        parts["replicated"] = replace(parts["replicated"], input_bytes=in_bytes, output_bytes=out_bytes)
        layers.append(TracedLayer(name=layer_name, parts=parts, gathered_bytes=acts["colwise"],
                                  sequence_elsewhere_bytes=acts["elsewhere"],
                                  input_sequence=in_seq, output_sequence=out_seq,
                                  recomputable=not with_ends or 0 < index < count - 1,
                                  collectives=tuple(tracer.collectives[index])))
    first = _sample_tensor(sample)
    kinds = tuple((kind, sum(k == kind for k, _ in matched.values())) for kind in KINDS)
    return PlanTrace(name=name, layers=tuple(layers), traced_batch=int(first.shape[0]),
                     element_bytes=_element_bytes(model, first), seq_len=int(first.shape[1]) if first.dim() > 1 else None,
                     with_ends=with_ends, tied=tuple(tied), tp_sizes=tuple(sharded_dims(model, matched)),
                     kinds=tuple(k for k in kinds if k[1]))


def _element_bytes(model, sample) -> int:
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return dtypes[0].itemsize if dtypes else (sample.element_size() if sample.is_floating_point() else 4)
