"""ZeRO stages 1 and 2 as an optimizer (what plait train --zero-stage 1|2 runs): see
``ShardedOptimizer``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.parallel.flat_units import FlatUnit, check_elementwise, clear_grads, step_and_gather
from plait.parallel.state_offload import StateFiles
from plait.parallel.weak_hooks import weak_method


class ShardedOptimizer:
    """ZeRO stage 1 or 2 for a model whose gradients something else computes (plait
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

    ``offload_dir``: the optimizer state in memory-mapped files there between steps
    (``plait.parallel.state_offload``; parameters on the CPU only). Call
    ``prefetch_state()`` when the step's forward begins so the reads overlap it."""

    def __init__(self, optimizer: torch.optim.Optimizer, group, *, bucket_mb: float = 25,
                 algorithm: str = "auto", stage: int = 1, late=(), offload_dir=None):
        check_elementwise(optimizer)
        if optimizer.state:
            raise ValueError("ZeRO: give the optimizer before its first step (its state is rebuilt on shards)")
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer: stage={stage!r} must be 1 or 2 (stage 3 is plait.parallel.ZeRO)")
        devices = {param.device.type for group in optimizer.param_groups for param in group["params"]}
        if offload_dir is not None and devices != {"cpu"}:
            raise ValueError(f"ZeRO: optimizer offload with parameters on {sorted(devices)} is not built yet (only "
                             "the state of a model on the CPU can be offloaded, to disk): turn offload off")
        self.stage = stage
        self.offload = StateFiles(offload_dir) if offload_dir is not None else None
        late_ids = {id(param) for param in late}
        self.group, self.algorithm = group, algorithm
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        bucket_bytes = int(bucket_mb * (1 << 20))
        self.units: list[FlatUnit] = []
        self.unit_replicated: list[bool] = []
        self.unit_early: list[bool] = []  # stage 2: reduced inside each backward
        groups = []
        for options in optimizer.param_groups:
            params = [param for param in options["params"] if param.requires_grad]
            shards = []
            kinds = [(replicated, is_late) for replicated in (True, False) for is_late in (False, True)]
            for replicated, is_late in kinds:
                kind = [param for param in params if (getattr(param, "tp_shard", None) is None) == replicated
                        and (id(param) in late_ids) == is_late]
                current, size = [], 0
                for param in kind + [None]:
                    if param is None or (current and (size + param.numel() * param.element_size() > bucket_bytes
                                                      or param.dtype != current[0][1].dtype)):
                        if current:
                            unit = FlatUnit(len(self.units), current, self.world_size, self.rank, False)
                            self.units.append(unit)
                            self.unit_replicated.append(replicated)
                            self.unit_early.append(stage == 2 and not is_late)
                            shards.append(unit.shard)
                        current, size = [], 0
                    if param is not None:
                        current.append((f"param{len(self.units)}.{len(current)}", param))
                        size += param.numel() * param.element_size()
            groups.append({**{k: v for k, v in options.items() if k != "params"}, "params": shards})
        # each group carries every option (torch fills them in), so the class defaults do not matter
        self.optimizer = type(optimizer)([group for group in groups if group["params"]])
        self.param_groups = self.optimizer.param_groups
        self._where = {id(param): (unit, slot) for unit in self.units for slot, param in enumerate(unit.params)}
        self._in_backward = False
        self._in_flight: list = []  # stage 2: (unit, out, flat, handle) of reduce-scatters not yet waited for
        self._hooks = [param.register_post_accumulate_grad_hook(weak_method(self._on_grad_ready))
                       for unit, early in zip(self.units, self.unit_early) if early for param in unit.params]
        for unit in self.units:
            unit.used = [False] * len(unit.params)

    @property
    def shards(self) -> list[nn.Parameter]:
        return [unit.shard for unit in self.units]

    @property
    def state(self) -> dict:
        """The rebuilt optimizer's state: keyed by shard, this rank's part only."""
        return self.optimizer.state

    def prefetch_state(self) -> None:
        """Offload: ask for the state's pages now, so that reading them overlaps the compute."""
        if self.offload is not None:
            self.offload.prefetch()

    # ----- stage 2: inside each backward ---------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            self._wait_in_flight()  # the previous backward's, long done by now
            for unit in self.units:
                unit.ready = [False] * len(unit.params)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        unit, slot = self._where[id(param)]
        unit.ready[slot] = True
        if all(unit.ready):
            self._reduce(unit, async_op=True)

    def _end_backward(self) -> None:
        """Buckets this backward gave only some of their gradients: reduced now, in
        bucket order (the same on every rank)."""
        self._in_backward = False
        for unit, early in zip(self.units, self.unit_early):
            if early and any(unit.ready) and not all(unit.ready):
                self._reduce(unit, async_op=True)

    def _reduce(self, unit: FlatUnit, async_op: bool) -> None:
        """``unit``'s gradients, flat, reduce-scattered; the full ones dropped."""
        unit.used = [was or param.grad is not None for was, param in zip(unit.used, unit.params)]
        flat = unit.flat_grad()
        for param in unit.params:
            param.grad = None
        out = torch.empty(unit.shard_numel, dtype=unit.dtype, device=unit.device)
        handle = None
        if self.world_size == 1:
            out.copy_(flat)
        else:
            handle = comm.reduce_scatter_tensor(out, flat, group=self.group, algorithm=self.algorithm,
                                                async_op=async_op)
        self._in_flight.append((unit, out, flat, handle))

    def _wait_in_flight(self) -> None:
        """The average of every reduce-scatter issued, added into its shard's gradient."""
        in_flight, self._in_flight = self._in_flight, []
        errors = []
        for unit, out, _flat, handle in in_flight:
            try:
                if handle is not None:
                    handle.wait()
            except BaseException as error:  # noqa: BLE001 - every handle waited; the first raised
                errors.append(error)
                continue
            average = out.div_(self.world_size)
            unit.shard.grad = average if unit.shard.grad is None else unit.shard.grad.add_(average)
        if errors:
            raise errors[0]

    # ----- the step ------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """This rank's shard of the average gradient in each bucket's ``shard.grad``:
        stage 1 reduce-scatters every bucket now; stage 2 waits for the reductions the
        backwards started and reduces the late buckets."""
        for unit, early in zip(self.units, self.unit_early):
            if not early:
                self._reduce(unit, async_op=False)
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
