"""Trace a whole model into a graph of calls, keeping its own submodules as leaves.

``trace_model(model, example_inputs)`` runs the model once on the example inputs
under a ``torch.overrides.TorchFunctionMode`` and records, in execution order:

- each call of a *leaf* module (by default: a module with no children, and every
  child of an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict``, i.e. the
  repeated blocks, HF GPT-2's ``transformer.h.N`` and Llama's ``model.layers.N``;
  plus the modules named in ``leaves=``) as one node naming the module by its
  qualified name, its arguments as references to earlier values;
- each torch function or tensor method called *between* leaves (the glue code:
  position ids, masks, residual adds) whose result holds a tensor, or that writes
  into a tensor (``__setitem__``), as one node;
- parameters and buffers the glue reads directly, by their qualified names.

This is torch.fx's symbolic tracing with leaf modules, except that the values are
real: Python control flow on shapes, the config or ``self.training`` runs as it
would and is fixed for this input shape (each stage checks its inputs keep the traced
shapes). What would be silently fixed is refused by name: the glue reading a tensor's
*values* into Python (``bool``, ``item``, ``tolist``, ``in``: data-dependent control
flow) and a leaf called with an object built during the forward (a KV cache), each
naming the module to make a leaf or the argument to pass. The run is under no_grad,
its RNG forked and the buffers restored, so tracing changes nothing.

Each leaf call's forward FLOPs are counted with torch's ``FlopCounterMode`` (the
matmul, convolution and attention FLOPs, 2·m·n·k per product; what the planner's
``plait.plan.trace`` counts), for the balanced split.
"""

from __future__ import annotations

import fnmatch
import inspect
import os
import traceback
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# what a tensor tells Python without reading its values (a shape-based branch is fine)
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "shape", "dtype", "device", "is_floating_point", "is_complex",
    "requires_grad", "is_contiguous", "stride", "element_size", "__len__", "layout", "is_cuda", "ndim", "get_device",
    "is_sparse", "is_leaf", "grad_fn", "names", "is_meta", "is_cpu", "is_quantized", "is_nested", "data_ptr",
    "storage_offset", "untyped_storage", "__hash__", "__dlpack_device__", "is_mps", "is_xpu", "itemsize", "nbytes",
    "__format__", "__repr__", "__str__", "is_inference", "output_nr", "_version", "__get__", "__torch_function__",
})
_VALUE_READS = frozenset({"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "__contains__",
                          "__complex__", "numpy", "equal", "allclose", "is_nonzero", "__array__"})
# results that differ between runs on the same shapes: reading them is data-dependent too
_RANDOM = frozenset({"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
                     "bernoulli_", "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_",
                     "cauchy_", "log_normal_", "random_", "dropout", "dropout_", "alpha_dropout", "feature_dropout",
                     "poisson", "empty", "empty_like", "new_empty"})
# ops whose output shape depends on their input's values, and the reads of a shape
_DYNAMIC_SHAPE = frozenset({"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere", "bincount",
                            "repeat_interleave", "nonzero_static", "histc"})
_SHAPE_READS = frozenset({"size", "shape", "__len__", "numel", "nelement"})
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format,
          torch.Size, slice, type(Ellipsis))


class TraceError(ValueError):
    """The model cannot be traced as it is: the message names the module or argument."""


@dataclass(frozen=True)
class Ref:
    """A value of the graph: node ``node``'s result, indexed along ``path``."""

    node: int
    path: tuple = ()


@dataclass(frozen=True)
class Attr:
    """A parameter, buffer or tensor constant, by its qualified name in the stage module."""

    name: str


@dataclass
class Node:
    """One recorded step: kind "input" (the model's i-th positional input), "leaf"
    (``target``: a qualified module name), "call" (``target``: a torch function or
    tensor method) or "output" (``args[0]``: what the model returns)."""

    index: int
    kind: str
    target: object
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    flops: int = 0
    refs: tuple = ()  # every Ref in args and kwargs


@dataclass
class TracedModel:
    """The recorded graph of ``model`` on inputs of ``input_specs`` (dtype, shape)."""

    model: nn.Module
    nodes: list[Node]
    input_specs: list[tuple]
    constants: dict[str, torch.Tensor]  # name -> tensor the glue made from nothing traced (kept as buffers)
    value_specs: dict[Ref, tuple]  # every tensor value -> (dtype, shape, requires_grad in training)
    glue_modules: dict[str, bool]  # traced-through module -> its training flag when traced

    def leaves(self) -> list[Node]:
        return [node for node in self.nodes if node.kind == "leaf"]


def flatten(value, path=()):
    """(path, item) for every item of nested tuples, lists and dicts (ModelOutput is a dict)."""
    if isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from flatten(item, path + (index,))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, path + (key,))
    else:
        yield path, value


def map_structure(value, fn):
    """``value`` with each non-container item x replaced by fn(x) (tuples stay tuples)."""
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(map_structure(item, fn) for item in value)
    if isinstance(value, list):
        return [map_structure(item, fn) for item in value]
    if isinstance(value, dict) and type(value) is dict:
        return {key: map_structure(item, fn) for key, item in value.items()}
    return fn(value)


def _name_of(func) -> str:
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and owner is not None:
        return getattr(owner, "__name__", "__get__")  # a tensor property's getter: its property name
    return getattr(func, "__name__", repr(func))


def _user_frame() -> str:
    """file:line of the innermost frame outside torch and plait (where the model read the value)."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(skip):
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "?"


class _Recorder(TorchFunctionMode):
    """Records the glue's torch calls (see the module docstring)."""

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.tracer
        if tracer.depth:  # inside a leaf: its own code, not recorded
            return func(*args, **kwargs)
        name = _name_of(func)
        touched = [item for _, item in flatten((args, kwargs)) if isinstance(item, torch.Tensor)]
        watched = any(tracer.is_watched(item) for item in touched)
        tainted = name in _RANDOM or any(tracer.is_tainted(item) for item in touched)
        if tainted and name in _VALUE_READS:
            tracer.refuse_value_read(name)
        # a shape made from values (nonzero, a boolean mask's selection): reading it is a value read too
        dynamic = any(id(item) in tracer.shape_tainted for item in touched) or tainted and (
            name in _DYNAMIC_SHAPE or name in ("__getitem__", "index") and
            any(item.dtype == torch.bool for item in touched[1:]) or name == "where" and len(touched) == 1)
        if dynamic and name in _SHAPE_READS:
            tracer.refuse_value_read(f"{name} of a tensor whose shape depends on values")
        result = func(*args, **kwargs)
        holds_tensor = any(isinstance(item, torch.Tensor) for _, item in flatten(result))
        if holds_tensor or (watched and name == "__setitem__"):
            tracer.record_call(func, args, kwargs, result, tainted)
            if dynamic:
                tracer.shape_tainted.update(id(item) for _, item in flatten(result) if isinstance(item, torch.Tensor))
        elif tainted and name not in _METADATA and not name.startswith("is_"):
            tracer.refuse_value_read(name)
        return result


class _Tracer:
    def __init__(self, model: nn.Module, leaf_names: set[str]):
        self.model = model
        self.leaf_names = leaf_names
        self.nodes: list[Node] = []
        self.depth = 0
        self.module_stack: list[str] = []  # traced-through modules being run
        self.glue_modules: dict[str, bool] = {}
        self.values: dict[int, Ref] = {}  # id(tensor) -> Ref
        self.keep: list = []  # every recorded tensor, alive (so ids stay unique)
        self.value_specs: dict[Ref, tuple] = {}
        self.attrs = {id(t): name for name, t in model.named_parameters(remove_duplicate=False)}
        self.attrs.update({id(t): name for name, t in model.named_buffers(remove_duplicate=False)})
        self.constants: dict[str, torch.Tensor] = {}
        self.constant_ids: set[int] = set()
        self.tainted: set[int] = set()
        self.shape_tainted: set[int] = set()  # tensors whose shape depends on values
        self.flop_counter: FlopCounterMode | None = None
        self.counting = False

    def is_watched(self, tensor) -> bool:
        return id(tensor) in self.values or id(tensor) in self.attrs

    def is_tainted(self, tensor) -> bool:
        """Does ``tensor``'s value depend on the inputs' values, the parameters or buffers, or
        an RNG? (What depends on shapes and constants alone, as position ids from an arange,
        is the same for every batch of the traced shape: reading it is safe.)"""
        return id(tensor) in self.tainted or (id(tensor) in self.attrs and id(tensor) not in self.constant_ids)

    def where(self) -> str:
        return self.module_stack[-1] if self.module_stack else ""

    def refuse_value_read(self, name: str):
        owner = self.where()
        fix = (f"make {owner!r} a leaf (split(..., leaves=[{owner!r}])) so it runs whole inside one stage"
               if owner else "move that check out of the model's forward (or into a submodule made a leaf)")
        raise TraceError(f"data-dependent control flow: the forward of {owner or 'the model'} reads a tensor's values "
                         f"into Python ({name}) at {_user_frame()}; a split graph would fix that value for every "
                         f"batch: {fix}")

    # ----- values ----------------------------------------------------------------------
    def record_value(self, value, node: int, tainted: bool = True) -> None:
        for path, item in flatten(value):
            if isinstance(item, torch.Tensor):
                ref = Ref(node, path)
                self.values[id(item)] = ref
                (self.tainted.add if tainted else self.tainted.discard)(id(item))
                self.keep.append(item)
                self.value_specs[ref] = (item.dtype, tuple(item.shape))

    def encode(self, value, what):
        """``value`` (an argument) with tensors as Ref / Attr; refuses objects a stage cannot rebuild."""
        def one(item):
            if isinstance(item, torch.Tensor):
                if id(item) in self.values:
                    return self.values[id(item)]
                if id(item) in self.attrs:
                    return Attr(self.attrs[id(item)])
                if isinstance(item, nn.Parameter):
                    raise TraceError(f"{what(item)} is a parameter {tuple(item.shape)} that is not registered in "
                                     f"{type(self.model).__name__} (a module or parameter kept in a plain list, dict "
                                     "or attribute?): a split stage would hold it as a constant that never trains; "
                                     "register it (nn.ModuleList, nn.ParameterList, register_parameter)")
                name = f"_split_constant_{len(self.constants)}"
                self.constants[name] = item
                self.constant_ids.add(id(item))
                self.attrs[id(item)] = name
                self.keep.append(item)
                return Attr(name)
            if isinstance(item, _PLAIN) or callable(item) and not isinstance(item, nn.Module):
                return item
            raise TraceError(f"{what(item)} is a {type(item).__name__}, an object a split stage cannot carry between "
                             "calls (state, e.g. a KV cache, would be shared by every micro-batch): pass the model "
                             "what disables it (e.g. kwargs={'use_cache': False}) or make the module that builds "
                             "and uses it a leaf")
        return map_structure(value, one)

    def add(self, kind, target, args=(), kwargs=None, what=None) -> Node:
        index = len(self.nodes)
        what = what or (lambda item: f"an argument of {target}")
        node = Node(index, kind, target, self.encode(tuple(args), what), self.encode(dict(kwargs or {}), what))
        node.refs = tuple(item for _, item in flatten((node.args, node.kwargs)) if isinstance(item, Ref))
        self.nodes.append(node)
        return node

    def record_call(self, func, args, kwargs, result, tainted: bool) -> None:
        node = self.add("call", func, args, kwargs, lambda item: f"an argument of {_name_of(func)} in the forward of "
                                                            f"{self.where() or 'the model'}")
        self.record_value(result, node.index, tainted)

    # ----- module hooks ----------------------------------------------------------------
    def pre_hook(self, name):
        def hook(module, args, kwargs):
            if self.depth:
                if name in self.leaf_names:
                    self.depth += 1
                return None
            if name not in self.leaf_names:
                self.module_stack.append(name)
                self.glue_modules.setdefault(name, module.training)
                return None
            bound = _binder(module, args, kwargs)
            node = self.add("leaf", name, args, kwargs,
                            lambda item: f"argument {bound(item)} of {name} ({type(module).__name__})")
            self.depth = 1
            self.flop_counter = FlopCounterMode(display=False)
            self.flop_counter.__enter__()
            self.counting = True
            self.current = node
            return None
        return hook

    def post_hook(self, name):
        def hook(module, args, kwargs, output):
            if name not in self.leaf_names:
                if not self.depth and self.module_stack and self.module_stack[-1] == name:
                    self.module_stack.pop()
                return None
            if self.depth == 0:  # its pre-hook refused the call: nothing entered
                return None
            self.depth -= 1
            if self.depth == 0:
                self.counting = False
                self.flop_counter.__exit__(None, None, None)
                self.current.flops = int(self.flop_counter.get_total_flops())
                self.record_value(output, self.current.index)
            return None
        return hook


def _binder(module, args, kwargs):
    """A callable naming the arguments of a leaf call (for an error message only)."""
    def name_of(item) -> str:
        try:
            bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        except (TypeError, ValueError):
            bound = {**{f"#{index}": value for index, value in enumerate(args)}, **kwargs}
        return next((key for key, value in bound.items()
                     if any(part is item for _, part in flatten(value))), "?")
    return name_of


def default_leaves(model: nn.Module, extra=()) -> set[str]:
    """Qualified names of the leaf modules (see the module docstring); ``extra``:
    names, fnmatch patterns ("*" spans dots here) or module classes."""
    leaves = set()
    patterns = [item for item in extra if isinstance(item, str)]
    classes = tuple(item for item in extra if isinstance(item, type))
    containers = {name for name, module in model.named_modules() if isinstance(module, _CONTAINERS)}
    for name, module in model.named_modules():
        if not name:
            continue
        parent = name.rpartition(".")[0]
        if (next(module.children(), None) is None or parent in containers or
                any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns) or
                (classes and isinstance(module, classes))):
            leaves.add(name)
    # a leaf inside a leaf runs inside it: keep the outermost
    return {name for name in leaves if not any(name.startswith(other + ".") for other in leaves)}


def trace_model(model: nn.Module, example_inputs: tuple, kwargs: dict, leaf_names: set[str]) -> TracedModel:
    """The graph of ``model(*example_inputs, **kwargs)`` (see the module docstring)."""
    tracer = _Tracer(model, leaf_names)
    for index, value in enumerate(example_inputs):
        node = tracer.add("input", index)
        tracer.record_value(value, node.index)
    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(tracer.pre_hook(name), with_kwargs=True))
            handles.append(module.register_forward_hook(tracer.post_hook(name), with_kwargs=True, always_call=True))
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    devices = sorted({str(t.device) for t in list(model.parameters()) + list(example_inputs) if t.device.type != "cpu"})
    tracer.module_stack.append("")
    tracer.glue_modules[""] = model.training
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), _Recorder(tracer):
            output = model(*example_inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        if tracer.counting:  # a leaf's forward raised
            tracer.flop_counter.__exit__(None, None, None)
    tracer.add("output", None, (_model_output(output),), what=lambda item: "the model's output")
    value_specs = tracer.value_specs
    for param_name, param in model.named_parameters():
        value_specs.setdefault(Attr(param_name), (param.dtype, tuple(param.shape)))
    return TracedModel(model, tracer.nodes, [(t.dtype, tuple(t.shape)) for t in example_inputs], tracer.constants,
                       value_specs, tracer.glue_modules)


def _model_output(output):
    """What the last stage returns: the logits of a ModelOutput / dict, else a tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    raise TraceError(f"the model returned a {type(output).__name__}: a split model's last stage returns the logits, "
                     "so the model must return a tensor or an output with a 'logits' tensor (e.g. an HF ModelOutput)")
