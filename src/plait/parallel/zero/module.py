"""ZeRO (Rajbhandari et al. 2020) over the data-parallel ranks of ``group``: optimizer
state (stage 1), gradients too (stage 2) and parameters too (stage 3), each rank
keeping 1/N of them.

Layout. The parameters are grouped into *units* and each unit is one flat buffer,
padded with zeros to a multiple of N and cut into N equal shards; rank r owns shard
r. The module's parameters become views into their unit's buffer (``.data``; the
Parameter objects stay the user's). Each rank's optimizer steps a float master copy
of its shards only (one ``nn.Parameter`` per unit), which is why the optimizer must
be element-wise: Adam's moment of element i depends only on element i, so stepping a
flat shard equals stepping the parameters (SGD, Adam, AdamW, Adagrad, Adadelta,
Adamax, NAdam, RAdam, RMSprop; others, whose update mixes elements of a tensor as
LAMB's trust ratio or Adafactor's factored moments do, are refused).

Optimizer. Given as torch users build it, over the model's parameters, with its param
groups (``torch.optim.AdamW(groups, lr=3e-4)``; no weight decay on biases and norms, an
lr per group): no unit mixes two groups, and the object itself is moved onto the shards
(each group its own units' shards, same options, fresh state; an lr scheduler built over
it keeps working). Or as a factory of the shards (``lambda shards: AdamW(shards, ...)``),
one group. See ``plait.parallel.zero.param_groups``. Mixed precision (``mp_policy``, FSDP2's
``MixedPrecisionPolicy``): float32 master shards and state, 16-bit parameters to compute
with, gradients reduced in ``reduce_dtype`` (``plait.parallel.zero.mixed_precision``).

- **Stage 1**: units are buckets of at most ``bucket_mb`` MiB in reverse registration
  order. Backward leaves full gradients in ``.grad``; ``step()`` reduce-scatters each
  bucket's flat gradient (sum / N: the average), steps the rank's shards and
  all-gathers the updated shards into the buffers. The reduce-scatters are issued
  during the backward already, on plait's comm thread, as each bucket's gradients
  are in; the step uses them where the gradients did not change since (exactly:
  ``plait.parallel.zero.speculative``).
- **Stage 2**: the same buckets, but each bucket's gradient is reduce-scattered on
  plait's comm thread as soon as its last gradient is ready *during* the backward
  (overlapped, as DataParallel's all-reduce), and the full gradients are dropped:
  only the shard is kept.
- **Stage 3**: units follow ``wrap`` (default: every child module that holds
  parameters, looking inside ModuleList / ModuleDict / Sequential; the root keeps the
  rest and any parameter two units share, a tied embedding, gathered for the whole
  forward and backward). A unit's buffer is
  allocated and all-gathered just before its forward, freed right after, gathered
  again when the gradient of its output arrives (before its backward), and its
  gradient reduce-scattered and its buffer freed as soon as its backward is done.
  While a unit computes, the next one (in the previous forward's order; in the
  backward the one before) is already being gathered on plait's comm thread. Freeing releases the storage (``resize_(0)``); the views keep their shapes, and
  autograd's saved references to them see the data again once it is re-gathered
  (written through an alias, so no version counter moves). Outside the wrapper's
  forward and backward each freed parameter is a NaN placeholder (no memory; reading
  it is safe, never a number): read whole parameters inside ``full_parameters()``.
  ``zero.module(...)`` outside ``zero(...)`` is refused by name; under
  ``torch.compile`` the stage-3 forward runs eagerly.

Communication per step and rank, Ψ the parameter bytes: ring reduce-scatter and
all-gather each send Ψ(N-1)/N, so stages 1 and 2 send 2Ψ(N-1)/N (an all-reduce's),
stage 3 3Ψ(N-1)/N (gather forward and backward, reduce-scatter).

Gradient accumulation: inside ``no_sync()`` the backward only accumulates full local
gradients (stage 3 keeps them in ``.grad`` between the gathers); the next backward
outside reduces the sums. Buffers (BatchNorm statistics) are broadcast from rank 0
before every forward, as DataParallel does.

Offload: ``offload="disk"`` keeps the optimizer state in memory-mapped files under
``offload_dir`` (default: the system's temporary directory) between steps, read back
during the backward and stepped one unit at a time on the CPU (see
``plait.parallel.zero.state_offload``); with the parameters on the CPU their float32
values are the master weights, so nothing else moves. ``offload="cpu"`` (host memory
for the state of a model on a GPU) and any offload of a model on a GPU are not built
yet, and are refused.

This module is the wrapper's front: arguments, the units' layout, the forward and
memory (its state dicts are ``plait.parallel.zero.state_dicts``'). What happens to the units from the backward to the next
forward (reduce-scatters, the step, gathers and frees) is ``plait.parallel.zero.engine``'s,
the engine plait train's ``ShardedOptimizer`` runs too.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.parallel.arguments import check_wrapper_arguments, wrapper_communicator
from plait.parallel.data.data_parallel import NoSync, verify_replicas
from plait.parallel.data.weak_hooks import weak_method
from plait.parallel.zero.engine import ShardEngine, check_elementwise, owners_of, storage_bytes
from plait.parallel.zero.flat_units import FlatUnit
from plait.parallel.zero.grad_views import ZeroGrads
from plait.parallel.zero.mixed_precision import as_policy, cast_floating
from plait.parallel.zero.param_groups import model_param_groups, move_onto_shards, plan_units
from plait.parallel.zero.param_optimizer import present_per_parameter
from plait.parallel.zero.state_dicts import ZeroStateDicts
from plait.parallel.zero.state_offload import StateFiles
from plait.parallel.zero.unit_gathering import default_wrap, refuse_outside_forward

STAGES = (1, 2, 3)
OFFLOADS = (None, "cpu", "disk")


class ZeRO(ZeroStateDicts, NoSync, nn.Module):
    """``module`` trained with ZeRO stage ``stage`` over ``group`` (default: the world);
    see the module docstring. ``optimizer``: a ``torch.optim`` optimizer built over the
    module's parameters (param groups kept; ZeRO moves it onto this rank's shards), or
    a factory of the shards (``lambda shards: torch.optim.AdamW(shards, lr=3e-4)``).
    ``mp_policy``: a ``MixedPrecisionPolicy`` (plait's or torch's FSDP2 one).

    Per step: ``zero(x)``, ``loss.backward()``, optionally ``zero.clip_grad_norm_(m)``,
    ``zero.step()``, ``zero.zero_grad()``. ``init``: "check" refuses parameters that
    differ between ranks (naming them), "broadcast" takes rank 0's."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | Callable, *, stage: int = 1,
                 group=None, bucket_mb: float = 25, algorithm: str = "auto", wrap: Callable | None = None,
                 init: str = "check", broadcast_buffers: bool = True, offload: str | None = None,
                 offload_dir=None, mp_policy=None):
        super().__init__()
        check_wrapper_arguments(module, group, "ZeRO")
        problems = []
        if isinstance(stage, bool) or stage not in STAGES:
            problems.append(f"stage={stage!r} must be 1, 2 or 3 (stage 0 is plain data parallelism: "
                            "plait.parallel.DataParallel)")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 < bucket_mb < math.inf:
            problems.append(f"bucket_mb={bucket_mb!r} must be a finite number of MiB > 0")
        if not callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            problems.append(f"optimizer={type(optimizer).__name__} must be a torch.optim optimizer built over the "
                            "module's parameters, e.g. torch.optim.AdamW(model.parameters(), lr=3e-4), or a function "
                            "of this rank's shards that builds one")
        problems += _offload_problems(module, offload)
        if problems:
            raise ValueError("ZeRO: " + "; ".join(problems))
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs torch.distributed to be initialised "
                               "(torch.distributed.init_process_group, or run under torchrun)")
        self.group = group  # as given (None: the world), as before
        group = wrapper_communicator(group, "ZeRO")  # a Communicator: every call goes through it
        self.module, self.stage, self.communicator, self.algorithm = module, stage, group, algorithm
        self.world_size, self.rank = group.size, group.rank
        self.broadcast_buffers = broadcast_buffers
        self._src = group.ranks[0]
        self.mp_policy = as_policy(mp_policy)
        given = isinstance(optimizer, torch.optim.Optimizer)
        groups = model_param_groups(module, optimizer) if given else \
            [[(name, param) for name, param in module.named_parameters() if param.requires_grad]]
        verify_replicas(module, group, init, "ZeRO")
        self.units = self._build_units(wrap or default_wrap, int(bucket_mb * (1 << 20)), groups)
        self._shape = [(id(param), tuple(param.shape)) for unit in self.units for param in unit.params]
        if given:
            move_onto_shards(optimizer, [[unit.shard for unit, index in zip(self.units, self._unit_groups)
                                          if index == group_index] for group_index in range(len(groups))])
            self.optimizer = optimizer
        else:
            self.optimizer = optimizer([unit.shard for unit in self.units])
            self._check_optimizer()
        present_per_parameter(self, self.optimizer)  # get_optimizer_state_dict(zero, optimizer): model keys
        self._stepping = False  # inside step(): the optimizer's own step() is refused outside it
        self.optimizer.register_step_pre_hook(weak_method(self._refuse_direct_step))
        self.offload = StateFiles(offload_dir or tempfile.gettempdir()) if offload == "disk" else None
        # every unit reduced after each backward, so that a unit no gradient reached on this rank
        # still joins the collective; the root (stage 3) gathered by the forward, freed after
        modules = [] if stage < 3 else list({id(module): module for module in self._unit_modules
                                             if module is not self.module}.values())
        self.engine = ShardEngine(self.units, self.optimizer, group, algorithm, stage, offload=self.offload,
                                  gathered_modules=[(module, [unit for unit in self.units
                                                              if self._unit_modules[unit.index] is module])
                                                    for module in modules],
                                  reduce_every_unit=True, collect_at_backward_end=True, rest_released=True,
                                  speculate_late=stage == 1)
        # each synchronised backward leaves every .grad a view of this rank's piece (grad_views):
        # torch's clip_grad_norm_ on them reduces over the ranks
        self.grads = ZeroGrads(self.units, self.engine, group, stage, module)
        self.engine.on_backward_end = weak_method(self._expose_grads)
        if self.engine.gatherer is not None:  # stage 3: zero.module(...) outside zero(...) refused by name
            self.engine.gatherer.wrapper_forward = False
            module.register_forward_pre_hook(weak_method(self._refuse_bypass))
            module.register_load_state_dict_pre_hook(weak_method(self._refuse_sharded_load))
        self._guard_sharded_module()  # stage 3: zero.module's own state_dict() refused while freed

    @property
    def _require_sync(self) -> bool:  # what no_sync() turns off: the engine's
        return self.engine.sync

    @_require_sync.setter
    def _require_sync(self, value: bool) -> None:
        self.engine.sync = value

    # ----- wrap time -------------------------------------------------------------------
    def _build_units(self, wrap: Callable, bucket_bytes: int, groups: list[list]) -> list[FlatUnit]:
        """Flat units of the trainable parameters, none mixing two of the optimizer's param
        ``groups``: stages 1-2 buckets in the backward's order; stage 3 one unit per (module
        of ``wrap``, group), the root keeping its own parameters and shared ones."""
        if not any(groups):
            raise ValueError("ZeRO: the module has no parameter that requires a gradient")
        modules = [] if self.stage < 3 else [unit for unit in wrap(self.module) if unit is not self.module]
        planned = plan_units(groups, self.stage, bucket_bytes, owners_of(modules), backward_order=True)
        self._unit_groups = [plan.group for plan in planned]
        self._unit_modules: list[nn.Module | None] = [
            None if self.stage < 3 else self.module if plan.owner is None else modules[plan.owner] for plan in planned]
        policy = self.mp_policy
        return [FlatUnit(index, plan.named, self.world_size, self.rank, self.stage == 3,
                         param_dtype=policy and policy.param_dtype, reduce_dtype=policy and policy.reduce_dtype)
                for index, plan in enumerate(planned)]

    def _is_root(self, unit: FlatUnit) -> bool:
        """Stage 3's root unit (the module's own and shared parameters): gathered for
        the whole forward and backward of a step, freed when its gradients are in."""
        return self._unit_modules[unit.index] is self.module

    def _check_optimizer(self) -> None:
        """A factory's optimizer: element-wise, over exactly this rank's shards, one group."""
        check_elementwise(self.optimizer)
        given = [param for group in self.optimizer.param_groups for param in group["params"]]
        shards = [unit.shard for unit in self.units]
        if len(self.optimizer.param_groups) > 1 and {id(p) for p in given} == {id(p) for p in shards}:
            raise ValueError(f"ZeRO: the optimizer factory made {len(self.optimizer.param_groups)} param groups over "
                             "the shards, which are buckets of parameters, not parameters: for per-parameter groups "
                             "give the optimizer itself, ZeRO(model, torch.optim.AdamW([{'params': decay}, {'params': "
                             "no_decay, 'weight_decay': 0.0}], lr=3e-4))")
        if len(given) != len(shards) or any(a is not b for a, b in zip(given, shards)):
            raise ValueError("ZeRO: the optimizer factory must build the optimizer over exactly the shards it is "
                             "given, in one param group (lambda shards: torch.optim.AdamW(shards, lr=3e-4)); an "
                             "optimizer over the model's parameters is given as itself: ZeRO(model, optimizer)")

    def _refuse_direct_step(self, *_args) -> None:
        """The optimizer's step pre-hook: only zero.step() steps it, over the shards only."""
        if not self._stepping:
            raise RuntimeError("ZeRO: optimizer.step() called directly; ZeRO reduces the gradients before the "
                               "optimizer steps its shards and gathers the parameters after: call zero.step() "
                               "(and zero.zero_grad())")
        held = [param for group in self.optimizer.param_groups for param in group["params"]]
        if len(held) != len(self.units) or {id(param) for param in held} != {id(unit.shard) for unit in self.units}:
            raise RuntimeError("ZeRO: the optimizer's param groups were changed after wrapping (add_param_group or "
                               "new params): it steps this rank's shards only; build the optimizer with every "
                               "group before ZeRO(model, optimizer)")

    @property
    def param_groups(self):
        """torch.amp.GradScaler.step(zero) / unscale_(zero) read this: refused by name."""
        raise TypeError("ZeRO: torch.amp.GradScaler does not work with ZeRO (it unscales and checks for infs on each "
                        "rank's own gradients, which ZeRO shards, and steps optimizer.step() itself): train in "
                        "bfloat16 with mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) (plait's or "
                        "torch.distributed.fsdp's), which needs no loss scaling (float32 master weights), or in "
                        "float32")

    def _expose_grads(self) -> None:
        if self.engine.sync:
            self.grads.expose()

    # ----- forward ---------------------------------------------------------------------
    def _refuse_bypass(self, *_args) -> None:
        """zero.module's forward pre-hook (stage 3): only zero(...) gathers the root."""
        gatherer, unit = self.engine.gatherer, self.units[0]
        if not gatherer.paused and unit.owns(unit.params[0]):  # not re-wrapped since
            refuse_outside_forward(gatherer.wrapper_forward)

    def _refuse_sharded_load(self, _module, state_dict, prefix, *_args) -> None:
        """zero.module's load_state_dict pre-hook (stage 3): writing sharded parameters
        at rest (NaN placeholders) is refused by name; ZeRO's own loads give it buffers."""
        if all(unit.gathered for unit in self.units):
            return  # inside full_parameters(): whole parameters, a plain load
        sharded = {prefix + name for unit in self.units for name in unit.names}
        given = sorted(key for key in state_dict if key in sharded)
        if given:
            raise RuntimeError(f"ZeRO stage 3: zero.module.load_state_dict(...) writes {given[0]!r} and other sharded "
                               "parameters; load through the wrapper, zero.load_state_dict(sd) or "
                               "zero.load_full_state_dict(sd), or inside `with zero.full_parameters():`")

    def forward(self, *args, **kwargs):
        if self.stage == 3:
            return self._forward_eagerly(*args, **kwargs)
        return self._forward(*args, **kwargs)

    @torch.compiler.disable
    def _forward_eagerly(self, *args, **kwargs):
        """Stage 3's forward, never traced by torch.compile (dynamo would trace through
        the hooks that gather and free each unit's parameters): under torch.compile(zero)
        it runs eagerly, so exactly."""
        return self._forward(*args, **kwargs)

    def _forward(self, *args, **kwargs):
        self._refuse_inside_full_parameters()
        self._check_unchanged()
        self.grads.before_forward()  # the gradient views go; the next backward accumulates as before
        if self.engine.in_backward:
            raise RuntimeError("ZeRO: the previous backward did not finish reducing its gradients (it raised or "
                               "was interrupted); rebuild the wrapper to recover")
        if self.broadcast_buffers and self.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                flat = torch.cat([buffer.detach().reshape(-1).to(torch.float64) for buffer in buffers])
                comm.broadcast(flat, src=self._src, group=self.communicator)
                offset = 0
                for buffer in buffers:
                    buffer.copy_(flat[offset:offset + buffer.numel()].view(buffer.shape))
                    offset += buffer.numel()
        roots = []
        if self.engine.gatherer is not None:
            self.engine.gatherer.new_step()
            roots = [unit for unit in self.units if self._is_root(unit)]
            self.engine.gatherer.wrapper_forward = True
            for unit in self.units:
                unit.arm()  # a parameter used outside its unit's forward fails by name, below
        for unit in roots:
            self.engine.gatherer.ready(unit)
        policy = self.mp_policy
        if policy is not None and policy.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), policy.param_dtype)
        try:
            output = self.module(*args, **kwargs)
            if not torch.is_grad_enabled():  # no backward to come: the root's parameters go now
                for unit in roots:
                    unit.free()
            return output if policy is None else cast_floating(output, policy.output_dtype)
        except RuntimeError as error:
            if self.stage == 3 and ("storage of size 0" in str(error) or "data is not allocated" in str(error)):
                raise RuntimeError(
                    f"ZeRO stage 3: the forward used a parameter of a unit outside that unit's forward, after it was "
                    f"freed ({error}); a parameter used by two modules must be registered in both (a tied weight: "
                    "head.weight = embed.weight); a module whose parameters the parent uses directly (F.layer_norm("
                    "x, ..., self.norm.weight)) must not be a unit: give wrap= a policy that leaves it to the root"
                ) from error
            raise
        finally:
            if self.engine.gatherer is not None:  # reading a parameter is safe until the next forward
                self.engine.gatherer.wrapper_forward = False
                for unit in self.units:
                    unit.rest()

    def _check_unchanged(self) -> None:
        now = [(id(param), tuple(param.shape)) for unit in self.units for param in unit.params]
        current = {id(param) for param in self.module.parameters() if param.requires_grad}
        if now != self._shape or current != {key for key, _ in self._shape}:
            raise RuntimeError("ZeRO: the module's parameters were added, removed or resized after wrapping; "
                               "wrap the finished model")
        for unit in self.units:  # zero.to(dtype) / .double() / .to(device) give the parameters new storages
            for name, param in zip(unit.names, unit.params):
                if not unit.owns(param):
                    raise RuntimeError(
                        f"ZeRO: {name!r} was cast or moved after wrapping (now {param.dtype} on {param.device}; "
                        f"its shards are {unit.shard.dtype} on {unit.device}), cutting it off from its shards: "
                        "cast/move the model before wrapping (or use mp_policy= for a compute dtype)")

    # ----- step ------------------------------------------------------------------------
    def _reduce_pending(self) -> None:
        """Stage 1 reduces at the step (or at the first norm torch asks of its gradient
        views): every unit's full gradient, reduce-scattered."""
        self.grads.settle()
        if self.stage == 1 and not self.engine.reduced:
            if all(param.grad is None for unit in self.units for param in unit.params):
                raise RuntimeError("ZeRO: step() without a backward since the last zero_grad(); call "
                                   "loss.backward() first")
            self.engine.reduce_gradients()
        if not self.engine.reduced:
            raise RuntimeError("ZeRO: step() without a backward since the last zero_grad(); call "
                               "loss.backward() first")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their global ``norm_type``-norm (over every rank's
        shards, and the tp ranks of plait tensor layers inside) is at most ``max_norm``,
        as torch.nn.utils.clip_grad_norm_ scales (by max_norm / (norm + 1e-6) when below
        1); returns the norm before clipping, in the gradients' (master) dtype."""
        self._reduce_pending()
        norm = self.grads.total_norm(norm_type)
        scale = max_norm / (float(norm) + 1e-6)
        if scale < 1:
            self.engine.scale_gradients(scale)
        return norm.to(self.units[0].shard.dtype)

    def step(self) -> None:
        """Step this rank's shards, then (stages 1 and 2) all-gather the parameters. A
        parameter no rank gave a gradient is left as it was, its optimizer state too
        (as torch's optimizers skip a parameter whose .grad is None)."""
        self._reduce_pending()
        self._stepping = True
        try:
            self.engine.step()
        finally:
            self._stepping = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()
        self.grads.reset()

    # ----- measured memory -------------------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of live storages this rank holds now: gathered parameter buffers, full
        and sharded gradients, master shards and optimizer state in memory, and
        optimizer state in offload files (each storage once)."""
        seen: set[int] = set()
        return {"params_bytes": storage_bytes((unit.full for unit in self.units), seen),
                "grads_bytes": storage_bytes([self.grads.local_grad(param) for unit in self.units
                                              for param in unit.params]
                                             + [unit.shard.grad for unit in self.units], seen),
                "master_bytes": storage_bytes((unit.shard for unit in self.units), seen),
                "optimizer_bytes": storage_bytes(self.engine.state_tensors(offloaded=False), seen),
                "offloaded_bytes": storage_bytes(self.engine.state_tensors(offloaded=True), seen)}


def _offload_problems(module: nn.Module, offload) -> list[str]:
    if offload not in OFFLOADS:
        return [f"offload={offload!r} must be None, 'cpu' or 'disk'"]
    devices = {param.device.type for param in module.parameters()}
    if offload == "cpu" and devices == {"cpu"}:
        return ["offload='cpu' moves the optimizer state of a model on a GPU to host memory, and this model's "
                "parameters are already in host memory: use offload='disk' (memory-mapped files) or None"]
    if offload is not None and devices != {"cpu"}:
        return [f"offload={offload!r} with parameters on {sorted(devices)} is not built yet (only the state of a "
                "model on the CPU can be offloaded, to disk): use offload=None"]
    return []
