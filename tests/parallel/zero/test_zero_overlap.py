"""ZeRO's communication runs while the model computes, and changes no bit of the result,
on 2 ranks, timed by the comm thread's start of each call (``Handle.started_s``) against
hooks on the layers:

- stage 1 (plait.parallel.zero.speculative): each bucket's reduce-scatter starts before
  the first layer's backward; the parameters after steps that use the overlapped results,
  and steps that must not (a second backward before the step, a gradient scaled in place,
  a gradient one rank dropped, a clip), equal a wrapper reducing at the step only;
- stage 3 (plait.parallel.zero.unit_gathering): layer j's gather starts before layer j-1's
  forward ends (before layer j+1's backward ends, in the backward), and layer j's
  reduce-scatter before layer j-1's backward ends; the last layer is gathered once a step
  (its backward follows its forward): the all-gather bytes of a step are counted."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from plait import comm
from plait.parallel.zero.module import ZeRO
from plait.testing import run_distributed

# the first layer's input needs no gradient: torch says its full backward hook fires on the output's gradient,
# which is when that layer's backward begins (what the test times)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

WIDTH, ROWS, LAYERS = 96, 4096, 6  # a layer's backward: two 4096x96x96 float64 GEMMs, milliseconds each
LAYER_MB = (WIDTH * WIDTH + WIDTH) * 8 / (1 << 20)  # one layer's gradients: one bucket each
HOLD_S = 0.02  # each timed layer's forward and backward held this much longer: on a loaded host the comm
# thread may wait for a core longer than a GEMM takes; holding the layer (a sleep frees the core) keeps the
# compute window the test times open, not its order


def _hold(model: nn.Sequential) -> None:
    """Every layer's forward (after the hooks registered before this) and backward held HOLD_S."""
    for layer in model:
        layer.register_forward_pre_hook(lambda *_: time.sleep(HOLD_S))
        layer.register_full_backward_hook(lambda *_: time.sleep(HOLD_S))


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
    _hold(model)
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


def _stage3_timeline(inputs: torch.Tensor) -> dict:
    model, _marks = _model()
    zero = ZeRO(model, _sgd, stage=3)
    _hold(model)  # after ZeRO's hooks (its gathers and prefetches come first), before the marks
    marks: dict = {}
    for index, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda *_, index=index: marks.__setitem__(("forward_start", index),
                                                                                  time.perf_counter()), prepend=True)
        layer.register_forward_hook(lambda *_, index=index: marks.__setitem__(("forward_end", index),
                                                                              time.perf_counter()), prepend=True)
        layer.register_full_backward_hook(lambda *_, index=index: marks.__setitem__(("backward_end", index),
                                                                                    time.perf_counter()))
    for _ in range(2):  # the second step is timed (and prefetches in the first one's order)
        comm.reset_stats()
        zero(inputs).square().mean().backward()
        zero.step()
        zero.zero_grad()
    index_of = {unit.index: zero._unit_modules[unit.index] for unit in zero.units}  # noqa: SLF001
    layer_of = {unit_index: next(i for i, layer in enumerate(model) if layer is module)
                for unit_index, module in index_of.items() if module is not model}
    return {"marks": marks, "prefetched": [(index, direction, handle.started_s)
                                           for index, direction, handle in zero.engine.gatherer.prefetched],
            "reduced": [([layer_of[i] for i in indices], handle.started_s) for indices, handle in zero.engine.reductions],
            "all_gather_bytes": comm.stats()["all_gather"]["bytes_sent"],
            "unit_bytes": [unit.padded * 8 for unit in zero.units]}


def _run(rank: int, world_size: int) -> dict:
    inputs = torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    return {"timeline": _timeline(inputs), **_exactness(inputs, rank), "stage3": _stage3_timeline(inputs)}


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


@pytest.mark.slow
def test_stage_three_gathers_and_reduce_scatters_run_while_layers_compute(results):
    """Per rank, the second step: every layer after the first was prefetched in the forward,
    its gather started before the previous layer's forward ended; every layer but the
    last was prefetched in the backward, its gather started before the next layer's
    backward ended; each layer's reduce-scatter (but the first's) started before the
    previous layer's backward ended. The last layer was not freed after its forward: one
    gather a step for it, two for every other layer, (N-1)/N of its bytes each."""
    for rank, result in enumerate(results):
        times = result["stage3"]
        marks = times["marks"]
        forward = {index: started_s for index, direction, started_s in times["prefetched"] if direction == "forward"}
        backward = {index: started_s for index, direction, started_s in times["prefetched"] if direction == "backward"}
        assert sorted(forward) == list(range(1, LAYERS)), (rank, times["prefetched"])
        assert sorted(backward) == list(range(LAYERS - 1)), (rank, times["prefetched"])
        for index, started_s in forward.items():
            assert started_s < marks[("forward_end", index - 1)], (rank, index, started_s, marks)
        for index, started_s in backward.items():
            assert started_s < marks[("backward_end", index + 1)], (rank, index, started_s, marks)
        reduced = {layers[0]: started_s for layers, started_s in times["reduced"]}
        assert sorted(reduced) == list(range(LAYERS)), (rank, times["reduced"])
        for index in range(1, LAYERS):
            assert reduced[index] < marks[("backward_end", index - 1)], (rank, index, reduced, marks)
        layer_bytes = times["unit_bytes"][0]  # every layer's unit is the same size; no root unit here
        assert len(times["unit_bytes"]) == LAYERS
        assert times["all_gather_bytes"] == (2 * LAYERS - 1) * layer_bytes // 2
