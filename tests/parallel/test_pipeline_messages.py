"""The pipeline engine's messages (plait.parallel.pipeline.messages) on real gloo
processes: shapes agreed in the first step, payloads alone (the header after them)
from then on, a new batch shape announced and still trained right, a shape change
between micro-batches of a later step named with its stage and micro-batch, and a
rank that forgot the agreement refused by name instead of mis-read.

What is checked is which tags carry what (every isend the engine makes, recorded),
never how long anything takes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.comm import tags
from plait.parallel.pipeline import build
from plait.parallel.pipeline.engine import PipelineEngine
from plait.parallel.pipeline.messages import TAGS_PER_MESSAGE
from plait.testing import run_distributed, run_fresh_world
from tests.parallel.test_pipeline_engine import _error_text

WIDTH, CLASSES = 16, 5
PART = {0: "header", 1: "agreed payload", 2: "new payload"}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, CLASSES)).double()


def _batch(step, size):
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(size, WIDTH, dtype=torch.float64, generator=generator),
            torch.randint(0, CLASSES, (size,), generator=generator))


def _recording(sent: list):
    real = comm.isend

    def isend(tensor, *args, tag=0, **kwargs):
        if tag in tags.PIPELINE:
            sent.append((PART[(tag - tags.PIPELINE.start) % TAGS_PER_MESSAGE], tensor.numel()))
        return real(tensor, *args, tag=tag, **kwargs)
    return real, isend


def agreement(rank, world_size, batches):
    """1F1B over 2 ranks, one step per batch size in ``batches``: per step, the parts
    this rank sent in order, and the loss error against one process."""
    schedule = build("1f1b", world_size, 2)
    reference = _model()
    layers = list(_model())
    modules = {0: nn.Sequential(*layers[:2]), 1: nn.Sequential(*layers[2:])}
    engine = PipelineEngine(schedule, {rank: modules[rank]}, F.cross_entropy, timeout_s=30)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    steps, loss_error = [], 0.0
    for step, size in enumerate(batches):
        inputs, targets = _batch(step, size)
        sent: list = []
        real, recording = _recording(sent)
        comm.isend = recording
        try:
            loss = engine.train_step(inputs, targets, optimizer)
        finally:
            comm.isend = real
        steps.append(sent)
        reference_optimizer.zero_grad()
        want = F.cross_entropy(reference(inputs), targets)
        want.backward()
        reference_optimizer.step()
        loss_error = max(loss_error, abs(loss - want.item()))
    return steps, loss_error, {key: (str(dtype), shape) for key, (dtype, shape) in engine.messages.agreed.items()}


@pytest.mark.slow
def test_shapes_are_agreed_once_and_a_new_batch_shape_is_announced():
    (rank0, error0, agreed0), (rank1, error1, agreed1) = run_distributed(agreement, 2, [8, 8, 12, 12])
    assert error0 < 1e-10 and error1 < 1e-10
    activation, gradient = 4 * WIDTH, 4 * WIDTH  # a micro-batch of 4 rows, then of 6
    # first step: each message announces its spec, then the payload on the new-spec tag
    assert rank0[0] == [("header", 11), ("new payload", activation)] * 2
    assert rank1[0] == [("header", 11), ("new payload", gradient)] * 2
    # agreed: the payload alone on its tag, the header after it
    assert rank0[1] == [("agreed payload", activation), ("header", 11)] * 2
    assert rank1[1] == [("agreed payload", gradient), ("header", 11)] * 2
    # a new batch shape: the posted receive gets an empty filler, then the announcement
    assert rank0[2] == [("agreed payload", 0), ("header", 11), ("new payload", 6 * WIDTH)] * 2
    assert rank1[2] == [("agreed payload", 0), ("header", 11), ("new payload", 6 * WIDTH)] * 2
    assert rank0[3] == [("agreed payload", 6 * WIDTH), ("header", 11)] * 2
    assert rank1[3] == [("agreed payload", 6 * WIDTH), ("header", 11)] * 2
    # both ranks agree on both streams: (kind, stage, sender, receiver) -> spec
    assert agreed0 == agreed1 == {(0, 0, 0, 1): ("torch.float64", (6, WIDTH)),
                                  (1, 1, 1, 0): ("torch.float64", (6, WIDTH))}


class LateShrinking(nn.Module):
    """Full width for the first three calls, one column fewer from the fourth: with
    GPipe over 2 micro-batches, micro-batch 1 of the second step changes shape."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.linear = nn.Linear(WIDTH, WIDTH).double()

    def forward(self, x):
        self.calls += 1
        return self.linear(x)[:, : WIDTH - (self.calls > 3)]


def late_shape_change(rank, world_size):
    schedule = build("gpipe", 2, 2)
    module = LateShrinking() if rank == 0 else nn.Sequential(nn.Linear(WIDTH, CLASSES)).double()
    engine = PipelineEngine(schedule, {rank: module}, F.cross_entropy, timeout_s=20)
    inputs, targets = _batch(0, 4)
    first = _error_text(lambda: engine.train_step(inputs, targets))
    return first, _error_text(lambda: engine.train_step(inputs, targets))


@pytest.mark.slow
def test_a_shape_change_between_microbatches_of_a_later_step_is_named_and_aborts_the_peer():
    (first0, second0), (first1, second1) = run_fresh_world(late_shape_change, 2, timeout_s=90)
    assert first0 is None and first1 is None  # the first step agrees (2, 16)
    assert second0 == ("ValueError: stage 0 output shape changed between micro-batches: (2, 16) for micro-batch 0, "
                       "(2, 15) for micro-batch 1; every micro-batch must give the same shape")
    assert second1 == ("PipelineError: rank 1 (stage 1) waited for the activation of micro-batch 1 from rank 0 "
                       "(stage 0): that rank failed (see its error) and aborted the step")


def forgetful_sender(rank, world_size):
    schedule = build("gpipe", 2, 2)
    layers = list(_model())
    modules = {0: nn.Sequential(*layers[:2]), 1: nn.Sequential(*layers[2:])}
    engine = PipelineEngine(schedule, {rank: modules[rank]}, F.cross_entropy, timeout_s=20)
    inputs, targets = _batch(0, 4)
    engine.train_step(inputs, targets)
    if rank == 0:
        engine.messages.forget()  # as after a failure only this rank saw
    return _error_text(lambda: engine.train_step(inputs, targets))


@pytest.mark.slow
def test_a_receiver_expecting_a_spec_its_sender_forgot_refuses_by_name():
    first, second = run_fresh_world(forgetful_sender, 2, timeout_s=90)
    assert second == ("PipelineError: rank 1 (stage 1) waited for the activation of micro-batch 0 from rank 0 "
                      "(stage 0): this rank expected the (torch.float64, (2, 16)) agreed earlier, the sender agrees "
                      "afresh after a failed step: rebuild the engines on every rank after a PipelineError")
    assert first == ("PipelineError: rank 0 (stage 0) waited for the gradient of micro-batch 0 from rank 1 "
                     "(stage 1): that rank failed (see its error) and aborted the step")


class Keeping(nn.Module):
    """Keeps every input it is given (as a user's hook might), with a copy of its values."""

    def __init__(self, module):
        super().__init__()
        self.module, self.kept = module, []

    def forward(self, x):
        self.kept.append((x, x.detach().clone()))
        return self.module(x)


def pooled_receives(rank, world_size):
    """GPipe over 2 ranks and 2 micro-batches, 3 steps: rank 1's stage keeps the inputs
    it received. Returns whether every kept input still holds its values, how many
    pooled buffers rank 1 made, and the losses."""
    schedule = build("gpipe", 2, 2)
    layers = list(_model())
    modules = {0: nn.Sequential(*layers[:2]), 1: Keeping(nn.Sequential(*layers[2:]))}
    engine = PipelineEngine(schedule, {rank: modules[rank]}, F.cross_entropy, timeout_s=30)
    losses = [engine.train_step(*_batch(step, 4)) for step in range(3)]
    kept = modules[1].kept if rank == 1 else []
    intact = all(torch.equal(tensor.detach(), values) for tensor, values in kept)
    storages = {tensor.untyped_storage().data_ptr() for tensor, _ in kept}
    pooled = sum(len(buffers) for buffers in engine.messages._pool.values())
    del kept
    modules[1].kept = []  # nothing holds the received inputs now: the next step reuses the pool
    losses.append(engine.train_step(*_batch(3, 4)))
    reused = sum(len(buffers) for buffers in engine.messages._pool.values()) == pooled
    return intact, len(storages), pooled, reused, losses


@pytest.mark.slow
def test_received_buffers_are_reused_only_when_no_one_holds_them():
    (_, _, _, _, losses0), (intact, storages, pooled, reused, losses1) = run_distributed(pooled_receives, 2)
    assert losses0 == losses1
    # step 0 announces the spec (fresh tensors); steps 1 and 2 receive into pooled buffers, and the inputs
    # the stage kept from step 1 are never overwritten by step 2: four distinct storages, all intact
    assert intact and storages == 2 * 3 and pooled == 4
    assert reused  # once released, step 3 receives into the same buffers (no new ones)
