"""ZeRO stage 1 as an optimizer (what plait train --zero-stage 1 runs): see
``ShardedOptimizer``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.parallel.flat_units import FlatUnit, check_elementwise, clear_grads, step_and_gather


class ShardedOptimizer:
    """ZeRO stage 1 for a model whose gradients something else computes (plait
    train's pipeline): ``optimizer``, built over the full parameters as usual (its
    param groups and options are kept), is rebuilt over this rank's shards of flat
    buckets of them, each bucket within one param group and one tensor-parallel kind
    (``tp_shard`` set or not). Per step: ``reduce_gradients()`` (reduce-scatter, the
    average over ``group``; the full gradients are dropped), ``clip_grad_norm_``,
    ``step()`` (the shards, then an all-gather of each bucket). ``param_groups`` are
    the rebuilt optimizer's (set ``lr`` there); ``full_state(names)`` and
    ``load_full_state`` give and take torch's per-parameter optimizer state, so a
    checkpoint does not depend on the dp degree."""

    def __init__(self, optimizer: torch.optim.Optimizer, group, *, bucket_mb: float = 25,
                 algorithm: str = "auto"):
        check_elementwise(optimizer)
        if optimizer.state:
            raise ValueError("ZeRO: give the optimizer before its first step (its state is rebuilt on shards)")
        self.group, self.algorithm = group, algorithm
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        bucket_bytes = int(bucket_mb * (1 << 20))
        self.units: list[FlatUnit] = []
        self.unit_replicated: list[bool] = []
        groups = []
        for options in optimizer.param_groups:
            params = [param for param in options["params"] if param.requires_grad]
            shards = []
            for replicated in (True, False):
                kind = [param for param in params if (getattr(param, "tp_shard", None) is None) == replicated]
                current, size = [], 0
                for param in kind + [None]:
                    if param is None or (current and (size + param.numel() * param.element_size() > bucket_bytes
                                                      or param.dtype != current[0][1].dtype)):
                        if current:
                            unit = FlatUnit(len(self.units), current, self.world_size, self.rank, False)
                            self.units.append(unit)
                            self.unit_replicated.append(replicated)
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

    @property
    def shards(self) -> list[nn.Parameter]:
        return [unit.shard for unit in self.units]

    @property
    def state(self) -> dict:
        """The rebuilt optimizer's state: keyed by shard, this rank's part only."""
        return self.optimizer.state

    def reduce_gradients(self) -> None:
        """Each bucket's gradient reduce-scattered: this rank's shard of the average."""
        for unit in self.units:
            unit.used = [param.grad is not None for param in unit.params]
            flat = unit.flat_grad()
            for param in unit.params:
                param.grad = None
            out = torch.empty(unit.shard_numel, dtype=unit.dtype, device=unit.device)
            if self.world_size == 1:
                out.copy_(flat)
            else:
                comm.reduce_scatter_tensor(out, flat, group=self.group, algorithm=self.algorithm)
            unit.shard.grad = out.div_(self.world_size)

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
        step_and_gather(self.units, self.optimizer, self.group, self.world_size, self.rank, self.algorithm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        clear_grads(self.units)

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (each storage once)."""
        seen, total = set(), 0
        for entry in self.optimizer.state.values():
            for value in entry.values():
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
