"""Wrappers that hook their parameters (DataParallel, ZeRO 1-3, ShardedOptimizer) are
freed once the user drops them: the hooks the parameters hold keep them only weakly
(before plait.parallel.data.weak_hooks, every wrapper built stayed in memory for good, with
its buckets and optimizer state: a process building one per run grew by the model's
state each time)."""

import gc
import weakref

import pytest
import torch
from torch import nn

from plait.parallel.data.data_parallel import DataParallel
from plait.parallel.zero.optimizer import ShardedOptimizer
from plait.parallel.zero.module import ZeRO
from plait.testing import run_distributed


def _build(kind: str, model: nn.Module):
    if kind == "dataparallel":
        return DataParallel(model)
    if kind == "sharded":
        return ShardedOptimizer(torch.optim.AdamW(model.parameters()), None, stage=2)
    return ZeRO(model, lambda params: torch.optim.AdamW(params), stage=int(kind[-1]))


def _dropped(rank, world_size):
    freed = {}
    for kind in ("dataparallel", "zero1", "zero2", "zero3", "sharded"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        wrapper = _build(kind, model)
        forward = model if kind == "sharded" else wrapper
        forward(torch.ones(2, 4)).sum().backward()
        if kind == "sharded":
            wrapper.reduce_gradients()
        step = getattr(wrapper, "step", None)
        if step is not None:
            step()
        references = (weakref.ref(wrapper), weakref.ref(model))
        del wrapper, model, forward, step
        gc.collect()
        freed[kind] = [reference() is None for reference in references]
    return freed


@pytest.mark.slow
def test_dropped_wrappers_are_freed():
    for freed in run_distributed(_dropped, 2):
        assert freed == {kind: [True, True] for kind in ("dataparallel", "zero1", "zero2", "zero3", "sharded")}
