"""ZeRO stage 1's reduce-scatters overlapped with the backward, exactly.

Stage 1 keeps the full local gradients until the step (a norm, a clip, a no_sync
accumulation and a second backward all see them) and reduce-scatters each unit's
flat gradient then: the whole reduction is on the critical path after the backward
(~2Ψ(N-1)/N bytes per rank and one call per unit). Here each unit's reduce-scatter is
*also* issued on plait's comm thread as soon as its last gradient of a synchronised
backward is in, from a flat copy, the full gradients left in place; the step then
uses that result instead of reducing again, *if* what it would reduce is still what
was sent: every parameter's ``.grad`` the same tensor object at the same version
counter (any later backward, in-place write, ``mul_`` of a pending view, ``p.grad =
None``, or ``zero_grad`` changes one of them), on every rank (one all-reduce of a
flag per unit at the step agrees on it, so that the ranks issue the same
collectives). A unit whose result is stale is reduced again at the step, as before.
Either way the step adds the same bits into the shard's gradient: the same flat
gradient, the same reduce-scatter (unit, algorithm, ranks), the same division.

Cost: the flat copy of each unit's gradient (Ψ bytes, as the reduction at the step
makes anyway) lives while its reduce-scatter is in flight, and this rank's result
(Ψ/N) until the step; one small all-reduce (4 bytes a unit) per step.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.parallel.zero.flat_units import FlatUnit, reduce_units


class SpeculativeReduces:
    """Stage 1's reduce-scatters issued during the backward (see the module docstring)."""

    def __init__(self, group, algorithm: str, world_size: int):
        self.group, self.algorithm, self.world_size = group, algorithm, world_size
        # unit index -> ((unit, out, flat, handle), the .grad objects sent, their versions)
        self._issued: dict[int, tuple] = {}

    def issue(self, units: list[FlatUnit]) -> None:
        """Reduce-scatter ``units``' current gradients now, asynchronously, leaving them in ``.grad``."""
        for unit in units:
            self.discard([unit.index])
            grads = [param.grad for param in unit.params]
            versions = [None if grad is None else grad._version for grad in grads]
            (entry,) = reduce_units([unit], self.group, self.algorithm, async_op=True, keep_grads=True)
            self._issued[unit.index] = (entry, grads, versions)

    def discard(self, indices=None) -> None:
        """Drop the results of ``indices`` (default: every unit), their collectives waited for
        (they are in flight on every rank)."""
        for index in list(self._issued) if indices is None else indices:
            issued = self._issued.pop(index, None)
            if issued is not None and issued[0][3] is not None:
                issued[0][3].wait()

    def _current(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s issued reduction sent exactly what its ``.grad``s hold now."""
        issued = self._issued.get(unit.index)
        if issued is None:
            return False
        _entry, grads, versions = issued
        return all(param.grad is grad and (grad is None or grad._version == version)
                   for param, grad, version in zip(unit.params, grads, versions))

    def take(self, units: list[FlatUnit]) -> dict[int, tuple]:
        """The issued reductions of ``units`` that every rank still holds current, as
        (unit, out, flat, handle) entries to add in (the full gradients dropped and the
        units' ``used`` flags set, as ``reduce_units`` does); the rest discarded. One
        all-reduce of a flag per unit (every rank calls it, with the same units)."""
        current = torch.tensor([int(self._current(unit)) for unit in units], dtype=torch.int32)
        if self.world_size > 1:
            comm.all_reduce(current, group=self.group)
        taken = {}
        for unit, count in zip(units, current.tolist()):
            if count == self.world_size:
                entry = self._issued.pop(unit.index)[0]
                unit.used = [was or param.grad is not None for was, param in zip(unit.used, unit.params)]
                for param in unit.params:
                    param.grad = None
                taken[unit.index] = entry
        self.discard()
        return taken
