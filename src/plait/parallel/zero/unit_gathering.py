"""ZeRO stage 3's gathers around modules: each module's flat units (its parameters,
sharded over the data-parallel ranks) are all-gathered just before its forward,
freed right after it, gathered again when the gradient of its output arrives (before
its backward), and freed by the owner once their gradients are reduced. While one
module computes, the next one (in the order the last step's forwards ran them; in the
backward the one before) is already being gathered on plait's comm thread.

Built by ``plait.parallel.zero.engine`` for both fronts: ``ZeRO`` (one unit a module)
and ``ShardedOptimizer`` (plait train: a module's units split by optimizer param group
and tensor-parallel kind)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.parallel.zero.flat_units import FlatUnit, gather_units

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
        for index, module in enumerate(modules):
            module.register_forward_pre_hook(lambda _m, _a, index=index: self._before_forward(index))
            module.register_forward_hook(lambda _m, _a, out, index=index: self._after_forward(index, out))

    def new_step(self) -> None:
        """The forward order just recorded becomes the prefetch order."""
        if self._order_now:
            self._order = self._order_now
        self._order_now = []

    def ready(self, unit: FlatUnit) -> None:
        """``unit``'s parameters gathered: its prefetch waited for, or gathered now."""
        if unit.handle is not None:
            unit.wait()
        elif not unit.gathered:
            unit.gather(self.group, self.algorithm)

    def _ready_all(self, index: int) -> None:
        """Module ``index``'s units gathered: prefetches waited for, the rest in one call."""
        missing = []
        for unit in self.units[index]:
            if unit.handle is not None:
                unit.wait()
            elif not unit.gathered:
                missing.append(unit)
        if missing:
            gather_units(missing, self.group, self.algorithm)

    def _prefetch(self, index: int | None) -> None:
        """Start gathering module ``index``'s units (one call) on the comm thread."""
        if index is None:
            return
        missing = [unit for unit in self.units[index] if not unit.gathered]
        if missing:
            gather_units(missing, self.group, self.algorithm, async_op=True)

    def _neighbour(self, index: int, step: int) -> int | None:
        if index not in self._order:
            return None
        position = self._order.index(index) + step
        return self._order[position] if 0 <= position < len(self._order) else None

    def _before_forward(self, index: int) -> None:
        if self.paused:
            return
        self._ready_all(index)
        if index not in self._order_now:
            self._order_now.append(index)
        self._prefetch(self._neighbour(index, 1))

    def _after_forward(self, index: int, output) -> None:
        if self.paused:
            return
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _grads, index=index: self._before_backward(index), mode="any")
        for unit in self.units[index]:
            unit.free()

    def _before_backward(self, index: int) -> None:
        if self.paused:
            return
        self.on_backward()
        self._ready_all(index)
        self._prefetch(self._neighbour(index, -1))  # the backward runs the forward's order in reverse


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
