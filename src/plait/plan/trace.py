"""Trace a real ``nn.Module`` into LayerCosts: the planner's generic path.

Each layer runs once, forward then backward, on the real sample, in training mode,
and three counters watch it:

- ``FlopCounterMode`` (torch.utils.flop_counter) gives the matmul FLOPs, 2·m·n·k
  per product (mm, addmm, bmm, baddbmm, convolution, the attention kernels), plus
  the CPU flash-attention kernel and mv / addmv / dot / vdot, which it lacks.
- A dispatch mode of ours counts kernels and the bytes the non-matmul ones move.
  A *kernel* is every aten operator that reaches the dispatcher below autograd
  (composite ops such as ``linear`` or ``matmul`` arrive already decomposed)
  except those that touch no data: ops whose schema says the output aliases an
  input (``OpOverload.is_view``: view, t, transpose, permute, expand, slice,
  select, (un)squeeze, as_strided, alias, detach, split, unbind, ...) and
  ``METADATA_OPS`` (``_unsafe_view``, allocations such as ``empty_like``, shape
  queries). Copies (``clone``, ``_to_copy``, ``copy_``), fills and scalar reads
  (``_local_scalar_dense``) are kernels. A non-matmul kernel's bytes are the sum
  over its tensor inputs and outputs of itemsize · (elements it addresses: the
  product of the sizes of the dims whose stride is not 0, so a broadcast bias is
  read once). A matmul kernel's bytes are left out: the model prices it by FLOPs.
- ``saved_tensors_hooks`` give the activation memory: the bytes of the distinct
  storages autograd saves for the backward (see ``saved_activation_bytes``).

All three are exact for what the eager CPU/GPU kernels of this torch do; they do
not see fusion a compiler would do (``torch.compile`` keeps fewer kernels and
tensors). On the meta device they cost no memory, so a model too large to run
can still be described (build it and the sample with device="meta").
"""

from __future__ import annotations

import functools
import math
import sys

from plait.plan.layers import LayerCost

__all__ = ["describe_layers", "describe_module", "saved_activation_bytes"]

# Operators that move no data (beyond those whose schema marks them as views).
METADATA_OPS = frozenset({
    "aten::_unsafe_view", "aten::_reshape_alias", "aten::lift_fresh", "aten::empty", "aten::empty_like",
    "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided", "aten::resize_", "aten::set_",
    "aten::is_same_size", "aten::_has_compatible_shallow_copy_type", "aten::size", "aten::sym_size",
    "aten::stride", "aten::sym_stride", "aten::numel", "aten::sym_numel", "aten::storage_offset",
    "aten::sym_storage_offset", "aten::dim", "aten::is_contiguous", "aten::sym_is_contiguous",
    "aten::is_strides_like_format", "aten::is_non_overlapping_and_dense", "prim::device", "prim::layout",
})


def _tensor_nbytes(tensor) -> int:
    """itemsize · numel: the payload of an activation (what a stage sends)."""
    return tensor.numel() * tensor.element_size()


def addressed_nbytes(tensor) -> int:
    """itemsize · prod(size_d over dims with stride_d != 0): the bytes a kernel
    reads or writes for ``tensor`` (an expanded, stride-0 dim is read once)."""
    if tensor.numel() == 0:
        return 0
    return tensor.element_size() * math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride)


def storage_key(tensor):
    """Identity of ``tensor``'s storage: (device, data pointer); views share it.
    A storage without memory behind it (meta device, torch's FakeTensorMode) falls
    back to the storage object's own address."""
    from torch._subclasses.fake_tensor import is_fake

    storage = tensor.untyped_storage()
    pointer = 0 if tensor.is_meta or is_fake(tensor) else storage.data_ptr()
    return (str(tensor.device), pointer) if pointer else ("storage", storage._cdata)


class _SavedStorages:
    """Context: record the distinct storages autograd saves inside it.

    The pack hook returns ``tensor.detach()`` (same storage, no grad_fn): returning
    the tensor itself would make a saved output own its own grad_fn, a reference
    cycle that leaks the graph when no backward runs. Holding each storage until
    the context exits keeps a freed storage's address from being reused (and
    counted as the same storage) while recording."""

    def __init__(self, exclude_keys: frozenset):
        self.exclude_keys = exclude_keys
        self.nbytes_by_key: dict = {}
        self._storages: list = []
        self._hooks = None

    def _pack(self, tensor):
        key = storage_key(tensor)
        if key not in self.exclude_keys and key not in self.nbytes_by_key:
            storage = tensor.untyped_storage()
            self.nbytes_by_key[key] = storage.nbytes()
            self._storages.append(storage)
        return tensor.detach()

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_by_key.values())

    def __enter__(self):
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info):
        self._storages.clear()
        return self._hooks.__exit__(*exc_info)


def saved_activation_bytes(run, exclude=()) -> int:
    """Bytes autograd keeps for the backward of ``run()`` (a no-argument callable
    doing a forward pass), counted by storage:

        A = sum over distinct storages S saved by the forward, S not in exclude, of S.nbytes

    Every tensor an autograd node saves (``saved_tensors_hooks`` pack) is mapped to
    its storage; a storage counts once however many saved tensors view it (q, k, v
    views of one qkv tensor: the whole qkv storage, once) and counts in full even
    if only a slice of it is saved (that is what stays allocated). Storages of the
    tensors in ``exclude`` (typically ``model.parameters()`` and ``buffers()``) and
    of views of them (a saved Wᵀ) are left out. Inputs the forward saves count
    (a pipeline stage keeps them). Runs with gradients enabled; mark tensors whose
    gradient you want with requires_grad, as autograd saves only what the
    requested gradients need (a Linear on an input without grad saves the input
    for dW, not W). Exact for eager execution."""
    import torch

    if not callable(run):
        raise TypeError(f"run must be a no-argument callable doing a forward pass, got {type(run).__name__}")
    exclude_keys = _exclude_keys(exclude)
    with torch.enable_grad(), _SavedStorages(exclude_keys) as saved:
        run()
        return saved.nbytes


def _exclude_keys(tensors) -> frozenset:
    import torch

    tensors = list(tensors)
    bad = [f"exclude[{i}] is a {type(t).__name__}" for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError("exclude must hold tensors (e.g. list(model.parameters())): " + ", ".join(bad))
    return frozenset(storage_key(tensor) for tensor in tensors)


@functools.cache
def _counter_type():
    """The kernel/byte counting dispatch mode (built on first use: torch is
    imported lazily)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry

    matmuls = frozenset(flop_formulas()) | frozenset(flop_registry)  # op packets: what FlopCounterMode prices

    class KernelCounter(TorchDispatchMode):
        """kernels += 1 per data-touching op; nbytes += its tensors' addressed
        bytes unless it is a matmul. ``paused`` lets set-up work go uncounted."""

        def __init__(self):
            super().__init__()
            self.kernels, self.nbytes, self.paused = 0, 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if self.paused or getattr(func, "is_view", False) or func.name().split(".")[0] in METADATA_OPS:
                return out
            self.kernels += 1
            if func.overloadpacket not in matmuls:
                self.nbytes += sum(addressed_nbytes(leaf) for leaf in tree_leaves((args, kwargs, out))
                                   if isinstance(leaf, torch.Tensor))
            return out

    return KernelCounter


@functools.cache
def flop_formulas() -> dict:
    """Matmul-like ops FlopCounterMode (torch 2.13) does not count, as its
    ``custom_mapping``: formulas over input shapes, 2 FLOPs per multiply-add."""
    import torch
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    return {
        aten.mv: lambda a, b, *_, **__: 2 * a[0] * a[1],  # (m, k) @ (k)
        aten.addmv: lambda c, a, b, *_, **__: 2 * a[0] * a[1],
        aten.dot: lambda a, b, *_, **__: 2 * a[0],
        aten.vdot: lambda a, b, *_, **__: 2 * a[0],
        # F.scaled_dot_product_attention on CPU: QKᵀ and PV forward (4·b·n·s²·d); the backward recomputes QKᵀ,
        # then dP, dV, dQ, dK (10·b·n·s²·d)
        aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda grad, q, k, v, *_, **__: sdpa_backward_flop_count(grad, q, k, v),
    }


def describe_layers(layers, sample_input, *, training: bool = True) -> list[LayerCost]:
    """LayerCosts of ``layers`` (an nn.Sequential, or a list/tuple/ModuleList of
    modules run one after another) measured on ``sample_input``, one micro-batch.

    Layer i runs on x_i: x_0 = sample_input as given (a data batch: no input
    gradient), x_{i+1} = layer_i(x_i).detach(), with requires_grad when floating
    point (as a pipeline stage receives it, so its backward computes dL/dx).
    Forward, then ``output.backward(ones_like(output))``; per layer:

    - forward_flops / backward_flops: matmul FLOPs (FlopCounterMode); backward is
      dW only for a layer whose input has no gradient, dW + dX (~2x forward) else;
    - *_kernels / *_bytes: the kernel and byte rule of this module's docstring;
    - activation_bytes: ``saved_activation_bytes`` of the forward, excluding
      every parameter and buffer of ``layers`` (and views of them);
    - params: numel of the layer's parameters not already counted for an earlier
      layer (a shared weight counts at its first layer);
    - input_bytes / output_bytes: numel · itemsize of x_i and x_{i+1}.

    Runs in training mode (``training=False``: eval mode), gradients enabled.
    Restores afterwards, also on error: every module's training flag, every
    parameter's ``.grad`` (the old objects, untouched: grads are set to None
    before each backward), buffers (batch-norm statistics), plait dropout
    streams and the CPU (and the input's CUDA device's) RNG state. No hook or
    dispatch mode outlives the call. Each layer must return one tensor."""
    return _describe(_named_layers(layers), sample_input, training=training, exclude=())


def describe_module(model, sample_input, *, training: bool = True) -> list[LayerCost]:
    """LayerCosts of a whole model: an nn.Sequential's children; a plait GPT as
    embedding, its l blocks and the head (``sequential_layers``: tokens (b, s) ->
    (s, b, h) -> ... -> logits (b, s, V'/tp); a tied head's weight is counted
    with the embedding); any other module as one layer. See ``describe_layers``."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Sequential):
        return describe_layers(model, sample_input, training=training)
    # a plait GPT can only exist if its module is loaded: look it up rather than import it,
    # so plait.plan itself never loads plait.parallel (and with it the distributed runtime)
    gpt_module = sys.modules.get("plait.models.gpt")
    if gpt_module is not None and isinstance(model, gpt_module.GPT):
        layers = _gpt_layers(model)
        named = [(f"{index}:{type(layer).__name__}", layer) for index, layer in enumerate(layers)]
        # the head layer reaches the tied weight through the model: exclude all the model holds
        return _describe(named, sample_input, training=training, exclude=[*model.parameters(), *model.buffers()])
    return _describe([(f"0:{type(model).__name__}", model)], sample_input, training=training, exclude=())


def _gpt_layers(model) -> list:
    from plait.models.gpt_layers import gpt_layers

    # GPT.pipeline_layers refuses a tied head (two stages would hold the weight); one
    # device tracing the layers in turn is fine: the head's params() omit the weight
    return gpt_layers(model)


def _named_layers(layers) -> list:
    from torch import nn

    if isinstance(layers, nn.Sequential):
        named = [(child if child != str(index) else f"{index}:{type(layer).__name__}", layer)
                 for index, (child, layer) in enumerate(layers.named_children())]
    elif isinstance(layers, nn.Module) and not isinstance(layers, nn.ModuleList):
        raise TypeError(f"layers must be an nn.Sequential or a list of modules, got one {type(layers).__name__}: "
                        f"use describe_module(model, sample_input) or pass [model]")
    elif isinstance(layers, (list, tuple, nn.ModuleList)):
        named = [(f"{index}:{type(layer).__name__}", layer) for index, layer in enumerate(layers)]
    else:
        raise TypeError(f"layers must be an nn.Sequential or a list of modules, got {type(layers).__name__}")
    bad = [f"layers[{index}] is a {type(layer).__name__}" for index, (_, layer) in enumerate(named)
           if not isinstance(layer, nn.Module)]
    if bad:
        raise TypeError("layers must all be nn.Module: " + ", ".join(bad))
    if not named:
        raise ValueError("layers is empty: pass at least one nn.Module (e.g. nn.Sequential(nn.Linear(4, 4)))")
    return named


class Snapshot:
    """What a traced run changes, to put back: training flags, parameters' .grad,
    buffer values, and plait ConsistentDropout streams (modules with an int
    ``calls`` and a ``reseed``: duck-typed so plait.plan need not import
    plait.parallel)."""

    def __init__(self, modules: list, params: list, buffers: list):
        self.training = [(module, module.training) for module in modules]
        self.grads = [(param, param.grad) for param in params]
        self.buffers = [(buffer, buffer.detach().clone()) for buffer in buffers]
        self.streams = [(module, module.calls) for module in modules if isinstance(getattr(module, "calls", None), int)
                        and callable(getattr(module, "reseed", None))]

    def clear_grads(self) -> None:
        for param, _ in self.grads:
            param.grad = None

    def restore(self) -> None:
        import torch

        for module, training in self.training:
            module.training = training
        for param, grad in self.grads:
            param.grad = grad
        with torch.no_grad():
            for buffer, value in self.buffers:
                buffer.copy_(value)
        for module, calls in self.streams:
            module.calls = calls


def _unique(items) -> list:
    return list({id(item): item for item in items}.values())


def _describe(named: list, sample_input, *, training: bool, exclude) -> list[LayerCost]:
    import torch

    if not isinstance(sample_input, torch.Tensor):
        raise TypeError(f"sample_input must be a tensor (one micro-batch), got {type(sample_input).__name__}")
    modules = _unique(module for _, layer in named for module in layer.modules())
    params = _unique(param for module in modules for param in module.parameters(recurse=False))
    buffers = _unique(buffer for module in modules for buffer in module.buffers(recurse=False))
    exclude_keys = _exclude_keys([*params, *buffers, *exclude])
    leaves = [tensor for tensor in (*exclude, sample_input) if tensor.is_leaf and tensor.requires_grad]
    snapshot = Snapshot(modules, _unique([*params, *leaves]), buffers)
    devices = [sample_input.device] if sample_input.device.type == "cuda" else []
    costs, counted = [], set()
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=devices):
            for _, layer in named:
                layer.train(training)
            x = sample_input
            for index, (name, layer) in enumerate(named):
                if index:
                    x = x.detach().requires_grad_(x.is_floating_point())
                new_params = [param for param in layer.parameters() if id(param) not in counted]
                counted.update(id(param) for param in new_params)
                snapshot.clear_grads()
                cost, x = _measure(layer, index, name, x, exclude_keys)
                costs.append(LayerCost(params=sum(param.numel() for param in new_params), **cost))
    finally:
        snapshot.restore()
    return costs


def _measure(layer, index: int, name: str, x, exclude_keys: frozenset):
    """One layer's forward and backward under the three counters: (LayerCost
    fields but params, the output detached)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = _counter_type()()
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as flops, counter:
        with _SavedStorages(exclude_keys) as saved:
            try:
                output = layer(x)
            except Exception as error:
                error.add_note(f"while describing layers[{index}] ({name}) on an input of shape {tuple(x.shape)}")
                raise
            activation_bytes = saved.nbytes
        if not isinstance(output, torch.Tensor):
            raise ValueError(f"layers[{index}] ({name}) returned a {type(output).__name__}, not a tensor: each layer "
                             f"must return the one tensor the next layer takes (wrap it to pick that tensor)")
        forward = dict(forward_flops=float(flops.get_total_flops()), forward_kernels=counter.kernels,
                       forward_bytes=float(counter.nbytes))
        counter.kernels, counter.nbytes = 0, 0
        if output.requires_grad:
            counter.paused = True  # the seed gradient is set-up, not the layer's backward
            gradient = torch.ones_like(output)
            counter.paused = False
            output.backward(gradient)
        backward = dict(backward_flops=float(flops.get_total_flops()) - forward["forward_flops"],
                        backward_kernels=counter.kernels, backward_bytes=float(counter.nbytes))
    return dict(name=name, **forward, **backward, activation_bytes=float(activation_bytes),
                input_bytes=float(_tensor_nbytes(x)), output_bytes=float(_tensor_nbytes(output))), output.detach()
