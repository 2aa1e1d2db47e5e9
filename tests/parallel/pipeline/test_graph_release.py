"""A step leaves no micro-batch's graph behind: every stage output a step made is freed
when it returns, under every schedule, the split backward's retained graphs (zero bubble's
B and W) included. The engine's saved-tensor hook once returned a saved output as itself:
the output held its grad_fn, which held it (a cycle in C++ that no collector sees), and a
backward that retains the graph never broke it, so stage 1 leaked each micro-batch's whole
graph under zero bubble (RSS +36 MB a step in `plait bench pp`'s model; the fresh pages
were the anomaly's 10-20 ms of page faults)."""

import gc
import weakref

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from plait.parallel.pipeline import build
from plait.parallel.pipeline.engine import PipelineEngine
from plait.testing import run_distributed

WIDTH, MICROBATCHES = 8, 2


def alive_outputs(rank, world_size):
    """Per schedule: how many of this rank's stage outputs are still alive after 2 steps."""
    alive = {}
    for name in ("1f1b", "zero_bubble"):
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)]
        stage = nn.Sequential(*layers[2 * rank:2 * rank + 2])
        made: list = []
        stage.register_forward_hook(lambda module, args, out: made.append(weakref.ref(out)))
        engine = PipelineEngine(build(name, 2, MICROBATCHES), {rank: stage}, F.mse_loss, timeout_s=30)
        generator = torch.Generator().manual_seed(1)
        inputs, targets = (torch.randn(4, WIDTH, generator=generator) for _ in range(2))
        for _ in range(2):
            engine.train_step(inputs, targets, torch.optim.SGD(engine.parameters(), lr=0.1))
        gc.collect()
        alive[name] = (len(made), sum(ref() is not None for ref in made))
    return alive


@pytest.mark.slow
def test_a_step_frees_every_graph_it_made():
    for rank, alive in enumerate(run_distributed(alive_outputs, 2)):
        for name, (made, left) in alive.items():
            assert made == 2 * MICROBATCHES and left == 0, (rank, name, made, left)
