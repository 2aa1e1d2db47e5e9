"""The one ZeRO sharding engine behind both front-ends, ``plait.parallel.zero.module.ZeRO``
(a module wrapper) and ``plait.parallel.zero.optimizer.ShardedOptimizer`` (plait train's
optimizer): given the flat units they cut the parameters into, it runs everything that
happens to them between a forward and the next one, parameterised by the ZeRO stage.

- **Backward** (hooks on every parameter): a unit whose gradients are all in is
  *complete*; if it is ``early`` (stages 2 and 3: reduced inside each backward) its
  gradient is reduce-scattered on plait's comm thread (a stage-3 module's units
  together, one call) and the full gradients dropped; at stage 3 its buffer is freed
  unless it is ``kept`` gathered. At the backward's end the units left incomplete
  are handled the same way (all of them with ``reduce_every_unit``, so that a unit no
  gradient reached on this rank still joins its ranks' collective; else only those
  some gradient reached).
- **Reduce**: ``reduce_gradients()`` reduce-scatters the units that are not early
  (stage 1, and plait train's ``late`` ones) and adds every average into its shard's
  gradient (``wait_in_flight``); ``collect_at_backward_end`` does that wait at each
  backward's end instead of before the next backward or the step. With
  ``speculate_late`` (the ZeRO module's stage 1) a late unit's reduce-scatter is also
  issued during the backward, its full gradients kept, and the step uses that result
  where the gradients did not change since (``plait.parallel.zero.speculative``).
- **Step**: the optimizer steps this rank's shards (a parameter no rank gave a
  gradient since ``zero_grad`` keeps its value and state), one unit at a time with
  ``offload``, then every gathered unit is all-gathered.
- **Stage 3** (``gathered_modules``): each module's units are gathered around its
  forward and its backward (``plait.parallel.zero.unit_gathering``).

``sync`` (True) is what a front-end's ``no_sync()`` turns off: the backward then only
accumulates the full gradients.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from plait.parallel.data.weak_hooks import weak_method
from plait import comm
from plait.parallel.zero.flat_units import FlatUnit, add_reduced, reduce_units
from plait.parallel.zero.speculative import SpeculativeReduces
from plait.parallel.zero.state_offload import StateFiles
from plait.parallel.zero.unit_gathering import UnitGatherer


ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                          torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.RMSprop)


def check_elementwise(optimizer) -> None:
    """Refuse an optimizer whose update mixes the elements of a tensor."""
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        raise ValueError(
            f"ZeRO: {type(optimizer).__name__} is not an element-wise optimizer: ZeRO steps flat shards "
            "of the parameters, which equals stepping the parameters only when each element's update depends "
            f"on that element alone; use one of {', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}")


class ShardEngine:
    """The units' backward, reduction, step and gathers (see the module docstring).

    ``early``/``kept``: per unit (default: every unit early from stage 2, none kept);
    ``gathered_modules``: stage 3's (module, its units) pairs."""

    def __init__(self, units: list[FlatUnit], optimizer: torch.optim.Optimizer, group, algorithm: str, stage: int,
                 *, offload: StateFiles | None = None, early: list[bool] | None = None,
                 kept: list[bool] | None = None, gathered_modules=(), reduce_every_unit: bool,
                 collect_at_backward_end: bool, rest_released: bool = False, speculate_late: bool = False):
        self.units, self.optimizer, self.group, self.algorithm, self.stage = units, optimizer, group, algorithm, stage
        self.world_size, self.rank = units[0].world_size, units[0].rank
        self.offload = offload
        self.early = early if early is not None else [stage >= 2] * len(units)
        self.kept = kept if kept is not None else [False] * len(units)
        self.reduce_every_unit, self.collect_at_backward_end = reduce_every_unit, collect_at_backward_end
        # stage 3: a released unit's parameters become NaN placeholders (FlatUnit.rest; the ZeRO module,
        # whose forward arms them again), else views of the released buffer (plait train's ShardedOptimizer)
        self.keep_views = not rest_released
        self.sync = True
        self.in_backward = False
        self.on_backward_end = None  # called after each backward's end (the ZeRO module exposes gradients)
        self.reduced = False  # some average was added into the shards' gradients since zero_grad
        self._in_flight: list = []  # (unit, out, flat, handle) of reduce-scatters not yet waited for
        # late units' reduce-scatters issued during the backward (stage 1 of the ZeRO module)
        self.speculative = SpeculativeReduces(group, algorithm, self.world_size) if speculate_late else None
        self._reduce_waited_s = 0.0  # seconds in wait_in_flight (waiting for reduce-scatters, adding them in)
        # the current (or last) backward's reduce-scatters issued during it: (unit indices, handle), timing only
        self.reductions: list[tuple] = []
        self._done: set[int] = set()  # units complete this backward
        self._where = {id(param): (unit, slot) for unit in units for slot, param in enumerate(unit.params)}
        self._siblings = {unit.index: module_units for _, module_units in gathered_modules for unit in module_units}
        self._hooks = [param.register_post_accumulate_grad_hook(weak_method(self._on_grad_ready))
                       for unit in units for param in unit.params]
        self.gatherer: UnitGatherer | None = None
        if stage == 3:
            for unit, keep in zip(units, self.kept):
                if not keep:
                    unit.free(self.keep_views)
            self.gatherer = UnitGatherer([module for module, _ in gathered_modules],
                                         [module_units for _, module_units in gathered_modules],
                                         group, algorithm, self.begin_backward)

    # ----- backward --------------------------------------------------------------------
    def begin_backward(self) -> None:
        """A backward starts (its first gradient, or stage 3's first unit backward):
        the last backward's reductions added in, the units' flags cleared, the end
        queued, and the offloaded state's pages asked for."""
        if self.in_backward:
            return
        self.in_backward = True
        self.wait_in_flight()  # the previous backward's, long done by now
        self.reductions = []
        if self.speculative is not None:  # this backward changes the gradients they sent
            self.speculative.discard()
        self._done = set()
        for unit in self.units:
            unit.ready = [False] * len(unit.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self.offload is not None:  # the state's pages read in while the backward computes
            self.offload.prefetch()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self.begin_backward()
        unit, slot = self._where[id(param)]
        unit.ready[slot] = True
        if not all(unit.ready) or unit.index in self._done:
            return
        together = self._siblings.get(unit.index, [unit])  # stage 3: a module's units in one call
        if all(all(other.ready) for other in together):
            self._complete(together)

    def _complete(self, units: list[FlatUnit]) -> None:
        """Every gradient of ``units`` is in (or will not come this backward)."""
        self._done.update(unit.index for unit in units)
        if self.sync and self.early[units[0].index]:
            self.reduce(units, async_op=True)
            self.reductions.append(([unit.index for unit in units], self._in_flight[-1][3]))
        elif self.sync and self.speculative is not None:
            self.speculative.issue(units)
        if self.stage == 3:
            for unit in units:
                if not self.kept[unit.index]:
                    unit.free(self.keep_views)  # the module's backward is done: its parameters go until its next use

    def _end_backward(self) -> None:
        """Units this backward left incomplete: handled now, in unit order (the same on
        every rank); stage 3: every unit not kept is freed."""
        for unit in self.units:
            if unit.index not in self._done and (self.reduce_every_unit or any(unit.ready)):
                self._complete([unit])
        if self.stage == 3:
            for unit, keep in zip(self.units, self.kept):
                if not keep:
                    unit.free(self.keep_views)
        self.in_backward = False
        if self.collect_at_backward_end and self.sync and self.stage >= 2:
            self.wait_in_flight()
        if self.on_backward_end is not None:
            self.on_backward_end()

    # ----- reduce ----------------------------------------------------------------------
    def reduce(self, units: list[FlatUnit], async_op: bool) -> None:
        """The units' gradients reduce-scattered in one call; the full ones dropped."""
        self._in_flight += reduce_units(units, self.group, self.algorithm, async_op)

    def wait_in_flight(self) -> None:
        """The average of every reduce-scatter issued, added into its shard's gradient."""
        in_flight, self._in_flight = self._in_flight, []
        start_s = time.perf_counter()
        try:
            add_reduced(in_flight, self.world_size)
        finally:
            self._reduce_waited_s += time.perf_counter() - start_s
        if in_flight:
            self.reduced = True

    @property
    def waited_s(self) -> float:
        """Seconds (perf_counter, cumulative since construction) this rank has waited for
        communication inside the engine's own calls: reduce-scatters waited for and added in
        (``wait_in_flight``: stage 2/3's at each backward's start, and at ``reduce_gradients``)
        and stage 3's gathers made ready before a module's forward or backward. A caller
        timing a span (plait train's forward/backward intervals) takes the difference over
        it: that much of the span was data-parallel communication, not compute."""
        gathered_s = self.gatherer.waited_s if self.gatherer is not None else 0.0
        return self._reduce_waited_s + gathered_s

    def reduce_gradients(self) -> None:
        """This rank's shard of the average gradient in each unit's ``shard.grad``: the
        units that are not early reduce-scattered now (one call each), every reduction
        in flight waited for."""
        late = [unit for unit, early in zip(self.units, self.early) if not early]
        taken = self.speculative.take(late) if self.speculative is not None and late else {}
        for unit in late:
            if unit.index in taken:
                self._in_flight.append(taken[unit.index])
            else:
                self.reduce([unit], async_op=False)
        self.wait_in_flight()

    def grad_square_sum(self, units=None) -> torch.Tensor:
        """Σ g² over this rank's shards of ``units`` (default: all), float64 on the CPU."""
        total = torch.zeros((), dtype=torch.float64)
        for unit in self.units if units is None else units:
            if unit.shard.grad is not None:
                total += unit.shard.grad.double().pow(2).sum().cpu()
        return total

    def scale_gradients(self, factor: float) -> None:
        for unit in self.units:
            if unit.shard.grad is not None:
                unit.shard.grad.mul_(factor)

    # ----- step ------------------------------------------------------------------------
    def step(self) -> None:
        """Step the shards (a parameter no rank gave a gradient is left as it was, its
        optimizer state too), then all-gather every unit whose buffer is allocated."""
        step_and_gather(self.units, self.optimizer, self.group, self.world_size, self.rank, self.algorithm,
                        self.offload)

    def zero_grad(self) -> None:
        """Drop the shards' and the parameters' gradients; no parameter used yet."""
        if self.speculative is not None:
            self.speculative.discard()
        for unit in self.units:
            unit.shard.grad = None
            for param in unit.params:
                param.grad = None
            unit.used = [False] * len(unit.params)
        self.reduced = False

    # ----- whole parameters ------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, write: bool = False):
        """Every unit's buffer gathered inside (every rank of the group enters);
        ``write``: what was written into the parameters is copied into the shards on
        exit where they are copies (stage 3, or a master under a mixed-precision
        policy). Units that were freed are freed again."""
        freed = [unit for unit in self.units if not unit.gathered]
        for unit in freed:
            unit.gather(self.group, self.algorithm)
        try:
            yield
        finally:
            if write:
                with torch.no_grad():
                    for unit in self.units:
                        if unit.shard.untyped_storage().data_ptr() == unit.full.untyped_storage().data_ptr():
                            continue  # the shard is a slice of the parameters: written already
                        start = self.rank * unit.shard_numel
                        unit.shard.copy_(unit.full[start:start + unit.shard_numel])
            for unit in freed:
                unit.free(self.keep_views)

    def state_tensors(self, offloaded: bool) -> list[torch.Tensor]:
        """The optimizer's state tensors in offload files (``offloaded``) or in memory."""
        return [value for entry in self.optimizer.state.values() for value in entry.values()
                if torch.is_tensor(value) and (self.offload is not None and self.offload.owns(value)) == offloaded]


def owners_of(modules: list[nn.Module]) -> dict[int, list[int]]:
    """id(parameter) -> indices of the ``modules`` holding it (stage 3's units)."""
    owners: dict[int, list[int]] = {}
    for index, module in enumerate(modules):
        for param in module.parameters():
            owners.setdefault(id(param), []).append(index)
    return owners


def buckets(named: list[tuple[str, nn.Parameter]], bucket_bytes: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Stages 1 and 2's units: consecutive parameters of one dtype, at most
    ``bucket_bytes`` a bucket (a larger parameter alone)."""
    groups, current, size = [], [], 0
    for name, param in named:
        nbytes = param.numel() * param.element_size()
        if current and (size + nbytes > bucket_bytes or param.dtype != current[0][1].dtype):
            groups.append(current)
            current, size = [], 0
        current.append((name, param))
        size += nbytes
    if current:
        groups.append(current)
    return groups


def storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the live storages of ``tensors`` not in ``seen`` (data pointers, updated):
    each storage once."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def snapshot_unused(units: list[FlatUnit], optimizer, group, world_size: int, rank: int) -> list:
    """The shard elements (and their optimizer state) of parameters that no rank gave
    a gradient this step: one all-reduce of a flag per parameter."""
    flags = torch.tensor([int(used) for unit in units for used in unit.used], dtype=torch.int32)
    if world_size > 1:
        comm.all_reduce(flags, group=group)
    kept, index = [], 0
    for unit in units:
        start, end = rank * unit.shard_numel, (rank + 1) * unit.shard_numel
        positions = []
        for param, offset in zip(unit.params, unit.offsets):
            if int(flags[index]) == 0:
                low, high = max(offset, start), min(offset + param.numel(), end)
                if low < high:
                    positions.append(torch.arange(low - start, high - start))
            index += 1
        if positions:
            where = torch.cat(positions)
            state = optimizer.state.get(unit.shard, {})
            state_values = {key: value[where].clone() for key, value in state.items()
                            if torch.is_tensor(value) and value.shape == unit.shard.shape}
            kept.append((unit.shard, optimizer, where, unit.shard.detach()[where].clone(), state_values))
    return kept


def step_and_gather(units: list[FlatUnit], optimizer, group, world_size: int, rank: int, algorithm,
                    offload=None) -> None:
    """Step the shards (a parameter no rank gave a gradient keeps its value and its
    state), then all-gather every unit whose buffer is allocated (stage 3's freed ones
    gather at their next use). With ``offload`` (a ``StateFiles``) the units step one
    at a time, each unit's state back in its files before the next one's step."""
    kept = snapshot_unused(units, optimizer, group, world_size, rank)
    if offload is None:
        optimizer.step()
        restore_unused(kept)
    else:
        _step_unit_by_unit(units, optimizer, offload, kept)
    for unit in units:
        if unit.gathered:
            unit.gather(group, algorithm)


def _step_unit_by_unit(units: list[FlatUnit], optimizer, offload, kept: list) -> None:
    """One ``optimizer.step()`` per unit with only that unit's gradient set: torch's
    optimizers skip a parameter whose .grad is None and keep per-parameter state (and
    step counts), so this equals one step over all of them, with one unit's state
    resident at a time."""
    grads = [unit.shard.grad for unit in units]
    for unit in units:
        unit.shard.grad = None
    try:
        for unit, grad in zip(units, grads):
            if grad is None:
                continue
            unit.shard.grad = grad
            optimizer.step()
            unit.shard.grad = None
            restore_unused([entry for entry in kept if entry[0] is unit.shard])
            offload.adopt(optimizer.state.get(unit.shard, {}), unit.shard)
    finally:
        for unit, grad in zip(units, grads):
            unit.shard.grad = grad


def restore_unused(kept: list) -> None:
    with torch.no_grad():
        for shard, optimizer, positions, values, state_values in kept:
            shard[positions] = values
            state = optimizer.state[shard]
            for key, value in state_values.items():
                state[key][positions] = value
