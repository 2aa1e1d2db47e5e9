"""ZeRO's state dicts, in the model's own names (a mixin of
``plait.parallel.zero.module.ZeRO``; it reads the wrapper's ``module``, ``units``,
``optimizer``, ``engine``, ``communicator`` and rank).

- ``state_dict()`` is *sharded* as FSDP2's: keyed by the model's names
  (``transformer.h.0.attn.c_attn.weight``, no ``module.``), each trainable parameter a
  ``DTensor`` sharded along dim 0 (``Shard(0)``, torch's chunking: rank r holds rows
  [r·c, (r+1)·c), c = ceil(rows / N)) over a ``DeviceMesh`` of the ZeRO group, buffers
  as plain tensors. So ``torch.distributed.checkpoint.save`` writes each rank's own
  rows once, and ``load`` reshards onto any other number of ranks. A unit's flat
  shards are arbitrary ranges of its flat buffer, so each unit is all-gathered (one
  unit's bytes at a time) and cut by rows; the values are the master shards' (float32
  under a mixed-precision policy, as FSDP2's sharded parameters).
- ``load_state_dict(state, strict=True)`` takes the same keys with DTensor values (any
  placement: ``full_tensor()``) or whole tensors, and returns torch's
  ``(missing_keys, unexpected_keys)``; a tied parameter loads through any of its names.
- ``full_state_dict()`` / ``load_full_state_dict()``: whole tensors (optionally rank 0's).
- ``local_state_dict()`` / ``load_local_state_dict()``: this rank's flat shards and its
  optimizer's own state dict, valid only for the same stage and ranks (FSDP1's
  ``LOCAL_STATE_DICT``).
- ``full_parameters()`` (alias ``summon_full_params``): every unit gathered for the
  duration, so ``zero.module`` is a plain model (``generate``, ``save_pretrained``).

The optimizer's state by parameter name is ``plait.parallel.zero.param_optimizer``'s.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait import comm
from plait.parallel.data.weak_hooks import weak_method
from plait.parallel.data.model_keys import (ModelKeys, consume_ddp_prefix, incompatible_keys, key_report,
                                            raise_key_errors, refuse_assign)
from plait.parallel.zero.param_optimizer import ParamOptimizer
from plait.parallel.zero.row_shards import dim0_piece, gather_flat, own_range, param_views, whole


class ZeroStateDicts(ModelKeys):
    """The state-dict methods of ZeRO (see the module docstring)."""

    @property
    def param_optimizer(self) -> ParamOptimizer:
        """The optimizer over the model's parameters, state per parameter, as torch's
        ``get_optimizer_state_dict(zero, zero.param_optimizer)`` and DCP need it."""
        view = self.__dict__.get("_param_optimizer")
        if view is None:
            view = self.__dict__["_param_optimizer"] = ParamOptimizer(self)
        return view

    def _dp_mesh(self) -> DeviceMesh:
        """A 1-D DeviceMesh of the ZeRO group (made once, without a collective)."""
        mesh = self.__dict__.get("_mesh")
        if mesh is None:
            mesh = DeviceMesh.from_group(self.communicator.group, self.units[0].device.type)
            self.__dict__["_mesh"] = mesh
        return mesh

    # ----- sharded (DTensor) -----------------------------------------------------------
    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        """The model's state dict, its trainable parameters sharded by rows (DTensors
        over the ZeRO group); every rank of the group calls it (one all-gather a unit)."""
        mesh, pieces = self._dp_mesh(), {}
        for unit in self.units:
            shares = unit.gathered and unit.full.dtype == unit.shard.dtype
            flat = unit.full if shares else gather_flat(unit, unit.shard, self.communicator)
            for param, full in zip(unit.params, param_views(unit, flat)):
                pieces[id(param)] = dim0_piece(full, mesh, self.world_size, self.rank)
        out = OrderedDict() if destination is None else destination
        for name, value in self.module.state_dict(keep_vars=True).items():
            out[prefix + name] = pieces.get(id(value), value if keep_vars else value.detach())
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load the model's state dict (DTensors of any placement or whole tensors, keyed
        by the model's names; a DDP checkpoint's ``module.`` prefix is consumed). Returns
        torch's (missing_keys, unexpected_keys); every rank of the group calls it."""
        if isinstance(state_dict, dict) and {"stage", "shards"} <= set(state_dict):
            raise ValueError("ZeRO: this is ZeRO's local (flat-shard) state; load it with "
                             "zero.load_local_state_dict(state), or save model keys with zero.state_dict()")
        refuse_assign(assign, "ZeRO")
        template = self.module.state_dict(keep_vars=True)
        state_dict = consume_ddp_prefix(state_dict, template)
        missing, unexpected, sizes = key_report(state_dict, template)
        raise_key_errors(missing, unexpected, sizes, strict, type(self.module).__name__)
        self._load_present(state_dict, template)
        return incompatible_keys(missing, unexpected)

    def _load_present(self, state: dict, template: dict) -> None:
        """Every parameter one of whose names ``state`` has, unit by unit (a unit with a
        parameter left out starts from its current values); then the buffers."""
        names: dict[int, list[str]] = {}
        for name, value in template.items():
            names.setdefault(id(value), []).append(name)
        for unit in self.units:
            given = [next((state[name] for name in names.get(id(param), []) if name in state), None)
                     for param in unit.params]
            if all(value is None for value in given):
                continue
            flat = gather_flat(unit, unit.shard, self.communicator) if any(value is None for value in given) \
                else torch.zeros(unit.padded, dtype=unit.shard.dtype, device=unit.device)
            for view, value in zip(param_views(unit, flat), given):
                if value is not None:
                    view.copy_(whole(value).detach().reshape(view.shape))
            with torch.no_grad():
                unit.shard.copy_(own_range(unit, flat))
            if unit.gathered:
                unit.gather(self.communicator, self.algorithm)
        sharded = {id(param) for unit in self.units for param in unit.params}
        rest = {name: whole(value) for name, value in state.items()
                if name in template and id(template[name]) not in sharded}
        self.module.load_state_dict(rest, strict=False)

    # ----- whole tensors ---------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The unsharded parameters and buffers, as ``module.state_dict()`` would give
        without ZeRO: on every rank, or (``rank0_only``) on rank 0 of the group only, the
        others getting ``{}``. The values are the master weights' (float32 under a
        mixed-precision policy, as FSDP2's full state dict; not the rounded parameters the
        forward computes with). Every rank of the group must call it (one all-gather a unit)."""
        whole = {}
        for unit in self.units:
            shares = unit.gathered and unit.full.dtype == unit.shard.dtype
            flat = unit.full if shares else gather_flat(unit, unit.shard, self.communicator)
            for param, full in zip(unit.params, param_views(unit, flat)):
                whole[id(param)] = full
        if rank0_only and self.rank != 0:
            return {}
        return {name: whole.get(id(value), value).detach().clone()
                for name, value in self.module.state_dict(keep_vars=True).items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor] | None, from_rank0: bool = False,
                             strict: bool = True):
        """Load unsharded parameters and buffers (names and shapes must match the
        module's; ``strict=False``: missing and unexpected keys are returned, as torch's
        ``(missing_keys, unexpected_keys)``, and a tied parameter loads through any of its
        names). ``from_rank0``: only rank 0's ``state`` is read and broadcast (the other
        ranks may pass None); every rank of the group must call it."""
        template = self.module.state_dict(keep_vars=True)
        if from_rank0 and self.world_size > 1:
            verdict = [self._state_problem(state, template, strict) if self.rank == 0 else None]
            dist.broadcast_object_list(verdict, src=self._src, group=self.communicator.group)
            problem, present = verdict[0]
            if problem:
                raise ValueError(problem)
            received = {}
            for name in present:
                value = state[name].detach().to(template[name].dtype).contiguous().clone() if self.rank == 0 \
                    else torch.empty(template[name].shape, dtype=template[name].dtype)
                comm.broadcast(value, src=self._src, group=self.communicator)
                received[name] = value
            state = received
        else:
            problem, present = self._state_problem(state, template, strict)
            if problem:
                raise ValueError(problem)
        missing, unexpected, _ = key_report(state, template)
        self._load_present({name: state[name] for name in present}, template)
        return incompatible_keys(missing, unexpected)

    @staticmethod
    def _state_problem(state, template: dict, strict: bool) -> tuple[str | None, list[str]]:
        """What keeps ``state`` from loading into a module whose state dict is
        ``template``, and the keys it would load."""
        if not isinstance(state, dict):
            return f"ZeRO: load_full_state_dict needs a dict of tensors, got {type(state).__name__}", []
        missing, unexpected, _ = key_report(state, template)
        missing, unexpected = sorted(missing), sorted(unexpected)
        if strict and (missing or unexpected):
            return (f"ZeRO: the state dict does not fit this model: missing {missing[:8]}"
                    f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                    f"{' ...' if len(unexpected) > 8 else ''} (strict=False loads the keys present and returns "
                    "the others)"), []
        shapes = [f"{name} {tuple(state[name].shape)} (the model's: {tuple(value.shape)})"
                  for name, value in template.items() if name in state and tuple(state[name].shape) != tuple(value.shape)]
        if shapes:
            return f"ZeRO: the state dict's shapes do not fit this model: {', '.join(shapes[:8])}", []
        return None, [name for name in template if name in state]

    # ----- this rank's flat shards -----------------------------------------------------
    def local_state_dict(self) -> dict:
        """This rank's flat shards, its optimizer's own state dict and the buffers:
        reloads only into the same stage, ranks and model (``load_local_state_dict``)."""
        return {"stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "shards": [unit.shard.detach().clone() for unit in self.units],
                "optimizer": self.optimizer.state_dict(),
                "buffers": {name: buffer.detach().clone() for name, buffer in self.module.named_buffers()}}

    def load_local_state_dict(self, state: dict) -> None:
        """Load what ``local_state_dict`` wrote on this rank."""
        if (state.get("stage"), state.get("world_size"), state.get("rank")) != (self.stage, self.world_size,
                                                                                 self.rank):
            raise ValueError(f"ZeRO: this sharded state is stage {state.get('stage')} rank {state.get('rank')} of "
                             f"{state.get('world_size')}; this wrapper is stage {self.stage} rank {self.rank} of "
                             f"{self.world_size}: load a full state dict to change the layout")
        with torch.no_grad():
            for unit, shard in zip(self.units, state["shards"]):
                unit.shard.copy_(shard)
                if unit.gathered:
                    unit.gather(self.communicator, self.algorithm)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.offload is not None:  # the loaded state into files, the replaced files let go
            for unit in self.units:
                self.offload.adopt(self.optimizer.state.get(unit.shard, {}), unit.shard)
            self.offload.forget([value for entry in self.optimizer.state.values() for value in entry.values()])
        for name, buffer in self.module.named_buffers():
            buffer.copy_(state["buffers"][name])

    # ----- whole parameters for a while ------------------------------------------------
    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = True):
        """Inside, every parameter of ``zero.module`` is whole (stage 3's units gathered,
        freed again on exit), so the module is a plain model: ``generate``,
        ``save_pretrained``, reading or editing weights. ``writeback``: edits are kept
        (copied into the shards on exit), else dropped. Every rank of the group enters;
        inside, calls on ``zero.module`` are local (no collective); ``zero(...)`` is refused
        there, and a backward is not supported."""
        if self.__dict__.get("_full_parameters"):
            raise RuntimeError("ZeRO: full_parameters() is already entered; do not nest it")
        gatherer = self.engine.gatherer
        freed = [unit for unit in self.units if not unit.gathered]
        for unit in freed:
            unit.gather(self.communicator, self.algorithm)
        saved = None if writeback else [unit.shard.detach().clone() for unit in self.units]
        self.__dict__["_full_parameters"] = True
        if gatherer is not None:
            gatherer.paused = True
        try:
            yield self.module
        finally:
            self.__dict__["_full_parameters"] = False
            if gatherer is not None:
                gatherer.paused = False
            with torch.no_grad():
                for unit, kept in zip(self.units, saved or [None] * len(self.units)):
                    if kept is not None:
                        unit.shard.copy_(kept)
                        if unit.gathered and unit not in freed:
                            unit.gather(self.communicator, self.algorithm)
                    elif unit.shard.untyped_storage().data_ptr() != unit.full.untyped_storage().data_ptr():
                        _write_back(unit)
            for unit in freed:
                unit.free()

    summon_full_params = full_parameters  # FSDP's name

    def _guard_sharded_module(self) -> None:
        """Stage 3: the wrapped model's own ``state_dict()`` is refused by name while its
        parameters are freed (reading them would read storage that is not there)."""
        if self.stage == 3:
            self.module.register_state_dict_pre_hook(weak_method(self._check_module_readable))

    def _check_module_readable(self, _module, _prefix, keep_vars) -> None:
        if not keep_vars and not all(unit.gathered for unit in self.units):
            raise RuntimeError("ZeRO stage 3: zero.module.state_dict() between steps reads parameters that are "
                               "sharded and freed; use zero.state_dict() (sharded, the model's keys), "
                               "zero.full_state_dict(), or read them inside `with zero.full_parameters():`")

    def _refuse_inside_full_parameters(self) -> None:
        if self.__dict__.get("_full_parameters"):
            raise RuntimeError("ZeRO: zero(...) inside full_parameters(); call zero.module(...) there (its "
                               "parameters are whole), or leave the context to train")


def _write_back(unit) -> None:
    """The gathered buffer's edits into this rank's master shard. A buffer in another
    dtype (a mixed-precision policy's) writes only the elements that changed, so an
    unedited master is never rounded."""
    current = own_range(unit, unit.full)
    if current.dtype == unit.shard.dtype:
        unit.shard.copy_(current)
        return
    changed = current != unit.shard.detach().to(current.dtype)
    unit.shard.detach()[changed] = current[changed].to(unit.shard.dtype)
