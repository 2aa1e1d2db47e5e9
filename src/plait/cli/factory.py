"""A user's model factory, ``PKG.MOD:FUNCTION``: what every CLI that imports a user's
model (``plait optimize``, ``plait plan --module``) loads, with one set of rules and
one set of messages.

PKG.MOD is imported with the current directory on the import path (as ``python -m``
has it); FUNCTION is called with no arguments and returns ``(module, example_inputs)``:
an ``nn.Module`` instance and either one tensor or a tuple of tensors it is called
with (``module(*example_inputs)``). Both of these are accepted::

    def build():
        return MyNet().eval(), torch.randn(8, 3, 32, 32)        # one input
    def build_pair():
        return MyNet().eval(), (tokens, mask)                    # several inputs

Anything else is a ``FactoryError`` (a ValueError: the CLI prints it as one line and
exits 2) naming the spec, what it named, returned or raised, and what it must be.
``check_forward`` then runs the module once, eagerly, on its example inputs, before
any trace or compile, so that inputs of the wrong shape are reported as which input,
what shape it had and, where the failing layer says (a Linear's in_features, a
convolution's in_channels, ...), what it expected.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path

import torch
from torch import nn

# The --help text of a factory argument (plait optimize's target, plait plan --module).
FACTORY_HELP = ("a function called with no arguments that returns (module, example_inputs): an nn.Module instance "
                "and a tensor or a tuple of tensors it is called with, e.g. `return net.eval(), torch.randn(2, 3, 32, "
                "32)` or `return net.eval(), (tokens, mask)`")
_MUST = ("it must name a function taking no arguments that returns (module, example_inputs): an nn.Module instance "
         "and a tensor or a tuple of tensors")
_EXAMPLE_SPEC = "plait.graph.examples:resnet18_like"
_MAX_REPR = 60  # characters of a value shown in a message


class FactoryError(ValueError):
    """A factory spec that does not give (module, example_inputs), or inputs the module refuses."""


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_REPR else text[:_MAX_REPR - 3] + "..."


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _ensure_cwd_importable() -> None:
    """The console script's sys.path lacks the working directory that `python -m` has."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def _path_hint(module_part: str, attribute: str) -> str:
    """'write fac:build from /dir' for a spec written as a file path (dir/fac.py:build)."""
    path = Path(module_part)
    stem = path.stem if path.suffix == ".py" else path.name
    directory = path.parent.resolve() if str(path.parent) not in ("", ".") else Path.cwd()
    name = f"{stem}:{attribute or 'FUNCTION'}"
    if directory == Path.cwd():
        return f"write {name} (plait imports modules from the current directory)"
    return f"write {name} and run plait from {directory} (or put it on PYTHONPATH)"


def import_attribute(spec: str, what: str = "factory", form: str = "PKG.MOD:FUNCTION",
                     example: str = _EXAMPLE_SPEC):
    """The object PKG.MOD:NAME names (``what``, ``form`` and ``example`` name the argument in
    messages: "factory", "PKG.MOD:FUNCTION"); FactoryError saying which part is wrong and the fix."""
    if not isinstance(spec, str):
        raise FactoryError(f"{what} {spec!r} is not a {form} string")
    module_name, colon, attribute = spec.partition(":")
    looks_like_path = "/" in module_name or "\\" in module_name or module_name.endswith(".py")
    if looks_like_path:
        raise FactoryError(f"{what} {spec!r} is a file path, not {form}: {_path_hint(module_name, attribute)}")
    if not colon or not module_name or not attribute:
        raise FactoryError(f"{what} {spec!r} is not {form}: name it in an importable module, e.g. {example}")
    _ensure_cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise FactoryError(f"{what} {spec!r}: cannot import {module_name!r} ({_first_line(error)}): put it in the "
                           f"current directory or on PYTHONPATH, or install its package") from None
    except Exception as error:  # the user's module itself fails to import (SyntaxError, a raise at import, ...)
        raise FactoryError(f"{what} {spec!r}: importing {module_name!r} raised {_first_line(error)}: "
                           f"fix the module") from None
    if not hasattr(module, attribute):
        public = sorted(name for name, value in vars(module).items()
                        if not name.startswith("_") and inspect.isroutine(value))
        listing = f"; its functions: {', '.join(public[:20])}" if public else "; it defines no functions"
        raise FactoryError(f"{what} {spec!r}: module {module_name!r} has no {attribute!r}{listing}")
    return getattr(module, attribute)


def _check_callable(spec: str, function) -> None:
    if isinstance(function, nn.Module):
        raise FactoryError(f"factory {spec!r} names an nn.Module instance ({type(function).__name__}), not a "
                           f"function: {_MUST}")
    if isinstance(function, type):
        kind = "nn.Module class" if issubclass(function, nn.Module) else "class"
        raise FactoryError(f"factory {spec!r} names the {kind} {function.__name__}, not a function: {_MUST}")
    if not callable(function):
        raise FactoryError(f"factory {spec!r} names a {type(function).__name__} ({_short(function)}), not a "
                           f"function: {_MUST}")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have none: calling them tells
        return
    try:
        signature.bind()
    except TypeError:
        name = getattr(function, "__name__", "it")
        raise FactoryError(f"factory {spec!r}: {name}{signature} needs arguments and plait calls it with none: "
                           f"{_MUST}") from None


def _type_name(value) -> str:
    if isinstance(value, type):
        return f"the class {value.__name__}"
    return "None" if value is None else type(value).__name__


def _check_result(spec: str, result) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    returned = f"factory {spec!r} returned"
    if isinstance(result, nn.Module):
        raise FactoryError(f"{returned} a bare {type(result).__name__}: return (module, example_inputs), e.g. "
                           f"`return model.eval(), torch.randn(2, 3, 32, 32)`, so that plait can run it on real inputs")
    if not isinstance(result, (tuple, list)):
        raise FactoryError(f"{returned} {_type_name(result)}: {_MUST}")
    if len(result) != 2:
        items = ", ".join(_type_name(item) for item in result[:4]) + (", ..." if len(result) > 4 else "")
        raise FactoryError(f"{returned} {len(result)} items ({items}), not 2: {_MUST}")
    module, inputs = result
    if not isinstance(module, nn.Module):
        hint = f" (call the class: {module.__name__}(...))" if isinstance(module, type) and issubclass(
            module, nn.Module) else ""
        raise FactoryError(f"{returned} ({_type_name(module)}, {_type_name(inputs)}): its first item must be an "
                           f"nn.Module instance{hint}; {_MUST}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise FactoryError(f"{returned} example_inputs of type {_type_name(inputs)}: {_MUST}")
    bad = [f"item {index} is {_type_name(item)}" for index, item in enumerate(inputs)
           if not isinstance(item, torch.Tensor)]
    if bad:
        raise FactoryError(f"{returned} example_inputs with non-tensors ({', '.join(bad[:4])}): {_MUST}")
    if not inputs:
        raise FactoryError(f"{returned} an empty tuple of example_inputs: {_MUST}")
    return module, tuple(inputs)


def load_factory(spec: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Import PKG.MOD:FUNCTION, call FUNCTION() and return (module, example_inputs as a tuple).

    FactoryError (one line: the spec, what it named, returned or raised, what it must
    be) for a spec that is not PKG.MOD:FUNCTION, a module that cannot be imported, a
    name that is not a function taking no arguments, a function that raises, and a
    result that is not (nn.Module instance, tensor or tuple of tensors)."""
    function = import_attribute(spec)
    _check_callable(spec, function)
    try:
        result = function()
    except Exception as error:
        name = getattr(function, "__name__", spec)
        raise FactoryError(f"factory {spec!r}: calling {name}() raised {_first_line(error)}: {_MUST}") from None
    return _check_result(spec, result)


# ----- the example inputs, run once eagerly ---------------------------------------------------

def describe_tensor(tensor: torch.Tensor) -> str:
    """'(2, 5) float32' (shape and dtype)."""
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _dtype_of(module: nn.Module) -> str:
    weight = getattr(module, "weight", None)
    return f" {str(weight.dtype).removeprefix('torch.')}" if isinstance(weight, torch.Tensor) else ""


def expected_input(module: nn.Module) -> str | None:
    """What a layer takes, where its attributes say: 'in_features 8: shape (..., 8) float32'."""
    dtype = _dtype_of(module)
    if isinstance(module, nn.Linear):
        return f"in_features {module.in_features}: shape (..., {module.in_features}){dtype}"
    if isinstance(module, (nn.modules.conv._ConvNd)):
        spatial = {1: "L", 2: "H, W", 3: "D, H, W"}.get(len(module.kernel_size), "...")
        return (f"in_channels {module.in_channels}: shape (N, {module.in_channels}, {spatial}) or "
                f"({module.in_channels}, {spatial}){dtype}")
    if isinstance(module, nn.Embedding):
        return f"integer indices in [0, {module.num_embeddings})"
    if isinstance(module, nn.EmbeddingBag):
        return f"integer indices in [0, {module.num_embeddings})"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return f"num_features {module.num_features}: shape (N, {module.num_features}, ...){dtype}"
    if isinstance(module, nn.GroupNorm):
        return f"num_channels {module.num_channels}: shape (N, {module.num_channels}, ...){dtype}"
    if isinstance(module, nn.LayerNorm):
        trailing = ", ".join(str(size) for size in module.normalized_shape)
        return f"normalized_shape {tuple(module.normalized_shape)}: shape (..., {trailing}){dtype}"
    if isinstance(module, nn.MultiheadAttention):
        return f"embed_dim {module.embed_dim}: query shape (..., {module.embed_dim})"
    if isinstance(module, nn.RNNBase):
        return f"input_size {module.input_size}: shape (..., {module.input_size})"
    return None


def _first_layer_with_expectation(module: nn.Module) -> tuple[str, nn.Module, str] | None:
    for name, child in module.named_modules():
        expected = expected_input(child)
        if expected is not None:
            return name, child, expected
    return None


def _fed(args, inputs: tuple[torch.Tensor, ...]) -> str:
    """What a layer was called with: 'input 1, (2, 5) float32' when it is an example input itself."""
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    if not tensors:
        return "no tensor"
    first = tensors[0]
    for index, tensor in enumerate(inputs):
        if first is tensor:
            return f"input {index}, {describe_tensor(first)}"
    return describe_tensor(first)


def check_forward(spec: str, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Run ``module(*inputs)`` once, eagerly, with no autograd (buffers, training flags
    and the RNG state put back); FactoryError naming the input, the shape it has, the
    layer that failed and, where that layer's attributes tell, the shape it expects.

    Done before any trace or compile, whose errors on wrong shapes are a long graph
    trace; a layer that fails is found with forward pre-hooks (the innermost module
    entered and not left when the error came)."""
    running: list[tuple[str, nn.Module, tuple]] = []
    handles = []

    def enter(name):
        def hook(layer, args):
            running.append((name, layer, args))
        return hook

    def leave(layer, args, output):
        if running and running[-1][1] is layer:
            running.pop()

    buffers = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        for name, layer in module.named_modules():
            handles.append(layer.register_forward_pre_hook(enter(name)))
            handles.append(layer.register_forward_hook(leave))
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            module(*inputs)
    except Exception as error:
        raise FactoryError(_forward_message(spec, module, inputs, running, error)) from None
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def _forward_message(spec: str, module: nn.Module, inputs, running, error: Exception) -> str:
    given = "; ".join(f"input {index}: {describe_tensor(tensor)}" for index, tensor in enumerate(inputs))
    parts = [f"factory {spec!r}: its {type(module).__name__} fails on the example inputs it returned ({given})"]
    if running:
        name, layer, args = running[-1]
        label = f"layer {name!r} ({type(layer).__name__})" if name else f"the {type(layer).__name__} itself"
        expected = expected_input(layer)
        parts.append(f"{label} got {_fed(args, inputs)}" + (f" and expects {expected}" if expected else ""))
        if not expected and not name:  # failed in the model's own code: what its first layer takes
            first = _first_layer_with_expectation(module)
            if first is not None:
                parts.append(f"its first layer {first[0]!r} ({type(first[1]).__name__}) expects {first[2]}")
    parts.append(_first_line(error))
    return ": ".join(parts) + "; return example inputs the module accepts"
