"""ZeRO stage 1's reduce-scatters run while the backward computes (plait.parallel.zero.
speculative), and change no bit of the result: on 2 ranks, the comm thread's start time of
each bucket's reduce-scatter (``Handle.started_s``) against a hook at the first layer's
backward; and the parameters after steps that use the overlapped results, and steps
that must not (a second backward before the step, a gradient scaled in place, a
gradient one rank dropped, a clip), equal a wrapper reducing at the step only."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from plait.parallel.zero.module import ZeRO
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


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _timeline(inputs: torch.Tensor) -> dict:
    model, marks = _model()
    zero = ZeRO(model, _sgd, stage=1, bucket_mb=LAYER_MB)
    for _ in range(2):  # the second step is timed: the first sets up the communicator and its comm thread
        marks.clear()
        zero(inputs).square().mean().backward()
        backward_end_s = time.perf_counter()
        issued = dict(zero.engine.speculative._issued)  # noqa: SLF001 - the calls the backward issued
        zero.step()  # waits for them: every handle has its start time now
        zero.zero_grad()
    return {"started_s": sorted(entry[3].started_s for entry, _grads, _versions in issued.values()),
            "units": len(zero.units), "first_layer_s": marks["first_layer_s"], "backward_end_s": backward_end_s}


def _steps(zero: ZeRO, inputs: torch.Tensor, rank: int) -> None:
    """Four steps: plain; two backwards before the step; a gradient scaled in place and one
    dropped on rank 0 only; torch's clip."""
    params = list(zero.module.parameters())
    for step in range(4):
        zero(inputs[step::4]).square().mean().backward()
        if step == 1:
            zero(inputs[1::3]).square().mean().backward()
        if step == 2:
            params[3].grad.mul_(0.5)
            if rank == 0:
                params[5].grad = None
        if step == 3:
            torch.nn.utils.clip_grad_norm_(zero.parameters(), 1e-3)
        zero.step()
        zero.zero_grad()


def _exactness(inputs: torch.Tensor, rank: int) -> dict:
    results = {}
    for overlapped in (True, False):
        model, _marks = _model()
        zero = ZeRO(model, _sgd, stage=1, bucket_mb=LAYER_MB)
        if not overlapped:
            zero.engine.speculative = None  # every unit reduce-scattered at the step, as before the overlap
        _steps(zero, inputs, rank)
        results[overlapped] = [param.detach().clone() for param in model.parameters()]
    return {"same": all(torch.equal(a, b) for a, b in zip(results[True], results[False])),
            "moved": not torch.equal(results[True][0], _model()[0][0].weight.detach())}


def _run(rank: int, world_size: int) -> dict:
    inputs = torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    return {"timeline": _timeline(inputs), **_exactness(inputs, rank)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, 2)


@pytest.mark.slow
def test_stage_one_reduce_scatters_run_while_the_backward_computes(results):
    """Per rank: every bucket's reduce-scatter was issued by the backward, and the first
    started before the first layer's backward began (under the backward of the layers
    between), not after the backward."""
    for rank, result in enumerate(results):
        times = result["timeline"]
        assert len(times["started_s"]) == times["units"] >= LAYERS - 1, (rank, times)
        assert times["started_s"][0] < times["first_layer_s"] < times["backward_end_s"], (rank, times)


@pytest.mark.slow
def test_stage_one_overlap_changes_no_bit(results):
    """The parameters after the four steps equal, bit for bit, those of a wrapper that
    reduce-scatters every unit at the step."""
    for rank, result in enumerate(results):
        assert result["moved"], rank
        assert result["same"], rank
