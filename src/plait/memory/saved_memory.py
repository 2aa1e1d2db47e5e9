"""Activation memory measured from live storages, not from anyone's bookkeeping.

``SavedTensorMeter`` installs ``torch.autograd.graph.saved_tensors_hooks`` whose pack
wraps every tensor autograd saves for backward in a small holder and registers a
``weakref.finalize`` on it: autograd keeps the holder exactly as long as it keeps the
saved tensor (until the backward that uses it frees the graph), so the finalizer
marks the release. A storage counts, with its whole ``nbytes()``, while at least
one holder of a tensor on it is alive; several saved views of one storage count it
once. ``live_bytes`` is the sum over such storages, ``peak_bytes`` its maximum
since ``reset``. Storages named in ``exclude`` (parameters, the caller's batch)
never count: they are not held for backward.

This is independent of ``PipelineEngine``'s own figure (which adds up, per
micro-batch, the bytes its hooks saw at the forward and drops them where the
schedule runs the backward): here nothing knows the schedule; releases are
whatever autograd actually does. Hooks nest innermost-first, so a step measured
this way hides its stage computations from the engine's hooks: measure in a step
of its own.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch import nn


class _Saved:
    """What autograd keeps instead of the tensor (the tensor comes back at unpack)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        # detached (same storage and version counter): holding a saved *output* itself
        # would make a cycle output -> grad_fn -> saved holder -> output, which only
        # the garbage collector breaks, so the release would come late
        self.tensor = tensor.detach()


class SavedTensorMeter:
    """Bytes of distinct storages saved for backward and alive at once (see the module docstring)."""

    def __init__(self, exclude=()):
        self.exclude: set[int] = set(exclude)  # storage data_ptrs never counted
        self.exclude_storages: set[int] = set()  # storages never counted, by identity (see reset)
        self.enabled = False
        self._holders: Counter = Counter()  # storage data_ptr -> live holders
        self._nbytes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset(self, exclude=()) -> None:
        """Start a new peak; ``exclude``: storages (tensors or data_ptrs) that never count.
        A tensor's storage is excluded by identity too (``_cdata``, the storage object,
        which a resize keeps): ZeRO 3 frees and re-gathers its parameters' storages, so
        their addresses change within a step."""
        self.exclude = {item if isinstance(item, int) else item.untyped_storage().data_ptr() for item in exclude}
        self.exclude_storages = {item.untyped_storage()._cdata for item in exclude if not isinstance(item, int)}
        self.peak_bytes = self.live_bytes

    def pack(self, tensor: torch.Tensor) -> _Saved:
        """A saved-tensor pack hook (composable: another hook may call it and hand its
        result to autograd); ``unpack`` is its partner."""
        holder = _Saved(tensor)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage._cdata in self.exclude_storages or storage.nbytes() == 0:
            return holder
        if self._holders[key] == 0:
            self._nbytes[key] = storage.nbytes()
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._holders[key] += 1
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live_bytes -= self._nbytes.pop(key)

    def hooks(self):
        """The context manager that meters what autograd saves inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    @staticmethod
    def unpack(holder: _Saved) -> torch.Tensor:
        return holder.tensor

    def wrap(self, function):
        """``function`` run under the hooks while ``enabled`` (a stage module or a loss)."""
        if isinstance(function, nn.Module):
            return _MeteredModule(function, self)

        def metered(*args, **kwargs):
            if not self.enabled:
                return function(*args, **kwargs)
            with self.hooks():
                return function(*args, **kwargs)

        return metered


class _MeteredModule(nn.Module):
    def __init__(self, module: nn.Module, meter: SavedTensorMeter):
        super().__init__()
        self.module = module
        self._meter = meter  # a plain attribute: not a submodule

    def forward(self, *args, **kwargs):
        if not self._meter.enabled:
            return self.module(*args, **kwargs)
        with self._meter.hooks():
            return self.module(*args, **kwargs)
