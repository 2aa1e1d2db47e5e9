"""The hybrid trainer's dp gradient reduction runs during the backward
(``plait.parallel.data.grad_average``): on dp=2 x pp=2 with two micro-batches, a
bucket's all-reduce starts on the comm thread (``Handle.started_s``) after the last
micro-batch's backward of the stage began and before that backward reached the
stage's first layer (so under the backward of the layers after it, not after the
flush), and never during an earlier micro-batch's backward (gradient accumulation, as
DDP's no_sync); and every gradient and parameter stays bit-identical to the average
after the backward (``average_gradients``, the path the trainer took before)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from plait.names.axes import DP, PP
from plait.parallel.hybrid import average_gradients, build_hybrid, train_step
from plait.parallel.mesh import DeviceMesh, ParallelDims
from plait.parallel.pipeline.actions import BACKWARD
from plait.testing import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

# each weight (384^2 float64, 1.2 MB) passes DDP's 1 MiB first-bucket cap: a stage's first bucket is its
# last bias, launched as soon as the last layer's backward is done, the second bucket the rest
WIDTH, ROWS, LAYERS, MICROBATCHES, STEPS = 384, 128, 6, 2, 2


def _loss(output, target):
    return (output - target).square().mean()


def _build(mesh: DeviceMesh):
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(LAYERS)]
    model = nn.Sequential(*layers)
    hybrid = build_hybrid(model, layers, mesh, _loss, schedule="1f1b", microbatches=MICROBATCHES, timeout_s=60)
    first = min(index for index, layer in enumerate(layers) if any(p is q for p in layer.parameters()
                                                                       for q in hybrid.names.values()))
    marks: list[float] = []  # the start of each backward of this rank's first layer
    layers[first].register_full_backward_pre_hook(lambda _module, _grad: marks.append(time.perf_counter()))
    return hybrid, marks


def _batch(step: int, dp_rank: int):
    generator = torch.Generator().manual_seed(100 * step + dp_rank)
    rows = ROWS * MICROBATCHES
    return (torch.randn(rows, WIDTH, dtype=torch.float64, generator=generator),
            torch.randn(rows, WIDTH, dtype=torch.float64, generator=generator))


def _overlap_run(rank: int, world_size: int) -> dict:
    mesh = DeviceMesh.create(ParallelDims(dp=2, pp=2))
    overlapped, marks = _build(mesh)
    reference, _ = _build(mesh)
    optimizers = [torch.optim.SGD(list(hybrid.parameters()), lr=0.1) for hybrid in (overlapped, reference)]
    grads_equal, params_equal, timings = [], [], []
    for step in range(STEPS):
        inputs, targets = _batch(step, mesh.coords[DP])
        marks.clear()
        train_step(overlapped, inputs, targets, optimizers[0], step=step, reduce_loss=False)
        backwards = [interval for interval in overlapped.engine.history[-1].intervals if interval.kind == BACKWARD]
        timings.append({"started_s": [handle.started_s for handle in overlapped.grad_average.handles],
                        "first_layer_s": marks[-1], "last_backward_s": (backwards[-1].start_s, backwards[-1].end_s),
                        "earlier_backward_end_s": backwards[-2].end_s})
        # the path before the overlap: the whole backward, then one average after the flush
        reference.engine.train_step(inputs, targets, optimizer=None)
        average_gradients(reference, step)
        grads_equal.append(all(torch.equal(mine.grad, theirs.grad) for mine, theirs in
                               zip(overlapped.names.values(), reference.names.values())))
        optimizers[1].step()
        params_equal.append(all(torch.equal(mine, theirs) for mine, theirs in
                                zip(overlapped.names.values(), reference.names.values())))
    return {"pp_rank": mesh.coords[PP], "buckets": len(overlapped.grad_average.buckets), "timings": timings,
            "grads_equal": grads_equal, "params_equal": params_equal}


@pytest.mark.slow
def test_dp_buckets_reduce_during_the_last_microbatch_backward_and_stay_bitwise():
    for rank, result in enumerate(run_distributed(_overlap_run, 4, timeout_s=180)):
        assert result["grads_equal"] == [True] * STEPS and result["params_equal"] == [True] * STEPS, (rank, result)
        assert result["buckets"] == 2, (rank, result)
        timing = result["timings"][-1]  # the second step: the first set up the comm thread
        started = sorted(timing["started_s"])
        begin_s, end_s = timing["last_backward_s"]
        assert len(started) == 2, (rank, timing)
        # not before the last micro-batch's backward (accumulation), and before it reached the first layer
        assert timing["earlier_backward_end_s"] < begin_s < started[0] < timing["first_layer_s"] < end_s, \
            (rank, timing)
