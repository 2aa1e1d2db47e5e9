"""The arguments every parallel wrapper takes, checked the same way: the module it
wraps and the process group it runs on, and the one place a wrapper turns its
``group=`` into the Communicator it runs on (:func:`wrapper_communicator`). A string,
a class or None where a module belongs is named as a TypeError before anything else runs (it used to surface as an
AttributeError from deep inside the wrapper)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from plait.comm.communicator import Communicator, check_group, communicator_for


def check_module(module, owner: str, name: str = "module") -> nn.Module:
    """``module`` itself, or a TypeError naming ``owner``'s argument and what it must be."""
    if isinstance(module, nn.Module):
        return module
    if isinstance(module, type) and issubclass(module, nn.Module):
        raise TypeError(f"{owner}: {name} is the class {module.__name__}, not a module: pass an instance, e.g. "
                        f"{module.__name__}(...)")
    raise TypeError(f"{owner}: {name} must be a torch.nn.Module, got {type(module).__name__} ({module!r:.60})")


def check_wrapper_arguments(module, group, owner: str) -> None:
    """A wrapper's module and ``group=`` (None, a ProcessGroup or a plait Communicator)."""
    check_module(module, owner)
    try:
        check_group(group)
    except TypeError as error:
        raise TypeError(f"{owner}: {error}") from None


def wrapper_communicator(group, owner: str) -> Communicator:
    """The Communicator a wrapper runs every collective on, resolved once when it is
    built (plait.comm.communicator.communicator_for, the one rule): ``group=`` a
    Communicator is used as given; None (the world) or a ProcessGroup means that
    group's communicator, created with the program's stated config if it has none yet
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
