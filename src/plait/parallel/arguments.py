"""The arguments every parallel wrapper takes, checked the same way: the module it
wraps and the process group it runs on, and the one place a wrapper turns its
``group=`` into the Communicator it runs on (:func:`wrapper_communicator`). A string,
a class or None where a module belongs is named as a TypeError before anything else runs (it used to surface as an
AttributeError from deep inside the wrapper).

``group=`` is None (the world), a torch ProcessGroup, a 1-D torch ``DeviceMesh`` (or
one named dimension of a larger one, ``mesh["dp"]``: its process group) or a plait
Communicator (plait.comm.communicator.communicator_for). A wrapper keeps ``.group``
as given (the mesh itself, for a mesh) and runs on ``.communicator``, the process
group's own communicator, the same one a collective with ``group=mesh.get_group()``
uses.

A model with DTensor parameters (torch's tensor parallelism, ``parallelize_module``)
is taken by the wrappers that work on its local shards (DataParallel); the others
refuse it here, naming the parameter and the fix, before anything runs (a DTensor is
known by plait.comm.layout.is_dtensor, which does not import torch.distributed.tensor)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from plait.comm.communicator import Communicator, check_group, communicator_for
from plait.comm.layout import is_dtensor


def check_module(module, owner: str, name: str = "module") -> nn.Module:
    """``module`` itself, or a TypeError naming ``owner``'s argument and what it must be."""
    if isinstance(module, nn.Module):
        return module
    if isinstance(module, type) and issubclass(module, nn.Module):
        raise TypeError(f"{owner}: {name} is the class {module.__name__}, not a module: pass an instance, e.g. "
                        f"{module.__name__}(...)")
    raise TypeError(f"{owner}: {name} must be a torch.nn.Module, got {type(module).__name__} ({module!r:.60})")


def check_wrapper_arguments(module, group, owner: str, *, dtensor_parameters: bool = False) -> None:
    """A wrapper's module and ``group=`` (None, a ProcessGroup, a 1-D DeviceMesh or a
    plait Communicator). ``dtensor_parameters``: whether the wrapper takes DTensor
    parameters (else they are refused by name: see :func:`refuse_dtensor_parameters`)."""
    check_module(module, owner)
    try:
        check_group(group)
    except TypeError as error:
        raise TypeError(f"{owner}: {error}") from None
    if not dtensor_parameters:
        refuse_dtensor_parameters(module.named_parameters(), owner)
    refuse_sharded_parameters(module.named_parameters(), owner)


def refuse_sharded_parameters(named, owner: str) -> None:
    """A ValueError naming the first parameter among ``named`` with no data of its own:
    on the meta device, or sharded: a ZeRO stage-3 wrapper (live or dropped) leaves each parameter it shards a
    placeholder (one element expanded) or a view of a released buffer; reading it as a
    model's would be NaN or out of bounds."""
    for name, param in named:
        if param.is_meta:  # FSDP2's deferred init: the wrapper copies or checks values it would not have
            raise ValueError(f"{owner}: {name!r} is on the meta device (no data): materialise the model before "
                             "wrapping (model.to_empty(device=...), then initialise it); sharding first and "
                             "materialising after, FSDP2's deferred init, is not supported")
        if is_dtensor(param) or param.numel() <= 1:
            continue
        span = 1 + sum((size - 1) * stride for size, stride in zip(param.shape, param.stride()))
        if 0 in param.stride() or param.untyped_storage().nbytes() < (param.storage_offset() + span) * \
                param.element_size():
            raise ValueError(f"{owner}: {name!r} is sharded by a ZeRO stage-3 wrapper (live or dropped; it holds no "
                             "data of its own): take zero.full_state_dict() before dropping the wrapper and load it "
                             "into a fresh model (model.load_state_dict), then wrap that model")


DTENSOR_FIX = ("build the tensor parallelism with plait's layers (plait.parallel.tensor.ColumnParallelLinear / "
               "RowParallelLinear), which hold plain tensors, or wrap the DTensor model in "
               "plait.parallel.DataParallel(model, group=mesh['dp'])")


def refuse_dtensor_parameters(named, owner: str, fix: str = DTENSOR_FIX) -> None:
    """A TypeError naming the DTensor parameters among ``named`` ((name, parameter)
    pairs) for a wrapper that flattens, ships or tracks whole parameters (ZeRO, the
    parameter server, the pipeline engine): it would mix torch's DTensor shards with its
    own plain buffers and fail somewhere unrelated. ``fix``: what to do instead (by
    default plait's own tensor-parallel layers, which hold plain tensors, or
    DataParallel over the dp dimension, which works on the local shards)."""
    names = [name for name, param in named if is_dtensor(param)]
    if names:
        shown = ", ".join(repr(name) for name in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise TypeError(f"{owner}: the model has DTensor parameters ({shown}: torch tensor parallelism, "
                        f"parallelize_module), which {owner} cannot shard, flatten or send: {fix}")


def wrapper_communicator(group, owner: str) -> Communicator:
    """The Communicator a wrapper runs every collective on, resolved once when it is
    built (plait.comm.communicator.communicator_for, the one rule): ``group=`` a
    Communicator is used as given; None (the world), a ProcessGroup or a 1-D DeviceMesh
    (its process group) means that group's communicator, created with the program's stated config if it has none yet
    (so every rank of the group must build the wrapper, as it must anyway). A
    ValueError when this rank is not in the group."""
    try:
        communicator = communicator_for(group)
    except TypeError as error:
        raise TypeError(f"{owner}: {error}") from None
    if communicator is None:
        raise ValueError(f"{owner}: this rank (global rank {dist.get_rank()}) is not a member of the group it was "
                         "given; build the wrapper on the group's ranks only")
    return communicator
