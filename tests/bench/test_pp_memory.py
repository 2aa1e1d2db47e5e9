"""`plait bench pp`'s measured activation memory comes from live storages
(plait.memory.saved_memory), not from the engine's bookkeeping: a unit check of the
meter on one process, then real pipelines whose model saves more or less for
backward under the same schedule.

Margin: 0 bytes. For these MLPs every saved storage lives from its stage's forward
to its backward, which is what the prediction assumes, so both are exact; a layer
whose saved tensor autograd frees at once (a dead branch) shows they are not the
same figure: the engine's bookkeeping counts it for the micro-batch's whole life,
the live storages for an instant (one micro-batch's tensor at most)."""

import pytest
import torch
from torch import nn

from plait.bench.pp import PpBenchConfig, _one_schedule
from plait.memory.saved_memory import SavedTensorMeter
from plait.testing import run_distributed

WIDTH, BATCH, M = 16, 8, 4


def test_the_meter_counts_distinct_live_storages_until_autograd_frees_them():
    meter = SavedTensorMeter()
    weight = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(BATCH, WIDTH)
    meter.reset(exclude=[weight, x])
    meter.enabled = True
    layer = meter.wrap(lambda inputs: torch.tanh(inputs @ weight))
    y = layer(x)  # matmul saves x (excluded) and weight (excluded); tanh saves its output
    assert meter.live_bytes == BATCH * WIDTH * 4
    z = layer(y)  # saves y again (same storage, counted once) and its own output
    assert meter.live_bytes == 2 * BATCH * WIDTH * 4
    z.sum().backward()  # the graph goes: every saved storage released
    assert meter.live_bytes == 0 and meter.peak_bytes == 2 * BATCH * WIDTH * 4


class Exp(nn.Module):
    """x -> exp(x): saves its output, one more activation per layer."""

    def forward(self, x):
        return torch.exp(x)


class DeadBranch(nn.Module):
    """x -> x, after an exp whose result nobody uses: autograd saves exp's output at
    the forward (the engine's hooks see it) and frees it as soon as the result is
    dropped (its graph is unreachable), so no storage stays alive for backward."""

    def forward(self, x):
        torch.exp(x)
        return x


def _layers(variant: str):
    torch.manual_seed(0)
    more = {"plain": [], "extra": [Exp()], "dead": [DeadBranch()]}[variant]
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), *more) for _ in range(4)]


def metered(rank, world_size, name, variant):
    config = PpBenchConfig(stages=(world_size,), schedules=(name,), microbatches=M, layers=4, width=WIDTH,
                           batch=BATCH, steps=1, warmup=0, timeout_s=60)
    row = _one_schedule(config, name, rank, world_size, layers=_layers(variant))
    return row["measured_bytes"], row["predicted_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "chimera"])
def test_measured_activation_memory_follows_the_model_and_matches_the_prediction(name):
    plain, extra, dead = (run_distributed(metered, 2, name, variant)[0] for variant in ("plain", "extra", "dead"))
    for measured, predicted in (plain, extra):
        assert all(value > 0 for value in measured)
        assert measured == predicted, (name, measured, predicted)
    # same schedule, a model that saves one more (b, width) float32 tensor per layer: more measured
    assert all(more > less for more, less in zip(extra[0], plain[0])), (plain, extra)
    # a tensor saved and freed at once: the engine's count (hence the prediction) grows, live storages do not
    # (plus, at most, the one exp output alive for the instant before it is dropped)
    transient = BATCH // M * WIDTH * 4
    assert all(less <= value <= less + transient for value, less in zip(dead[0], plain[0])), (dead, plain)
    assert all(predicted > measured for measured, predicted in zip(*dead)), dead
