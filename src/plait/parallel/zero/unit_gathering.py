"""ZeRO stage 3's gathers around modules: each module's flat units (its parameters,
sharded over the data-parallel ranks) are all-gathered just before its forward,
freed right after it, gathered again when the gradient of its output arrives (before
its backward), and freed by the owner once their gradients are reduced. While one
module computes, the next one (in the order the last step's forwards ran them; in the
backward the one before) is already being gathered on plait's comm thread.

The last module of that order is not freed after a forward that records a graph: its
backward is the first to come (what follows it in the forward is the root's own
computation and the loss), so freeing it would only gather the same bytes again, on
the critical path, a moment later (DeepSpeed's ``stage3_max_reuse_distance``; FSDP2
keeps its root for the same reason). It holds no more than the backward's start
holds anyway (that module plus the one prefetched); one unit's bytes, Ψ_unit(N-1)/N, less
sent per step.

Built by ``plait.parallel.zero.engine`` for both fronts: ``ZeRO`` (one unit a module)
and ``ShardedOptimizer`` (plait train: a module's units split by optimizer param group
and tensor-parallel kind)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from plait.comm.errors import MismatchError
from plait.parallel.zero.flat_units import FlatUnit, _Scattered, gather_units

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def default_wrap(module: nn.Module) -> list[nn.Module]:
    """Stage 3's units: every child holding parameters, containers looked inside."""
    units = []
    for child in module.children():
        if isinstance(child, _CONTAINERS):
            units.extend(default_wrap(child))
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


class UnitGatherer:
    """Hooks on ``modules``; ``units[i]`` are module i's flat units. ``on_backward`` is
    called when a module's backward is about to start (before any of its gradients)."""

    def __init__(self, modules: list[nn.Module], units: list[list[FlatUnit]], group, algorithm: str,
                 on_backward: Callable[[], None]):
        self.modules, self.units, self.group, self.algorithm = modules, units, group, algorithm
        self.on_backward = on_backward
        self._order: list[int] = []  # module indices in the last step's forward order
        self._order_now: list[int] = []
        self.paused = False  # ZeRO.full_parameters(): every unit gathered, the hooks stand aside
        # ZeRO's own forward running (None: no wrapper, plait train's ShardedOptimizer runs the model itself)
        self.wrapper_forward: bool | None = None
        # seconds spent making modules' units ready before their forward or backward (prefetch
        # waits and synchronous gathers): communication the caller's compute timers enclose
        self.waited_s = 0.0
        # this step's prefetches: (module index, "forward" or "backward", the gather's handle, whose
        # started_s / finished_s the comm thread sets), cleared by new_step (timing only, for tests and
        # profiles)
        self.prefetched: list[tuple] = []
        for index, module in enumerate(modules):
            module.register_forward_pre_hook(lambda _m, _a, index=index: self._before_forward(index))
            module.register_forward_hook(lambda _m, _a, out, index=index: self._after_forward(index, out))

    def new_step(self) -> None:
        """The forward order just recorded becomes the prefetch order."""
        if self._order_now:
            self._order = self._order_now
        self._order_now = []
        self.prefetched = []

    def ready(self, unit: FlatUnit) -> None:
        """``unit``'s parameters gathered: its prefetch waited for, or gathered now."""
        if unit.handle is not None:
            unit.wait()
        elif not unit.gathered:
            unit.gather(self.group, self.algorithm)

    def _ready_all(self, index: int) -> None:
        """Module ``index``'s units gathered: prefetches waited for, the rest in one call
        (the time it takes added to ``waited_s``)."""
        start_s = time.perf_counter()
        try:
            self._gather_now(index)
        finally:
            self.waited_s += time.perf_counter() - start_s

    def _gather_now(self, index: int) -> None:
        with _named_mismatch(self.units[index]):
            missing = []
            for unit in self.units[index]:
                if unit.handle is not None:
                    unit.wait()
                elif not unit.gathered:
                    missing.append(unit)
            if missing:
                gather_units(missing, self.group, self.algorithm)

    def _prefetch(self, index: int | None, direction: str) -> None:
        """Start gathering module ``index``'s units (one call) on the comm thread."""
        if index is None:
            return
        missing = [unit for unit in self.units[index] if not unit.gathered]
        if missing:
            with _named_mismatch(missing):
                gather_units(missing, self.group, self.algorithm, async_op=True)
            handle = missing[0].handle  # several units: the one gather they share, its comm handle inside
            self.prefetched.append((index, direction, handle.handle if isinstance(handle, _Scattered) else handle))

    def _neighbour(self, index: int, step: int) -> int | None:
        if index not in self._order:
            return None
        position = self._order.index(index) + step
        return self._order[position] if 0 <= position < len(self._order) else None

    def _taken(self, index: int) -> bool:
        """Module ``index``'s parameters belong to another wrapper since (re-wrapped inside
        ``full_parameters()``): this wrapper's hooks stand aside."""
        unit = self.units[index][0]
        return not unit.owns(unit.params[0])

    def _before_forward(self, index: int) -> None:
        if self.paused or self._taken(index):
            return
        refuse_outside_forward(self.wrapper_forward)
        self._ready_all(index)
        if index not in self._order_now:
            self._order_now.append(index)
        self._prefetch(self._neighbour(index, 1), "forward")

    def _after_forward(self, index: int, output) -> None:
        if self.paused or self._taken(index):
            return
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _grads, index=index: self._before_backward(index), mode="any")
        if torch.is_grad_enabled() and self._order and index == self._order[-1]:
            return  # its backward comes first: kept gathered for it (see the module docstring)
        for unit in self.units[index]:
            unit.free(keep_views=True)  # autograd's saved views of it wait for its backward's gather

    def _before_backward(self, index: int) -> None:
        if self.paused or self._taken(index):
            return
        self.on_backward()
        self._ready_all(index)
        self._prefetch(self._neighbour(index, -1), "backward")  # the backward runs the forward's order in reverse


@contextlib.contextmanager
def _named_mismatch(units: list[FlatUnit]):
    """A collective mismatch while gathering ``units``: the ranks ran different units
    (a branch only some ranks take), named with the fix."""
    try:
        yield
    except MismatchError as error:
        raise MismatchError(
            f"ZeRO stage 3: the ranks gathered different units (this rank the unit of {units[0].names[0]!r}): every "
            "rank must run the same units in the same order at stage 3; a submodule only some ranks run (a branch, a "
            "routed expert) must be in the root unit (wrap= a policy that leaves it out) or use stage 2 "
            f"({error})", before_any_message=error.before_any_message) from error


def refuse_outside_forward(wrapper_forward: bool | None) -> None:
    """A stage-3 module run (``wrapper_forward`` False) through ``zero.module`` outside
    ``zero(...)`` and outside a backward (an activation checkpoint's recomputation runs
    there): its units would not be gathered right."""
    if wrapper_forward is False and torch._C._current_graph_task_id() == -1:  # noqa: SLF001 - no public spelling
        raise RuntimeError("ZeRO stage 3: zero.module(...) called outside zero(...): its parameters are sharded "
                           "and only the wrapper's forward gathers them; call zero(...), or use `with "
                           "zero.full_parameters():` to run zero.module on whole parameters")


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
