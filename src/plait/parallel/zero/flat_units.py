"""The flat buffers ZeRO shards (plait.parallel.zero.module, plait.parallel.zero.optimizer):
a unit's parameters packed into one buffer, padded with zeros to a multiple of N and
cut into N equal shards (rank r owns shard r), the module's parameters made views into
it; gathered with an all-gather, released with ``resize_(0)``; their gradients
reduce-scattered (several units in one call) and the averages added into the shards'
gradients. ``plait.parallel.zero.engine`` drives them.

A released unit (stage 3) is *armed* while autograd may still need its views (between
a unit's forward and its backward: saved views of the freed storage see the data again
once it is re-gathered) and *at rest* otherwise (after its backward, after a no-grad
forward, at construction, after ``full_parameters()``): each parameter's ``.data`` is
then a placeholder of its shape and dtype that reads as NaN (one NaN element expanded
with zero strides: no memory, and nothing computed from it is silently a number) instead
of a view into a storage of size 0, which torch reads without a bounds check (a
segfault). Every gather re-attaches the views (``param.data = full[...]``: no version
counter moves). A parameter another wrapper has taken over since (its storage is no
longer this unit's) is left alone.

Mixed precision (``param_dtype``, ``reduce_dtype``; FSDP2's ``MixedPrecisionPolicy``): the
shard the optimizer steps keeps the parameters' own dtype (the float32 master), the
buffer the module computes with is in ``param_dtype`` (each gather casts the shards to it
first, so the all-gather sends ``param_dtype``), and the gradients are reduce-scattered in
``reduce_dtype`` and added into the master shard's gradient in the master's dtype.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from plait import comm


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on ``tensor``'s storage with a version counter of its own: writing
    through it does not mark autograd's saved views of ``tensor`` as modified."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


class FlatUnit:
    """One unit's parameters as one flat buffer, padded to N equal shards."""

    def __init__(self, index: int, named: list[tuple[str, nn.Parameter]], world_size: int, rank: int,
                 shard_params: bool, *, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None):
        self.index = index
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        dtypes = {param.dtype for param in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO: unit {index} mixes parameter dtypes {sorted(map(str, dtypes))} "
                             f"({', '.join(self.names)}); give every parameter one dtype")
        master_dtype = self.params[0].dtype
        self.dtype = param_dtype or master_dtype  # the buffer the module computes with
        self.reduce_dtype = reduce_dtype or self.dtype  # the gradients' reduce-scatter
        self.device = self.params[0].device
        self.numel = sum(param.numel() for param in self.params)
        self.shard_numel = math.ceil(self.numel / world_size)
        self.padded = self.shard_numel * world_size
        self.rank, self.world_size = rank, world_size
        self.offsets = []
        master = torch.zeros(self.padded, dtype=master_dtype, device=self.device)
        offset = 0
        for param in self.params:
            self.offsets.append(offset)
            master[offset:offset + param.numel()].copy_(param.detach().reshape(-1))
            offset += param.numel()
        self.full = master if self.dtype == master_dtype else master.to(self.dtype)
        self._nan = torch.full((), math.nan, dtype=self.dtype, device=self.device)  # the placeholders' one element
        self.resting = False  # the parameters are placeholders (see the module docstring)
        self._attach(every=True)
        start = rank * self.shard_numel
        # what the optimizer steps: with the parameters kept whole (stages 1, 2) in their own
        # dtype, this rank's slice of the buffer itself (the step updates the parameters in
        # place, no copy); with them sharded (stage 3) or computed in another dtype, a master
        # copy of its own in the parameters' dtype (the values given, never rounded)
        view = master[start:start + self.shard_numel].detach()
        self.shard = nn.Parameter(view.clone() if shard_params or self.full is not master else view)
        self.gathered = True
        self.ready: list[bool] = []  # which parameters' gradients this backward has delivered
        self.used = [False] * len(self.params)  # had a gradient at a reduce since the last zero_grad
        self.handle = None  # a prefetch's all-gather in flight

    def _attach(self, every: bool = False) -> None:
        """The parameters made views into the buffer (``every``: at construction; else
        only those still this unit's)."""
        for param, offset in zip(self.params, self.offsets):
            if every or self.owns(param):
                param.data = self.full[offset:offset + param.numel()].view(param.shape)
        self.resting = False

    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s data is still this unit's (a view of its buffer, or its
        placeholder), not another wrapper's since."""
        storage = param.untyped_storage()._cdata
        return storage == self.full.untyped_storage()._cdata or storage == self._nan.untyped_storage()._cdata

    def rest(self) -> None:
        """A released unit's parameters become NaN placeholders (no memory; reading them
        is safe) until the next gather re-attaches them."""
        if self.gathered or self.resting:
            return
        for param in self.params:
            if self.owns(param):
                param.data = self._nan.expand(param.shape)
        self.resting = True

    def arm(self) -> None:
        """A resting unit's parameters made views of its (released) buffer again, so that a
        use outside the unit's own forward fails with torch's storage error, as before
        the rest, instead of computing with NaN. Costs an allocation without a fill."""
        if self.gathered or not self.resting:
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.padded * self.full.element_size())
        self._attach()
        storage.resize_(0)

    def flat_grad(self) -> torch.Tensor:
        """The parameters' gradients, flat and padded (zeros where there is none), in
        ``reduce_dtype``."""
        flat = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.device)
        for param, offset in zip(self.params, self.offsets):
            if param.grad is not None:
                flat[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        return flat

    def free(self, keep_views: bool = False) -> None:
        """Release the gathered buffer (stage 3), the unit at rest; ``keep_views``: armed
        instead (autograd may still need the views: after a forward, before its backward)."""
        self.wait()  # a prefetch still writing into it
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False
        if not keep_views:
            self.rest()

    def wait(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.wait()

    def gather(self, group, algorithm, async_op: bool = False):
        """Allocate the buffer again (if freed) and all-gather every rank's shard into it."""
        storage = self.full.untyped_storage()
        nbytes = self.padded * self.full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        if self.resting:
            self._attach()
        self.gathered = True
        source = self.shard.detach().to(self.dtype)  # the master cast to the compute dtype (or itself)
        if source.untyped_storage().data_ptr() == storage.data_ptr():
            source = source.clone()  # a slice of the buffer the gather writes
        if self.world_size == 1:
            alias(self.full).copy_(source)
            return None
        return comm.all_gather_into_tensor(alias(self.full), source, group=group, async_op=async_op,
                                           algorithm=algorithm)


class _Scattered:
    """A coalesced gather's handle: waiting copies each unit's slices out of the one
    buffer the collective filled (once; later waits only wait)."""

    def __init__(self, handle, finish):
        self.handle, self._finish = handle, finish

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


def gather_units(units: list[FlatUnit], group, algorithm, async_op: bool = False):
    """``FlatUnit.gather`` for several units in one all-gather (one call's overhead
    instead of one each; the same bytes): every rank sends its shards back to back
    and each unit's slices are copied into its buffer. Returns the handle every unit
    then holds (async), or None."""
    if len(units) == 1 or len({unit.dtype for unit in units}) > 1 or units[0].world_size == 1:
        for unit in units:  # a loop, not a comprehension: one frame less before each gather's first message
            unit.handle = unit.gather(group, algorithm, async_op=async_op)
        return None
    world_size = units[0].world_size
    sizes = [unit.shard_numel for unit in units]
    total = sum(sizes)
    for unit in units:
        storage = unit.full.untyped_storage()
        if storage.nbytes() != unit.padded * unit.full.element_size():
            storage.resize_(unit.padded * unit.full.element_size())
        if unit.resting:
            unit._attach()  # noqa: SLF001 - gather's own step, for several units at once
        unit.gathered = True
    sent = torch.cat([unit.shard.detach().to(unit.dtype) for unit in units])
    received = torch.empty(total * world_size, dtype=sent.dtype, device=sent.device)

    def finish():
        for rank in range(world_size):
            offset = rank * total
            for unit, size in zip(units, sizes):
                alias(unit.full)[rank * size:(rank + 1) * size].copy_(received[offset:offset + size])
                offset += size

    handle = comm.all_gather_into_tensor(received, sent, group=group, async_op=async_op, algorithm=algorithm)
    combined = _Scattered(handle if async_op else None, finish)
    if not async_op:
        combined.wait()
        return None
    for unit in units:
        unit.handle = combined
    return combined


def reduce_units(units: list[FlatUnit], group, algorithm, async_op: bool, keep_grads: bool = False) -> list:
    """Reduce-scatter several units' gradients in one call (rank-major: rank r's
    slice of every unit, back to back); the full gradients are dropped and the units'
    ``used`` flags set (``keep_grads``: neither, stage 1's speculative reduction).
    Returns (unit, out, flat, handle) per unit, ``out`` this rank's summed slice once
    the handle is waited for (``add_reduced``)."""
    world_size = units[0].world_size
    flats = []
    for unit in units:
        flats.append(unit.flat_grad())
        if keep_grads:
            continue
        unit.used = [was or param.grad is not None for was, param in zip(unit.used, unit.params)]
        for param in unit.params:
            param.grad = None
    sizes = [unit.shard_numel for unit in units]
    total = sum(sizes)
    if world_size == 1 or len(units) == 1 or len({flat.dtype for flat in flats}) > 1:
        entries = []
        for unit, flat in zip(units, flats):
            out = torch.empty(unit.shard_numel, dtype=unit.reduce_dtype, device=unit.device)
            handle = None
            if world_size == 1:
                out.copy_(flat)
            else:
                handle = comm.reduce_scatter_tensor(out, flat, group=group, algorithm=algorithm, async_op=async_op)
            entries.append((unit, out, flat, handle))
        return entries
    laid = torch.cat([flat.view(world_size, size) for flat, size in zip(flats, sizes)], dim=1).reshape(-1)
    out = torch.empty(total, dtype=laid.dtype, device=laid.device)
    handle = comm.reduce_scatter_tensor(out, laid, group=group, algorithm=algorithm, async_op=async_op)
    entries, offset = [], 0
    for unit, size in zip(units, sizes):
        entries.append((unit, out[offset:offset + size], laid, handle))
        offset += size
    return entries


def add_reduced(in_flight: list, world_size: int) -> None:
    """Wait for each (unit, out, flat, handle) reduce-scatter of ``in_flight`` and add
    its average (out / N) into the unit's shard gradient; every handle is waited for,
    then the first error is raised."""
    errors = []
    for unit, out, _flat, handle in in_flight:
        try:
            if handle is not None:
                handle.wait()
        except BaseException as error:  # noqa: BLE001 - every handle waited; the first raised
            errors.append(error)
            continue
        average = out.div_(world_size).to(unit.shard.dtype)
        unit.shard.grad = average if unit.shard.grad is None else unit.shard.grad.add_(average)
    if errors:
        raise errors[0]
