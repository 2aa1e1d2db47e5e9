"""The arguments every parallel wrapper takes, checked the same way: the module it
wraps and the process group it runs on. A string, a class or None where a module
belongs is named as a TypeError before anything else runs (it used to surface as an
AttributeError from deep inside the wrapper)."""

from __future__ import annotations

from torch import nn

from plait.comm.communicator import check_group


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
