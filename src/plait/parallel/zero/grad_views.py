"""torch's gradient-norm idioms on a ZeRO model: ``torch.nn.utils.clip_grad_norm_(
zero.parameters(), max_norm)`` (and ``get_total_norm`` / ``clip_grads_with_norm_``,
``foreach`` on or off) gives the norm one process would and clips exactly, as FSDP2's
DTensor gradients make it do.

After each synchronised backward, every parameter's ``.grad`` is a ``ShardedGrad``: a
tensor with the parameter's shape, dtype and device whose data is only this rank's
piece of the *averaged* gradient (the slice of the parameter inside this rank's flat
shard, a view of ``unit.shard.grad``, the gradient ZeRO steps). At stage 1, whose full
local gradients stay until the step, the view is *pending*: the first norm asked of any
of them reduce-scatters every unit (the reduction ``step()`` would do, moved earlier:
the same 2Ψ(N-1)/N bytes a step), after which it is a piece like the others.

It implements exactly what torch's clipping runs, and refuses every other op by name:

- ``torch._foreach_norm`` / ``torch.linalg.vector_norm`` (p > 0, or inf): each
  parameter's ||g||_p is (Σ_pieces Σ|x|^p)^(1/p), the sums all-reduced over the ZeRO
  group and, for a tensor-parallel sharded parameter (``tp_shard``), over its layer's
  tp group too (a tp-replicated one is whole on every tp rank: counted once). One
  all-reduce of a float64 vector per group per call, so ``foreach=True`` costs one
  per group and the per-tensor path one per parameter per group.
- ``mul_`` / ``_foreach_mul_`` by a scalar and ``zero_`` / ``_foreach_zero_`` write the
  piece (and so the shard gradient the step uses); ``clamp_`` and its foreach forms
  (``clip_grad_value_``) too, on the averaged gradient (a pending view reduced first).

Every rank must make the same calls (they are collectives), as with DTensor. The wrapper
takes the views away before its next forward (a reduced one goes: the shard keeps the
sum; a pending one gives its full local gradient back, so the next backward accumulates
into it as before); one that the user dropped meanwhile (``model.zero_grad()``) drops
that parameter's gradient from the shard too.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from plait import comm
from plait.parallel.data.tp_grads import local_power, norm_arguments, reduce_powers, whole_tensor_norm
from plait.parallel.tensor.group import TensorParallel
from plait.parallel.tensor.sharding import shard_spec

_aten = torch.ops.aten
_NORMS = (_aten._foreach_norm.Scalar, _aten.linalg_vector_norm.default)
_SCALES = (_aten.mul_.Tensor, _aten.mul_.Scalar, _aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar,
           _aten._foreach_mul_.ScalarList, _aten._foreach_mul_.List)
_ZEROS = (_aten.zero_.default, _aten._foreach_zero_.default)
# element-wise, not linear: on the averaged gradient's pieces (stage 1 reduces first)
_CLAMPS = (_aten.clamp_.default, _aten.clamp_min_.default, _aten.clamp_max_.default,
           _aten._foreach_clamp_min_.Scalar, _aten._foreach_clamp_max_.Scalar)


class ShardedGrad(torch.Tensor):
    """The gradient of ``param`` as ZeRO holds it: this rank's piece (see the module
    docstring). ``grads`` is the ``ZeroGrads`` that made it."""

    @staticmethod
    def __new__(cls, param: nn.Parameter, grads: ZeroGrads, unit, slot: int, local: torch.Tensor | None):
        view = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device,
                                                   requires_grad=False)
        view._grads, view._unit, view._slot = grads, unit, slot
        view._local = local  # stage 1 before the reduction: the full local gradient (None: none)
        view._pending = grads.stage == 1
        return view

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def param_name(self) -> str:
        return self._unit.names[self._slot]

    def piece(self) -> torch.Tensor | None:
        """This rank's elements of the averaged gradient (a view of the shard's; empty
        where the parameter lies outside this rank's shard), or the full local one while
        pending."""
        if self._pending:
            return self._local
        unit = self._unit
        grad = unit.shard.grad
        if grad is None:
            return None
        start = unit.rank * unit.shard_numel
        low = max(unit.offsets[self._slot], start)
        high = min(unit.offsets[self._slot] + unit.params[self._slot].numel(), start + unit.shard_numel)
        return grad[low - start:max(high, low) - start]

    def __repr__(self) -> str:
        unit, state = self._unit, "its full local gradient, not yet averaged" if self._pending else \
            "its piece of the averaged gradient"
        return (f"ShardedGrad({self.param_name!r}, shape={tuple(self.shape)}, ZeRO stage {self._grads.stage} over "
                f"{unit.world_size} ranks: rank {unit.rank} holds {state})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NORMS:
            return _norms(func, args, kwargs)
        if func in _SCALES:
            return _scale(func, args)
        if func in _ZEROS:
            return _apply(args[0], lambda tensor: tensor.zero_())
        if func in _CLAMPS and not any(torch.is_tensor(value) for value in args[1:]):
            return _clamp(func, args, kwargs)
        raise RuntimeError(_refusal(func, args))


def _views(tensors) -> list[ShardedGrad]:
    return [tensor for tensor in tensors if isinstance(tensor, ShardedGrad)]


def _refusal(func, args) -> str:
    first = args[0] if args else None
    view = first if isinstance(first, ShardedGrad) else next(iter(_views(first if isinstance(first, (list, tuple))
                                                                           else args)), None)
    name = view.param_name if view is not None else "?"
    stage = view._grads.stage if view is not None else "?"
    held = "its full local gradient, not yet averaged over the ranks" if view is not None and view._pending \
        else "only its piece of the averaged gradient"
    hint = ""
    if func in (_aten.add_.Tensor, _aten.add.Tensor):
        hint = (" (a backward accumulating into a gradient ZeRO has reduced: run the forward through the ZeRO "
                "wrapper, which makes room, or call zero.zero_grad() first)")
    return (f"the gradient of {name!r} is sharded by ZeRO stage {stage}: this rank holds {held}, so "
            f"{func} is refused{hint}; torch.nn.utils.clip_grad_norm_ / get_total_norm / clip_grads_with_norm_ / "
            "clip_grad_value_ and zero.clip_grad_norm_(max_norm) work on it (over every rank), and "
            "zero.full_state_dict() gives the whole parameters")


def _apply(target, write) -> None:
    """``write`` on the piece of each view in ``target`` (a tensor or a list) and on each plain tensor."""
    for tensor in target if isinstance(target, (list, tuple)) else [target]:
        piece = tensor.piece() if isinstance(tensor, ShardedGrad) else tensor
        if piece is not None:
            write(piece)
            if isinstance(tensor, ShardedGrad) and tensor._pending:
                # written below autograd (inside __torch_dispatch__), where torch moves no version
                # counter: moved here, so that stage 1's reduction issued before (speculative) is stale
                torch.autograd.graph.increment_version(piece)
    return target if isinstance(target, torch.Tensor) else None


def _clamp(func, args, kwargs):
    """torch's clip_grad_value_: the clamp of each piece of the averaged gradient is the
    clamp of the whole one (element-wise); pending views are reduced first."""
    target = args[0]
    listed = isinstance(target, (list, tuple))
    for grads in {id(view._grads): view._grads for view in _views(target if listed else [target])
                  if view._pending}.values():
        grads.settle()
    pieces = [tensor.piece() if isinstance(tensor, ShardedGrad) else tensor for tensor in (target if listed
                                                                                             else [target])]
    pieces = [piece for piece in pieces if piece is not None]
    if listed:
        func(pieces, *args[1:], **kwargs)
        return None
    for piece in pieces:
        func(piece, *args[1:], **kwargs)
    return target


def _scalar(value, func):
    if isinstance(value, torch.Tensor):
        if isinstance(value, ShardedGrad) or value.numel() != 1:
            raise RuntimeError(f"{func} of a ZeRO-sharded gradient by a tensor of shape {tuple(value.shape)} is "
                               "refused: only a scalar factor (what clipping uses) maps onto the pieces")
        return value.reshape(())
    return value


def _scale(func, args):
    target, factor = args[0], args[1]
    if func in (_aten._foreach_mul_.ScalarList, _aten._foreach_mul_.List):
        for tensor, each in zip(target, factor):
            each = _scalar(each, func)
            _apply(tensor, lambda piece, each=each: piece.mul_(each.to(piece.device) if torch.is_tensor(each)
                                                              else each))
        return None
    factor = _scalar(factor, func)
    return _apply(target, lambda piece: piece.mul_(factor.to(piece.device) if torch.is_tensor(factor) else factor))


def _norms(func, args, kwargs):
    """torch's per-tensor norms, each over every rank's piece (see the module docstring)."""
    tensors, order, dtype, single = norm_arguments(func, args, kwargs)
    if single and not whole_tensor_norm(args, kwargs):
        raise RuntimeError(f"torch.linalg.vector_norm over some dims of the ZeRO-sharded gradient of "
                           f"{tensors[0].param_name!r} is refused (each rank holds a flat piece): only the norm of "
                           "the whole gradient (dim=None) is reduced over the ranks")
    if not (order > 0):
        raise RuntimeError(f"norm_type={order} of a ZeRO-sharded gradient is refused: the norms reduced over "
                           "the ranks are p > 0 and inf")
    norms = global_norms(tensors, order)
    results = [norms[index].to(dtype or _dtype_of(tensor)).to(tensor.device) for index, tensor in enumerate(tensors)]
    return results[0] if single else results


def _dtype_of(tensor: torch.Tensor) -> torch.dtype:
    """A view's norm in its pieces' dtype (the float32 master's under mixed precision,
    as FSDP2's float32 sharded gradients give), a plain tensor's in its own."""
    if isinstance(tensor, ShardedGrad) and tensor._unit.shard.grad is not None:
        return tensor._unit.shard.grad.dtype
    return tensor.dtype


def global_norms(tensors, order: float) -> torch.Tensor:
    """Each tensor's p-norm over every rank's piece (a plain tensor: its own), float64
    on the CPU; pending views settled first (stage 1's reduction)."""
    for grads in {id(view._grads): view._grads for view in _views(tensors) if view._pending}.values():
        grads.settle()  # stage 1: the reduction step() would do, now
    powers, groups = [], []
    for tensor in tensors:
        piece = tensor.piece() if isinstance(tensor, ShardedGrad) else tensor
        powers.append(local_power(piece, order))
        groups.append(tensor._grads.groups_of(tensor) if isinstance(tensor, ShardedGrad) else ())
    totals = reduce_powers(torch.stack(powers), groups, order) if powers else torch.zeros(0, dtype=torch.float64)
    return totals if math.isinf(order) else totals.pow(1.0 / order)


def tensor_parallel_groups(module: nn.Module) -> dict[int, TensorParallel]:
    """id(parameter) -> the TensorParallel of the plait tensor layer holding it, for
    every tensor-parallel sharded parameter (``tp_shard``) of ``module``."""
    found = {}
    for sub in module.modules():
        tp = getattr(sub, "tp", None)
        if isinstance(tp, TensorParallel):
            for param in sub.parameters(recurse=False):
                if shard_spec(param) is not None:
                    found[id(param)] = tp
    return found


class ZeroGrads:
    """The ``ShardedGrad`` views of one ZeRO wrapper's parameters: made after each
    synchronised backward (``expose``), settled (stage 1's reduction) by the first norm,
    taken away before the next forward (``before_forward``)."""

    def __init__(self, units, engine, communicator, stage: int, module: nn.Module):
        self.units, self.engine, self.communicator, self.stage = units, engine, communicator, stage
        self._tp = tensor_parallel_groups(module)
        self._tp_sharded = {id(param) for unit in units for param in unit.params if shard_spec(param) is not None}
        self._exposed: list[tuple[nn.Parameter, ShardedGrad]] = []

    def groups_of(self, view: ShardedGrad) -> tuple:
        """The groups ``view``'s piece is summed over: ZeRO's, then its tp group if sharded."""
        param = view._unit.params[view._slot]
        groups = (self.communicator,) if self.communicator.size > 1 else ()
        if id(param) in self._tp_sharded:
            tp = self._tp.get(id(param))
            if tp is None:
                raise RuntimeError(f"the gradient of {view.param_name!r} is tensor-parallel sharded (tp_shard) but no "
                                   "module holding it has a .tp TensorParallel, so its norm over the tp ranks cannot "
                                   "be formed: build it from plait.parallel.tensor layers")
            if tp.size > 1:
                groups += (comm.communicator_for(tp.group),)  # one object per group: reduced once
        return groups

    @property
    def pending(self) -> bool:
        return any(view._pending for _, view in self._exposed)

    def expose(self) -> None:
        """After a synchronised backward: every parameter's ``.grad`` its view (stage 1:
        pending, holding the full local gradient)."""
        exposed = []
        for unit in self.units:
            for slot, param in enumerate(unit.params):
                local = param.grad if self.stage == 1 else None
                view = ShardedGrad(param, self, unit, slot, local)
                param.grad = view
                exposed.append((param, view))
        self._exposed = exposed

    def settle(self) -> None:
        """Stage 1: the full local gradients reduce-scattered now (every rank calls it);
        the views become pieces of the averages."""
        if not self.pending:
            return
        for param, view in self._exposed:
            if param.grad is view:
                param.grad = view._local
        self.engine.reduce_gradients()
        for param, view in self._exposed:
            view._pending, view._local = False, None
            if param.grad is None:
                param.grad = view
        self._exposed = [(param, view) for param, view in self._exposed if param.grad is view]

    def local_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s full local gradient held in memory (a pending view's), else None
        for a view, else ``param.grad``."""
        grad = param.grad
        if isinstance(grad, ShardedGrad):
            return grad._local if grad._pending else None
        return grad

    def before_forward(self) -> None:
        """The views taken away: a pending one gives back its full local gradient (the
        next backward accumulates into it), a reduced one goes (the shard keeps the sum).
        A view the user dropped or replaced meanwhile (torch's ``zero_grad``) drops that
        parameter's gradient from the shard too: all of them, as ``zero.zero_grad()``.
        A forward without autograd (an evaluation between the backward and the clip)
        leaves them."""
        if not torch.is_grad_enabled():
            return
        exposed, self._exposed = self._exposed, []
        if not exposed:
            return
        if all(param.grad is not view for param, view in exposed):  # torch's zero_grad(): every one dropped
            self.engine.zero_grad()
            return
        for param, view in exposed:
            if param.grad is view:
                param.grad = view._local if view._pending else None
            elif not view._pending:
                piece = view.piece()
                if piece is not None:
                    piece.zero_()

    def reset(self) -> None:
        self._exposed = []

    def total_norm(self, order: float = 2.0) -> torch.Tensor:
        """The p-norm of the whole averaged gradient (every parameter, every rank's
        piece, tp groups summed), float64: ``zero.clip_grad_norm_``'s."""
        views = [ShardedGrad(param, self, unit, slot, None) for unit in self.units
                 for slot, param in enumerate(unit.params)]
        for view in views:
            view._pending = False
        return torch.linalg.vector_norm(global_norms(views, float(order)), float(order))
