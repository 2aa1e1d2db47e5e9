"""ZeRO stages 1-3 as an optimizer (what plait train --zero-stage 1|2|3 runs): see
``ShardedOptimizer``."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from plait import comm
from plait.comm.communicator import check_group
from plait.parallel.arguments import wrapper_communicator
from plait.parallel.zero.flat_units import (FlatUnit, add_reduced, check_elementwise, clear_grads, reduce_units,
                                       step_and_gather)
from plait.parallel.zero.state_offload import StateFiles
from plait.parallel.zero.unit_gathering import UnitGatherer, default_wrap
from plait.parallel.data.weak_hooks import weak_method


class ShardedOptimizer:
    """ZeRO stages 1-3 for a model whose gradients something else computes (plait
    train's pipeline): ``optimizer``, built over the full parameters as usual (its
    param groups and options are kept), is rebuilt over this rank's shards of flat
    buckets of them, each bucket within one param group and one tensor-parallel kind
    (``tp_shard`` set or not). Per step: ``reduce_gradients()`` (the average over
    ``group``, reduce-scattered; the full gradients are dropped), ``clip_grad_norm_``,
    ``step()`` (the shards, then an all-gather of each bucket). ``param_groups`` are
    the rebuilt optimizer's (set ``lr`` there); ``full_state(names)`` and
    ``load_full_state`` give and take torch's per-parameter optimizer state, so a
    checkpoint does not depend on the dp degree.

    Stage 1 reduce-scatters the accumulated gradients in ``reduce_gradients()``.
    Stage 2 reduce-scatters inside every backward (each micro-batch's, as DeepSpeed's
    stage 2 does): a bucket goes to plait's comm thread as soon as all its gradients
    of that backward are in (the rest at the backward's end), its full gradients are
    dropped and the average is added into the shard's gradient, so no full gradient
    outlives its backward; ``late`` parameters (ones another group still sums after
    the backward, e.g. a pipeline's shared embedding) are bucketed apart and reduced in
    ``reduce_gradients()`` as in stage 1. Each dp rank must run the same backwards
    over the same parameters (no data-dependent unused parameters), as for DDP.

    Stage 3 shards the parameters too: ``modules`` (the modules the forward runs) are
    cut into units as ``plait.parallel.ZeRO`` does (every child holding parameters,
    containers looked inside), each unit's parameters gathered around its forward
    and its backward and freed after (``plait.parallel.zero.unit_gathering``), its
    gradients reduce-scattered inside each backward as in stage 2; parameters of no
    single unit stay gathered. ``whole_parameters()`` gathers everything for reading
    or loading them (checkpoints).

    ``offload_dir``: the optimizer state in memory-mapped files there between steps
    (``plait.parallel.zero.state_offload``; parameters on the CPU only).

    Call ``begin_step()`` before each step's first forward."""

    def __init__(self, optimizer: torch.optim.Optimizer, group, *, bucket_mb: float = 25,
                 algorithm: str = "auto", stage: int = 1, late=(), offload_dir=None, modules=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ShardedOptimizer: optimizer must be a torch.optim.Optimizer over the parameters, "
                            f"got {type(optimizer).__name__}, e.g. torch.optim.AdamW(model.parameters(), lr=3e-4)")
        check_group(group)
        check_elementwise(optimizer)
        if optimizer.state:
            raise ValueError("ZeRO: give the optimizer before its first step (its state is rebuilt on shards)")
        if stage not in (1, 2, 3):
            raise ValueError(f"ShardedOptimizer: stage={stage!r} must be 1, 2 or 3")
        if (stage == 3) != (modules is not None):
            raise ValueError("ShardedOptimizer: stage 3 needs modules= (the modules the forward runs, whose "
                             "children become the gathered units), and only stage 3 takes them")
        devices = {param.device.type for group in optimizer.param_groups for param in group["params"]}
        if offload_dir is not None and devices != {"cpu"}:
            raise ValueError(f"ZeRO: optimizer offload with parameters on {sorted(devices)} is not built yet (only "
                             "the state of a model on the CPU can be offloaded, to disk): turn offload off")
        self.stage = stage
        self.offload = StateFiles(offload_dir) if offload_dir is not None else None
        self.group = group = wrapper_communicator(group, "ShardedOptimizer")  # every call goes through it
        self.algorithm = algorithm
        self.world_size, self.rank = group.size, group.rank
        self.units: list[FlatUnit] = []
        self.unit_replicated: list[bool] = []
        self.unit_early: list[bool] = []  # stages 2 and 3: reduced inside each backward
        self.unit_root: list[bool] = []  # stage 3: parameters of no single unit module, kept gathered
        unit_modules = [unit for module in modules or () for unit in default_wrap(module)]
        owners: dict[int, list[int]] = {}
        for index, unit_module in enumerate(unit_modules):
            for param in unit_module.parameters():
                owners.setdefault(id(param), []).append(index)
        late_ids = {id(param) for param in late}
        by_module: list[list[FlatUnit]] = [[] for _ in unit_modules]
        groups = []
        for options in optimizer.param_groups:
            shards = []
            for key, named in _buckets(options["params"], stage, late_ids, owners, int(bucket_mb * (1 << 20))):
                replicated, is_late, owner = key
                unit = FlatUnit(len(self.units), named, self.world_size, self.rank, stage == 3)
                self.units.append(unit)
                self.unit_replicated.append(replicated)
                self.unit_early.append(stage >= 2 and not is_late)
                self.unit_root.append(stage == 3 and owner is None)
                if owner is not None:
                    by_module[owner].append(unit)
                shards.append(unit.shard)
            groups.append({**{k: v for k, v in options.items() if k != "params"}, "params": shards})
        # each group carries every option (torch fills them in), so the class defaults do not matter
        self.optimizer = type(optimizer)([group for group in groups if group["params"]])
        self.param_groups = self.optimizer.param_groups
        self._where = {id(param): (unit, slot) for unit in self.units for slot, param in enumerate(unit.params)}
        self._in_backward = False
        self._in_flight: list = []  # (unit, out, flat, handle) of reduce-scatters not yet waited for
        self._hooks = [param.register_post_accumulate_grad_hook(weak_method(self._on_grad_ready))
                       for unit, early in zip(self.units, self.unit_early) if early for param in unit.params]
        for unit in self.units:
            unit.used = [False] * len(unit.params)
        self._gatherer = None
        self._siblings = {unit.index: units for units in by_module for unit in units}  # stage 3: a module's units
        self._reduced_now = set()
        if stage == 3:
            kept = [index for index, units in enumerate(by_module) if units]
            self._gatherer = UnitGatherer([unit_modules[index] for index in kept], [by_module[i] for i in kept],
                                          group, algorithm, self._begin_backward)
            for unit, root in zip(self.units, self.unit_root):
                if not root:
                    unit.free()

    @property
    def shards(self) -> list[nn.Parameter]:
        return [unit.shard for unit in self.units]

    @property
    def state(self) -> dict:
        """The rebuilt optimizer's state: keyed by shard, this rank's part only."""
        return self.optimizer.state

    def begin_step(self) -> None:
        """Before a step's first forward: the last step's shard gradients dropped (as the
        pipeline engine drops the parameters'), offloaded state asked for (its reads
        overlap the compute), and stage 3's prefetch order taken from the last step."""
        self.zero_grad()
        if self.offload is not None:
            self.offload.prefetch()
        if self._gatherer is not None:
            self._gatherer.new_step()

    @contextlib.contextmanager
    def whole_parameters(self, write: bool = False):
        """Stage 3: every parameter gathered inside (every rank of the group enters);
        ``write``: what was written into them is kept (copied into the shards) on exit.
        Stages 1 and 2 keep the parameters whole anyway."""
        freed = [unit for unit in self.units if not unit.gathered]
        for unit in freed:
            unit.gather(self.group, self.algorithm)
        try:
            yield
        finally:
            if write and self.stage == 3:
                with torch.no_grad():
                    for unit in self.units:
                        start = self.rank * unit.shard_numel
                        unit.shard.copy_(unit.full[start:start + unit.shard_numel])
            for unit in freed:
                unit.free()

    # ----- stage 2: inside each backward ---------------------------------------------------
    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self._wait_in_flight()  # the previous backward's, long done by now
        self._reduced_now: set[int] = set()
        for unit in self.units:
            unit.ready = [False] * len(unit.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._begin_backward()
        unit, slot = self._where[id(param)]
        unit.ready[slot] = True
        if not all(unit.ready) or unit.index in self._reduced_now:
            return
        # stage 3: a module's units together (one call), once each has all its gradients
        together = self._siblings.get(unit.index, [unit])
        if all(all(other.ready) for other in together):
            self._reduce(together, async_op=True)
            if self.stage == 3 and not self.unit_root[unit.index]:
                for other in together:
                    other.free()  # the module's backward is done: its parameters go until the next forward

    def _end_backward(self) -> None:
        """Buckets this backward gave only some of their gradients: reduced now, in
        bucket order (the same on every rank); stage 3: every unit gathered for this
        backward is freed."""
        self._in_backward = False
        for unit, early in zip(self.units, self.unit_early):
            if early and any(unit.ready) and unit.index not in self._reduced_now:
                self._reduce([unit], async_op=True)
        if self.stage == 3:
            for unit, root in zip(self.units, self.unit_root):
                if not root:
                    unit.free()

    def _reduce(self, units: list[FlatUnit], async_op: bool) -> None:
        """The units' gradients reduce-scattered in one call; the full ones dropped."""
        self._in_flight += reduce_units(units, self.group, self.algorithm, async_op)
        self._reduced_now.update(unit.index for unit in units)

    def _wait_in_flight(self) -> None:
        """The average of every reduce-scatter issued, added into its shard's gradient."""
        in_flight, self._in_flight = self._in_flight, []
        add_reduced(in_flight, self.world_size)

    # ----- the step ------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """This rank's shard of the average gradient in each bucket's ``shard.grad``:
        stage 1 reduce-scatters every bucket now; stage 2 waits for the reductions the
        backwards started and reduces the late buckets."""
        for unit, early in zip(self.units, self.unit_early):
            if not early:
                self._reduce([unit], async_op=False)
        self._wait_in_flight()

    def grad_square_sum(self, tp_rank: int) -> torch.Tensor:
        """Σ g² over this rank's shards (tp-replicated buckets only on tp rank 0), float64."""
        total = torch.zeros((), dtype=torch.float64)
        for unit, replicated in zip(self.units, self.unit_replicated):
            if unit.shard.grad is not None and (not replicated or tp_rank == 0):
                total += unit.shard.grad.double().pow(2).sum().cpu()
        return total

    def scale_gradients(self, factor: float) -> None:
        for unit in self.units:
            if unit.shard.grad is not None:
                unit.shard.grad.mul_(factor)

    def step(self) -> None:
        """Step the shards (a parameter no rank gave a gradient is left as it was), then
        all-gather every bucket."""
        step_and_gather(self.units, self.optimizer, self.group, self.world_size, self.rank, self.algorithm,
                        self.offload)

    def zero_grad(self, set_to_none: bool = True) -> None:
        clear_grads(self.units)
        for unit in self.units:
            unit.used = [False] * len(unit.params)

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state in memory (each storage once; not what
        is offloaded to files)."""
        seen, total = set(), 0
        for entry in self.optimizer.state.values():
            for value in entry.values():
                if self.offload is not None and torch.is_tensor(value) and self.offload.owns(value):
                    continue
                if torch.is_tensor(value) and value.untyped_storage().data_ptr() not in seen:
                    seen.add(value.untyped_storage().data_ptr())
                    total += value.untyped_storage().nbytes()
        return total

    def full_state(self, names: dict[int, str]) -> dict[str, dict]:
        """torch's per-parameter state ({name: {key: tensor}}) of every parameter, each
        tensor all-gathered from the shards (every rank of the group calls it)."""
        out: dict[str, dict] = {}
        for unit in self.units:
            state = self.optimizer.state.get(unit.shard, {})
            for key in sorted(state):
                value = state[key]
                if torch.is_tensor(value) and value.shape == unit.shard.shape:
                    full = torch.empty(unit.padded, dtype=value.dtype, device=value.device)
                    if self.world_size == 1:
                        full.copy_(value)
                    else:
                        comm.all_gather_into_tensor(full, value.contiguous(), group=self.group,
                                                    algorithm=self.algorithm)
                    for param, offset in zip(unit.params, unit.offsets):
                        out.setdefault(names[id(param)], {})[key] = \
                            full[offset:offset + param.numel()].view(param.shape).clone()
                else:
                    for param in unit.params:
                        out.setdefault(names[id(param)], {})[key] = value.clone() if torch.is_tensor(value) \
                            else torch.tensor(value)
        return out

    def load_full_state(self, state: dict[str, dict], names: dict[int, str]) -> None:
        """The inverse of ``full_state``: this rank's slice of every parameter's state."""
        for unit in self.units:
            entries = [state.get(names[id(param)]) for param in unit.params]
            if not any(entries):
                continue
            keys = next(entry for entry in entries if entry).keys()
            start = self.rank * unit.shard_numel
            shard_state = {}
            for key in keys:
                sample = next(entry[key] for entry in entries if entry)
                if sample.dim() == 0:
                    shard_state[key] = sample.clone()
                    continue
                flat = torch.zeros(unit.padded, dtype=sample.dtype, device=unit.device)
                for param, offset, entry in zip(unit.params, unit.offsets, entries):
                    if entry:
                        flat[offset:offset + param.numel()].copy_(entry[key].reshape(-1))
                shard_state[key] = flat[start:start + unit.shard_numel].clone()
            self.optimizer.state[unit.shard] = shard_state
            if self.offload is not None:
                self.offload.adopt(shard_state, unit.shard)


def _buckets(params, stage: int, late_ids: set[int], owners: dict[int, list[int]], bucket_bytes: int):
    """(key, [(name, param)]) per flat unit of one param group: key = (tp-replicated,
    late, owner). Stages 1-2: buckets of at most ``bucket_bytes`` per (replicated,
    late); stage 3: one unit per (owner module, replicated), owner None for a
    parameter of no single unit module (the root's own, or one two modules share)."""
    params = [param for param in params if param.requires_grad]
    if stage == 3:
        keys: dict[tuple, list] = {}
        for param in params:
            where = owners.get(id(param), [])
            owner = where[0] if len(where) == 1 else None
            key = (getattr(param, "tp_shard", None) is None, False, owner)
            keys.setdefault((key, param.dtype), []).append(param)
        for (key, _dtype), chosen in keys.items():
            yield key, [(f"param.{slot}", param) for slot, param in enumerate(chosen)]
        return
    for replicated in (True, False):
        for is_late in (False, True):
            kind = [param for param in params if (getattr(param, "tp_shard", None) is None) == replicated
                    and (id(param) in late_ids) == is_late]
            current, size = [], 0
            for param in kind + [None]:
                if param is None or (current and (size + param.numel() * param.element_size() > bucket_bytes
                                                  or param.dtype != current[0][1].dtype)):
                    if current:
                        yield (replicated, is_late, None), current
                    current, size = [], 0
                if param is not None:
                    current.append((f"param.{len(current)}", param))
                    size += param.numel() * param.element_size()
