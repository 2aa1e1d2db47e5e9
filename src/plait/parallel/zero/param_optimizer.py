"""ZeRO's optimizer as torch's state-dict APIs see an optimizer: over the model's
parameters, its state per parameter (``zero.param_optimizer``).

ZeRO's own optimizer (``zero.optimizer``) steps this rank's flat shards, so its
``state_dict()`` is keyed by shard and torch's ``get_optimizer_state_dict`` cannot name
its entries. ``ParamOptimizer`` is the same optimizer seen per parameter, as FSDP2's
is: its ``param_groups`` are the inner groups (the same options, read and written
through) over the model's parameters, and

- ``state_dict()`` gives torch's format, ``{"state": {index: {"exp_avg": ..., "step": ...}},
  "param_groups": [{..., "params": [index, ...]}]}``, each element-wise state tensor a
  DTensor with the parameter's shape sharded by rows over the ZeRO group (each unit's
  state all-gathered and cut, one unit at a time) and each scalar (``step``) whole;
  ``get_optimizer_state_dict(zero, zero.param_optimizer)`` turns the indices into the
  model's names, ``torch.distributed.checkpoint`` saves and reshards it;
- ``load_state_dict()`` takes that format (DTensors of any placement or whole tensors,
  indices or names) and rebuilds each unit's flat state on this rank's shard;
- ``state`` is this rank's piece of each parameter's state (the 1-D part of its
  flattened elements inside this rank's shard, a view; FSDP1's ``use_orig_params``
  layout), and ``step()`` / ``zero_grad()`` are ZeRO's.

An optimizer with no state yet gets it as torch's state-dict APIs give it: one step of
zero gradients with lr 0 (the parameters unchanged), so that a checkpoint has tensors
to load into.

The optimizer the user built and gave to ZeRO (``zero.optimizer``, FSDP2's spelling
``get_optimizer_state_dict(zero, optimizer)``) is this view to torch's checkpoint code
and ZeRO's stepping optimizer to everything else (``present_per_parameter``): torch's
``torch.distributed.checkpoint.state_dict`` names an optimizer's state by iterating its
param groups' ``params`` itself and matching them to the model's parameters, so each
group's ``params`` is a ``ShardParams``, the shards, which iterated *by that module*
are the group's model parameters; its state is a ``ShardState``, which that module's
"has state?" test fills as ``ParamOptimizer`` does; and its ``state_dict()`` /
``load_state_dict()`` called by ``torch.distributed.checkpoint`` (the state-dict APIs,
or ``dcp.save``/``dcp.load`` of the optimizer as a Stateful) are this view's. Called by
anything else (``torch.save(optimizer.state_dict())``), they are the flat shards'
state: this rank's slices, as ``Shard(0)`` DTensors over the ZeRO group (so that
``dcp.save({"optim": optimizer.state_dict()})`` keeps every rank's), loadable only into
the same layout (ranks, stage, buckets; another is refused by name).
"""

from __future__ import annotations

import sys
import weakref
from collections import defaultdict
from collections.abc import MutableMapping

import torch
from torch.distributed.tensor import DTensor, Shard

from plait.parallel.zero.row_shards import dim0_piece, gather_flat, own_range, param_views, whole

PARAMS = "params"
CHECKPOINT_PACKAGE = "torch.distributed.checkpoint"  # torch's checkpoint code: sees the view
STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"  # iterates param groups itself
PASSED_THROUGH = ("torch.optim.", "torch._", __name__)  # frames between a caller and the hooks


class _GroupView(MutableMapping):
    """An inner param group with the model's parameters as its ``params``: every other
    key reads and writes the inner group (an lr scheduler's changes reach the shards)."""

    def __init__(self, inner: dict, params: list[torch.nn.Parameter]):
        self._inner, self._params = inner, params

    def __getitem__(self, key):
        return self._params if key == PARAMS else self._inner[key]

    def __setitem__(self, key, value) -> None:
        if key == PARAMS:
            raise ValueError("ZeRO: a param group's parameters are fixed when the wrapper is built")
        self._inner[key] = value

    def __delitem__(self, key) -> None:
        if key == PARAMS:
            raise ValueError("ZeRO: a param group's parameters are fixed when the wrapper is built")
        del self._inner[key]

    def __iter__(self):
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


class ParamOptimizer(torch.optim.Optimizer):
    """``zero``'s optimizer over the model's parameters (see the module docstring).
    torch.optim.Optimizer.__init__ is not run: the groups and the state are the inner
    optimizer's."""

    def __init__(self, zero):  # noqa: D107 - pylint: disable=super-init-not-called
        self._zero = zero

    @property
    def defaults(self) -> dict:
        return self._zero.optimizer.defaults

    @property
    def param_groups(self) -> list[_GroupView]:
        return [_GroupView(group, model_params(self._zero, list.__iter__(group[PARAMS])))
                for group in self._zero.optimizer.param_groups]

    @property
    def state(self) -> dict:
        """This rank's piece of each parameter's state (views into the shard's state)."""
        inner = self._initialised()
        pieces = {}
        for unit in self._zero.units:
            entry = inner.state.get(unit.shard)
            if not entry:
                continue
            start = unit.rank * unit.shard_numel
            for param, offset in zip(unit.params, unit.offsets):
                low = min(max(offset, start), start + unit.shard_numel) - start
                high = max(min(offset + param.numel(), start + unit.shard_numel) - start, low)
                pieces[param] = {key: value[low:high] if _per_element(value, unit) else value
                                 for key, value in entry.items()}
        return pieces

    def _initialised(self) -> torch.optim.Optimizer:
        """The inner optimizer, its state made (lr 0, zero gradients) if it has none."""
        zero, inner = self._zero, self._zero.optimizer
        if inner.state:
            return inner
        grads = [unit.shard.grad for unit in zero.units]
        lrs = [group["lr"] for group in inner.param_groups]
        stepping = getattr(zero, "_stepping", None)
        try:
            for group in inner.param_groups:
                group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
            for unit in zero.units:
                unit.shard.grad = torch.zeros_like(unit.shard)
            zero._stepping = True  # the inner optimizer's own step, allowed here
            inner.step()
        finally:
            zero._stepping = stepping
            for group, lr in zip(inner.param_groups, lrs):
                group["lr"] = lr
            for unit, grad in zip(zero.units, grads):
                unit.shard.grad = grad
        if zero.offload is not None:
            for unit in zero.units:
                zero.offload.adopt(inner.state.get(unit.shard, {}), unit.shard)
        return inner

    # ----- torch's format --------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's optimizer state dict, element-wise state as row-sharded DTensors;
        every rank of the group calls it (one all-gather per unit and state tensor)."""
        zero, inner = self._zero, self._initialised()
        mesh = zero._dp_mesh()
        groups = self.param_groups
        index = {id(param): i for i, param in enumerate(p for group in groups for p in group[PARAMS])}
        state: dict[int, dict] = {}
        for unit in zero.units:
            entry = inner.state.get(unit.shard) or {}
            for key in sorted(entry):
                value = entry[key]
                if _per_element(value, unit):
                    flat = gather_flat(unit, value, zero.communicator)
                    for param, view in zip(unit.params, param_views(unit, flat)):
                        state.setdefault(index[id(param)], {})[key] = dim0_piece(view, mesh, zero.world_size,
                                                                                  zero.rank)
                elif not torch.is_tensor(value) or value.dim() == 0:
                    for param in unit.params:
                        state.setdefault(index[id(param)], {})[key] = value.clone() if torch.is_tensor(value) else value
                else:
                    raise ValueError(f"ZeRO: optimizer state {key!r} has shape {tuple(value.shape)}, neither one "
                                     f"value per element of the shard ({unit.shard_numel}) nor a scalar")
        packed = [{**{key: value for key, value in group.items() if key != PARAMS},
                   PARAMS: [index[id(param)] for param in group[PARAMS]]} for group in groups]
        return {"state": dict(sorted(state.items())), "param_groups": packed}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's format (indices or the model's names, DTensors or whole
        tensors); every rank of the group calls it."""
        zero, inner = self._zero, self._zero.optimizer
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups) or any(len(a[PARAMS]) != len(b[PARAMS])
                                                   for a, b in zip(groups, saved_groups)):
            raise ValueError(f"ZeRO: the optimizer state has param groups of {[len(g[PARAMS]) for g in saved_groups]} "
                             f"parameters, this optimizer {[len(g[PARAMS]) for g in groups]}: build the optimizer "
                             "with the same param groups as the one saved")
        param_of = {saved: param for now, then in zip(groups, saved_groups)
                    for saved, param in zip(then[PARAMS], now[PARAMS])}
        per_param = {id(param_of[key]): entry for key, entry in state_dict["state"].items() if key in param_of}
        for now, then in zip(groups, saved_groups):
            for key, value in then.items():
                if key != PARAMS:
                    now[key] = value
        for unit in zero.units:
            entries = [per_param.get(id(param)) for param in unit.params]
            present = next((entry for entry in entries if entry), None)
            if present is None:
                continue
            rebuilt = {}
            for key in sorted(present):
                sample = present[key]
                if torch.is_tensor(sample) and sample.dim() > 0:  # one value per element of the parameter
                    flat = torch.zeros(unit.padded, dtype=unit.shard.dtype, device=unit.device)
                    for view, entry in zip(param_views(unit, flat), entries):
                        if entry is not None and key in entry:
                            view.copy_(whole(entry[key]).detach().reshape(view.shape))
                    rebuilt[key] = own_range(unit, flat).clone()
                else:
                    rebuilt[key] = whole(sample).detach().clone() if torch.is_tensor(sample) else sample
            inner.state[unit.shard] = rebuilt
        if zero.offload is not None:  # the loaded state into files, the replaced files let go
            for unit in zero.units:
                zero.offload.adopt(inner.state.get(unit.shard, {}), unit.shard)
            zero.offload.forget([value for entry in inner.state.values() for value in entry.values()])

    # ----- ZeRO's step -----------------------------------------------------------------
    def step(self, closure=None):
        """``zero.step()`` (a closure is not supported)."""
        if closure is not None:
            raise ValueError("ZeRO: step(closure) is not supported; compute the loss and backward first, then step()")
        self._zero.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise ValueError("ZeRO: param groups are fixed when the wrapper is built; give every group to the optimizer "
                         "before wrapping")


def model_params(zero, shards) -> list[torch.nn.Parameter]:
    """The model's parameters held by ``shards``' units, in the model's order."""
    by_shard = {id(unit.shard): unit for unit in zero.units}
    order = {id(param): i for i, param in enumerate(zero.module.parameters())}
    return sorted((param for shard in shards for param in by_shard[id(shard)].params), key=lambda p: order[id(p)])


def _caller_module(frame) -> str:
    """The module of the first frame from ``frame`` up that is not torch.optim's,
    a torch wrapper's or this module's: who called the optimizer's method."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith(PASSED_THROUGH):
        frame = frame.f_back
    return "" if frame is None else frame.f_globals.get("__name__", "")


def _by_checkpoint(frame) -> bool:
    module = _caller_module(frame)
    return module == CHECKPOINT_PACKAGE or module.startswith(CHECKPOINT_PACKAGE + ".")


class ShardParams(list):
    """A param group's shards (what the optimizer steps); iterated by torch's
    ``torch.distributed.checkpoint.state_dict``, the group's model parameters."""

    def __init__(self, shards, zero):
        super().__init__(shards)
        self._zero = weakref.ref(zero)

    def __iter__(self):
        zero = self._zero()
        if zero is not None and sys._getframe(1).f_globals.get("__name__") == STATE_DICT_MODULE:
            return iter(model_params(zero, list.__iter__(self)))
        return list.__iter__(self)


class ShardState(defaultdict):
    """The optimizer's state per shard; asked "any state?" by torch's
    ``torch.distributed.checkpoint.state_dict``, it is made first (``ParamOptimizer``'s
    lr-0 step) so that torch does not step the optimizer itself."""

    def __init__(self, state: dict, zero):
        super().__init__(dict, state)
        self._zero = weakref.ref(zero)

    def __bool__(self) -> bool:
        zero = self._zero()
        if not len(self) and zero is not None and sys._getframe(1).f_globals.get("__name__") == STATE_DICT_MODULE:
            zero.param_optimizer._initialised()
        return len(self) > 0


class _CheckpointHooks:
    """``state_dict()`` / ``load_state_dict()`` of ZeRO's optimizer, called by torch's
    checkpoint code: ``zero.param_optimizer``'s (holds ``zero`` weakly)."""

    def __init__(self, zero):
        self._zero, self._raw = weakref.ref(zero), False

    def after_state_dict(self, optimizer, state_dict):
        zero = self._zero()
        if zero is None or self._raw:
            return None
        if not _by_checkpoint(sys._getframe(1)):
            return flat_state_as_dtensors(zero, optimizer, state_dict)
        return zero.param_optimizer.state_dict()

    def before_load(self, optimizer, state_dict):
        zero = self._zero()
        if zero is None:
            return None
        if not _by_checkpoint(sys._getframe(1)):
            return flat_state_as_local(zero, optimizer, state_dict)
        zero.param_optimizer.load_state_dict(state_dict)
        self._raw = True
        try:  # the shards' state just rebuilt, for torch.optim's own load to take back as it is
            return optimizer.state_dict()
        finally:
            self._raw = False

    def after_load(self, optimizer) -> None:
        """torch.optim's load replaces the state dict: keep it a ShardState."""
        zero = self._zero()
        if zero is not None and not isinstance(optimizer.state, ShardState):
            optimizer.state = ShardState(optimizer.state, zero)


def present_per_parameter(zero, optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` (over ``zero``'s shards) ``zero.param_optimizer`` to torch's
    checkpoint code (see the module docstring)."""
    for group in optimizer.param_groups:
        group[PARAMS] = ShardParams(list.__iter__(group[PARAMS]), zero)
    optimizer.state = ShardState(optimizer.state, zero)
    hooks = _CheckpointHooks(zero)
    optimizer.register_state_dict_post_hook(hooks.after_state_dict)
    optimizer.register_load_state_dict_pre_hook(hooks.before_load)
    optimizer.register_load_state_dict_post_hook(hooks.after_load)


def _units_by_index(zero, optimizer) -> dict:
    """The index torch's ``state_dict()`` gives each shard -> the shard's flat unit."""
    by_shard = {id(unit.shard): unit for unit in zero.units}
    shards = [shard for group in optimizer.param_groups for shard in list.__iter__(group[PARAMS])]
    return {index: by_shard[id(shard)] for index, shard in enumerate(shards) if id(shard) in by_shard}


def flat_state_as_dtensors(zero, optimizer, state_dict: dict) -> dict:
    """The flat shards' state as ``optimizer.state_dict()`` gives it to user code, each
    element-wise tensor a DTensor: this rank's slice of the unit's padded flat state,
    ``Shard(0)`` over the ZeRO group (the flat layout is exactly that: equal, contiguous
    slices, no collective needed). ``torch.distributed.checkpoint.save({"optim":
    optimizer.state_dict()})`` then writes every rank's slice (as plain tensors it kept
    rank 0's alone, as if replicated); the tensors stay the optimizer's own."""
    mesh, units = zero._dp_mesh(), _units_by_index(zero, optimizer)
    state = {}
    for index, entry in state_dict["state"].items():
        unit = units.get(index)
        state[index] = {key: DTensor.from_local(value, mesh, [Shard(0)], run_check=False, shape=(unit.padded,),
                                                stride=(1,)) if unit is not None and _per_element(value, unit)
                        else value for key, value in entry.items()}
    return {**state_dict, "state": state}


def flat_state_as_local(zero, optimizer, state_dict: dict) -> dict:
    """``flat_state_as_dtensors``' state back to this rank's slices, for torch.optim's
    load; a slice of another layout (another number of ranks, units or buckets) is
    refused by name (torch's state-dict APIs with DCP reshard; this flat format cannot)."""
    units, ranks = _units_by_index(zero, optimizer), zero.world_size
    state = {}
    for index, entry in state_dict.get("state", {}).items():
        unit = units.get(index)
        state[index] = dict(entry)
        for key, value in entry.items():
            if not isinstance(value, DTensor):
                continue
            if unit is None or tuple(value.shape) != (unit.padded,) or value.device_mesh.size() != ranks:
                raise ValueError(
                    f"ZeRO: optimizer state {index}.{key} is the flat state of {tuple(value.shape)} elements over "
                    f"{value.device_mesh.size()} ranks; this optimizer's is {(unit.padded,) if unit else 'absent'} over "
                    f"{ranks}: optimizer.state_dict() loads only into the same layout; to change it save and load "
                    "with get_optimizer_state_dict / set_optimizer_state_dict (torch.distributed.checkpoint.state_dict)")
            state[index][key] = value.to_local()
    return {**state_dict, "state": state}


def _per_element(value, unit) -> bool:
    """A state tensor with one value per element of the unit's shard (Adam's moments)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.shape == unit.shard.shape
