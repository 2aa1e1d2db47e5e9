"""ZeRO stages 1-3 as an optimizer (what plait train --zero-stage 1|2|3 runs): see
``ShardedOptimizer``. Its units follow the optimizer's param groups; what happens to them
from the backward to the next forward is ``plait.parallel.zero.engine``'s, the engine the
``ZeRO`` module runs too."""

from __future__ import annotations

import torch
from torch import nn

from plait import comm
from plait.comm.communicator import check_group
from plait.parallel.arguments import refuse_dtensor_parameters, wrapper_communicator
from plait.parallel.zero.engine import ShardEngine, check_elementwise, owners_of, storage_bytes
from plait.parallel.zero.flat_units import FlatUnit
from plait.parallel.zero.param_groups import build_over_shards, check_fresh, group_options, plan_units
from plait.parallel.zero.state_offload import StateFiles
from plait.parallel.zero.unit_gathering import default_wrap


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
        refuse_dtensor_parameters(((f"param_groups[{index}] parameter {slot}", param) for index, options in
                                   enumerate(optimizer.param_groups) for slot, param in enumerate(options["params"])),
                                  "ShardedOptimizer")
        check_elementwise(optimizer)
        check_fresh(optimizer, "ShardedOptimizer")
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
        self.group = group  # as given (None: the world), as before
        self.communicator = group = wrapper_communicator(group, "ShardedOptimizer")  # every call goes through it
        self.algorithm = algorithm
        self.world_size, self.rank = group.size, group.rank
        self.units: list[FlatUnit] = []
        self.unit_replicated: list[bool] = []
        self.unit_early: list[bool] = []  # stages 2 and 3: reduced inside each backward
        self.unit_root: list[bool] = []  # stage 3: parameters of no single unit module, kept gathered
        unit_modules = [unit for module in modules or () for unit in default_wrap(module)]
        owners = owners_of(unit_modules)
        late_ids = {id(param) for param in late}
        by_module: list[list[FlatUnit]] = [[] for _ in unit_modules]
        groups = [[(f"param.{slot}", param) for slot, param in enumerate(options["params"]) if param.requires_grad]
                  for options in optimizer.param_groups]
        # key: (tp-replicated, late); stage 3 keys by owner module too (None: kept gathered)
        kind = (lambda param: (getattr(param, "tp_shard", None) is None, id(param) in late_ids and stage < 3))
        shards: list[list[nn.Parameter]] = [[] for _ in groups]
        for plan in plan_units(groups, stage, int(bucket_mb * (1 << 20)), owners, kind):
            replicated, is_late = plan.kind
            unit = FlatUnit(len(self.units), plan.named, self.world_size, self.rank, stage == 3)
            self.units.append(unit)
            self.unit_replicated.append(replicated)
            self.unit_early.append(stage >= 2 and not is_late)
            self.unit_root.append(stage == 3 and plan.owner is None)
            if plan.owner is not None:
                by_module[plan.owner].append(unit)
            shards[plan.group].append(unit.shard)
        self.optimizer = build_over_shards(type(optimizer), group_options(optimizer), shards)
        self.param_groups = self.optimizer.param_groups
        # stage 2's buckets reduced inside each backward, waited for before the next one (the
        # comm thread overlaps the next micro-batch); stage 3's root buckets stay gathered
        kept = [index for index, units in enumerate(by_module) if units]
        self.engine = ShardEngine(self.units, self.optimizer, group, algorithm, stage, offload=self.offload,
                                  early=self.unit_early, kept=self.unit_root,
                                  gathered_modules=[(unit_modules[i], by_module[i]) for i in kept],
                                  reduce_every_unit=False, collect_at_backward_end=False)

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
        if self.engine.gatherer is not None:
            self.engine.gatherer.new_step()

    def whole_parameters(self, write: bool = False):
        """Stage 3: every parameter gathered inside (every rank of the group enters);
        ``write``: what was written into them is kept (copied into the shards) on exit.
        Stages 1 and 2 keep the parameters whole anyway."""
        return self.engine.gathered(write)

    # ----- the step ------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """This rank's shard of the average gradient in each bucket's ``shard.grad``:
        stage 1 reduce-scatters every bucket now; stage 2 waits for the reductions the
        backwards started and reduces the late buckets."""
        self.engine.reduce_gradients()

    def grad_square_sum(self, tp_rank: int) -> torch.Tensor:
        """Σ g² over this rank's shards (tp-replicated buckets only on tp rank 0), float64."""
        return self.engine.grad_square_sum([unit for unit, replicated in zip(self.units, self.unit_replicated)
                                            if not replicated or tp_rank == 0])

    def scale_gradients(self, factor: float) -> None:
        self.engine.scale_gradients(factor)

    def step(self) -> None:
        """Step the shards (a parameter no rank gave a gradient is left as it was), then
        all-gather every bucket."""
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state in memory (each storage once; not what
        is offloaded to files)."""
        return storage_bytes(self.engine.state_tensors(offloaded=False), set())

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
                        comm.all_gather_into_tensor(full, value.contiguous(), group=self.communicator,
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

