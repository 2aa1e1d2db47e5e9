"""The overlap the planner assumes is there in plait's runtime: on 2 ranks, ZeRO 2's
bucket reduce-scatters and DataParallel's bucket all-reduces start on the comm thread
while the backward still computes earlier layers (``plait.plan.overlap``'s model),
timed by the comm layer's own handles (``Handle.started_s``, ``time.perf_counter()``
when the comm thread began the call) against a hook at the first layer's backward."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from plait.parallel.data.data_parallel import DataParallel
from plait.parallel.zero.optimizer import ShardedOptimizer
from plait.testing import run_distributed

# the first layer's input needs no gradient: torch says its full backward hook fires on the output's gradient,
# which is when that layer's backward begins (what the test times)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

WIDTH, ROWS, LAYERS = 96, 4096, 6  # a layer's backward: two 4096x96x96 float64 GEMMs, milliseconds each
LAYER_MB = (WIDTH * WIDTH + WIDTH) * 8 / (1 << 20)  # one layer's gradients: one bucket each


def _model() -> tuple[nn.Sequential, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(LAYERS)])
    marks: dict = {}

    def first_layer_backward(_module, _grad_output) -> None:
        marks.setdefault("first_layer_s", time.perf_counter())

    model[0].register_full_backward_pre_hook(first_layer_backward)
    return model, marks


def _timeline(rank: int, world_size: int) -> dict:
    inputs = torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    model, marks = _model()
    optimizer = ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), None, stage=2, bucket_mb=LAYER_MB)
    for _ in range(2):  # the second step is timed: the first sets up the communicator and its comm thread
        marks.clear()
        optimizer.begin_step()
        model(inputs).square().mean().backward()
        backward_end_s = time.perf_counter()
        handles = [entry[-1] for entry in optimizer.engine._in_flight]  # noqa: SLF001 - the calls the backward issued
        optimizer.reduce_gradients()  # waits for them: every handle has its start time now
        optimizer.step()
    zero = {"started_s": sorted(handle.started_s for handle in handles), "first_layer_s": marks["first_layer_s"],
            "backward_end_s": backward_end_s}
    model, marks = _model()
    ddp = DataParallel(model, bucket_mb=LAYER_MB)
    for _ in range(2):
        marks.clear()
        ddp(inputs).square().mean().backward()
    stats = ddp.history[-1]
    data = {"started_s": sorted(stats.bucket_started_s), "first_layer_s": marks["first_layer_s"],
            "backward_end_s": stats.backward_end_s}
    return {"zero2": zero, "dataparallel": data}


@pytest.mark.slow
def test_bucket_reductions_run_while_the_backward_computes():
    """Per rank and runtime: several buckets (one a layer) were reduced, and the first
    started before the first layer's backward began (so under the backward of the
    layers between), not after the backward."""
    for rank, result in enumerate(run_distributed(_timeline, 2)):
        for kind, times in result.items():
            assert len(times["started_s"]) >= LAYERS - 1, (rank, kind, times)
            assert times["started_s"][0] < times["first_layer_s"] < times["backward_end_s"], (rank, kind, times)
