"""PipelineEngine on real gloo processes against one process training the whole
model on the whole batch (DESIGN.md section 4: numerical parity).

Why 1e-10 (float64): the pipeline computes each micro-batch's loss / m and sums the
m gradient contributions, where one process averages over the whole batch at
once: the same per-sample terms, added in a different order, so they differ by a
few ulps (u = 1.1e-16) of the gradient, compounded over a few SGD steps.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.parallel.pipeline import build
from plait.parallel.pipeline.engine import PipelineEngine, PipelineError, gather_timeline
from plait.testing import run_distributed, run_fresh_world

FEATURES, CLASSES, LAYERS = 12, 5, 8  # 8 Linear+Tanh pairs: 16 layers, enough for 4 ranks x 2 chunks


def _model():
    torch.manual_seed(0)
    layers = []
    for index in range(LAYERS):
        layers += [nn.Linear(FEATURES if index == 0 else 16, 16 if index < LAYERS - 1 else CLASSES), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()  # 15 layers, ending with the classifier


def _batch(step, size):
    generator = torch.Generator().manual_seed(100 + step)
    return (torch.randn(size, FEATURES, dtype=torch.float64, generator=generator),
            torch.randint(0, CLASSES, (size,), generator=generator))


def _chunks(model, stages):
    """Consecutive layers, as even as possible (earlier chunks one longer)."""
    layers = list(model)
    bounds = [round(index * len(layers) / stages) for index in range(stages + 1)]
    return [nn.Sequential(*layers[bounds[c]:bounds[c + 1]]) for c in range(stages)]


class Heaviside(nn.Module):
    """x -> 1[x > 0]: no gradient flows through it."""

    def forward(self, x):
        return (x > 0).to(x.dtype)


def train_pipelined(rank, world_size, name, microbatches, virtual, steps, batch, variant=None):
    """``variant``: "frozen" freezes the first chunk's layers (its output needs no
    gradient); "heaviside" puts a gradient-blocking layer at the start of the last
    chunk (the gradient sent upstream is zero)."""
    schedule = build(name, world_size, microbatches, virtual)
    reference = _model()
    if variant == "frozen":
        for param in _chunks(reference, schedule.stages)[0].parameters():
            param.requires_grad_(False)
    if variant == "heaviside":
        layers = list(reference)
        start = round((schedule.stages - 1) * len(layers) / schedule.stages)
        reference = nn.Sequential(*layers[:start], Heaviside(), *layers[start:])
    chunks = _chunks(copy.deepcopy(reference), schedule.stages)
    engine = PipelineEngine(schedule, {s: chunks[s] for _, s in schedule.stages_of(rank)}, F.cross_entropy,
                            timeout_s=60)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    loss_error = 0.0
    for step in range(steps):
        inputs, targets = _batch(step, batch)
        loss = engine.train_step(inputs, targets, optimizer)
        reference_optimizer.zero_grad()
        want = F.cross_entropy(reference(inputs), targets)
        want.backward()
        reference_optimizer.step()
        loss_error = max(loss_error, abs(loss - want.item()))
    full_chunks = _chunks(reference, schedule.stages)
    if variant == "frozen":
        assert all(param.grad is None for param in engine.stages.get(0, nn.Sequential()).parameters())
    param_error = max((mine - theirs).abs().max().item()
                      for _, s in schedule.stages_of(rank)
                      for mine, theirs in zip(engine.stages[s].parameters(), full_chunks[s].parameters()))
    timeline = gather_timeline(engine)
    return loss_error, param_error, len(timeline.intervals), engine.history[-1].peak_activation_bytes


CASES = [("gpipe", 2, 4, None), ("gpipe", 3, 3, None), ("gpipe", 4, 8, None),
         ("1f1b", 2, 4, None), ("1f1b", 3, 5, None), ("1f1b", 4, 8, None),
         ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 3, 6, 2), ("interleaved_1f1b", 4, 8, 2),
         ("chimera", 2, 4, None), ("chimera", 4, 8, None),
         ("zero_bubble", 2, 4, None), ("zero_bubble", 3, 5, None), ("zero_bubble", 4, 8, None)]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["frozen", "heaviside"])
def test_frozen_and_gradient_blocking_stages(variant):
    for loss_error, param_error, _, _ in run_distributed(train_pipelined, 2, "1f1b", 4, None, 2, 16, variant):
        assert loss_error < 1e-10 and param_error < 1e-10, (loss_error, param_error)


@pytest.mark.slow
@pytest.mark.parametrize("name,world_size,microbatches,virtual", CASES)
def test_pipeline_matches_one_process(name, world_size, microbatches, virtual):
    batch = 4 * microbatches
    for loss_error, param_error, intervals, peak in run_distributed(
            train_pipelined, world_size, name, microbatches, virtual, 3, batch):
        assert loss_error < 1e-10 and param_error < 1e-10, (loss_error, param_error)
        stages = world_size * (virtual or 1)
        per = 3 if name == "zero_bubble" else 2  # F, B (and W when the backward is split)
        assert intervals == per * microbatches * stages  # every computation of every stage, once
        assert peak > 0


# ----- failures -------------------------------------------------------------------------
def _error_text(call):
    try:
        call()
    except (ValueError, PipelineError) as error:
        return f"{type(error).__name__}: {error}"
    return None


class Shrinking(nn.Module):
    """Returns one column fewer on every call: the output shape changes between micro-batches."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.linear = nn.Linear(FEATURES, 16).double()

    def forward(self, x):
        self.calls += 1
        return self.linear(x)[:, : 16 - self.calls + 1]


def shape_change(rank, world_size):
    schedule = build("gpipe", 2, 2)
    module = Shrinking() if rank == 0 else nn.Sequential(nn.Linear(16, CLASSES)).double()
    engine = PipelineEngine(schedule, {rank: module}, F.cross_entropy, timeout_s=20)
    inputs, targets = _batch(0, 4)
    return _error_text(lambda: engine.train_step(inputs, targets))


def test_shape_change_between_microbatches_is_named_and_aborts_the_peer():
    first, second = run_fresh_world(shape_change, 2, timeout_s=60)
    assert first == ("ValueError: stage 0 output shape changed between micro-batches: (2, 16) for micro-batch 0, "
                     "(2, 15) for micro-batch 1; every micro-batch must give the same shape")
    assert second == ("PipelineError: rank 1 (stage 1) waited for the activation of micro-batch 1 from rank 0 "
                      "(stage 0): that rank failed (see its error) and aborted the step")


class Pair(nn.Module):
    """Returns (activation, extra): a tuple, not one tensor (or a dict when ``as_dict``)."""

    def __init__(self, as_dict=False):
        super().__init__()
        self.as_dict = as_dict
        self.linear = nn.Linear(FEATURES, 16).double()

    def forward(self, x):
        y = self.linear(x)
        return {"hidden": y, "extra": y.sum()} if self.as_dict else (y, y.sum())


def multiple_outputs(rank, world_size, as_dict):
    schedule = build("gpipe", 2, 2)
    module = Pair(as_dict) if rank == 0 else nn.Sequential(nn.Linear(16, CLASSES)).double()
    engine = PipelineEngine(schedule, {rank: module}, F.cross_entropy, timeout_s=20)
    inputs, targets = _batch(0, 4)
    try:
        engine.train_step(inputs, targets)
    except (TypeError, PipelineError) as error:
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_stage_returning_a_tuple_or_dict_is_refused_naming_the_stage_and_type(as_dict):
    """A dict is refused where it is made; a tuple of tensors travels (a split model's
    multi-tensor boundary) and a next stage that cannot take its parts is named."""
    first, second = run_fresh_world(multiple_outputs, 2, as_dict, timeout_s=60)
    if as_dict:
        assert first == ("TypeError: stage 0 (Pair) returned a dict for micro-batch 0: a pipeline stage before the "
                         "last must return a tensor or a tuple of tensors, the activation stage 1 receives; return "
                         "those (e.g. keep the first element, or move the extra outputs into a later stage)")
        assert second == ("PipelineError: rank 1 (stage 1) waited for the activation of micro-batch 0 from rank 0 "
                          "(stage 0): that rank failed (see its error) and aborted the step")
    else:
        assert second.startswith("TypeError: stage 1 (Sequential) cannot take the 2 tensors the stage before "
                                 "returned (")
        assert first == ("PipelineError: rank 0 (stage 0) waited for the gradient of micro-batch 0 from rank 1 "
                         "(stage 1): that rank failed (see its error) and aborted the step")


def dying_rank(rank, world_size):
    import torch.distributed as dist

    schedule = build("1f1b", 2, 4)
    chunks = _chunks(_model(), 2)
    engine = PipelineEngine(schedule, {rank: chunks[rank]}, F.cross_entropy, timeout_s=3)
    if rank == 1:
        dist.destroy_process_group()  # this stage is gone before the step
        return None
    inputs, targets = _batch(0, 8)
    return _error_text(lambda: engine.train_step(inputs, targets))


def test_a_dead_stage_is_named_by_its_neighbour():
    message, _ = run_fresh_world(dying_rank, 2, timeout_s=60)
    # depending on when the closed connection is noticed: at the first send, or at the
    # first receive; either way the stage, the action and the lost peer are named
    assert (message.startswith("PipelineError: rank 0 (stage 0) waited for the gradient of micro-batch 0 from rank 1 "
                               "(stage 1): ")
            or message.startswith("PipelineError: rank 0 (stage 0) could not send the activation of micro-batch 0 to "
                                  "rank 1: ")), message


def wrong_setup(rank, world_size):
    schedule = build("1f1b", 2, 4)
    chunks = _chunks(_model(), 2)
    messages = {"modules": _error_text(lambda: PipelineEngine(schedule, {0: chunks[0], 1: chunks[1]},
                                                              F.cross_entropy))}
    engine = PipelineEngine(schedule, {rank: chunks[rank]}, F.cross_entropy, timeout_s=20)
    inputs, targets = _batch(0, 6)
    messages["batch"] = _error_text(lambda: engine.train_step(inputs, targets))
    messages["world"] = _error_text(lambda: PipelineEngine(build("1f1b", 3, 3), {rank: chunks[rank]},
                                                           F.cross_entropy))
    return messages


def test_setup_errors_are_named():
    for rank, messages in enumerate(run_distributed(wrong_setup, 2)):
        assert messages["modules"] == f"ValueError: rank {rank} holds stages [{rank}] in 1f1b, got modules for [0, 1]"
        assert messages["batch"] == ("ValueError: the batch of 6 does not split into 4 equal micro-batches: "
                                     "use a batch size that is a multiple of 4")
        assert messages["world"] == "ValueError: schedule 1f1b is for 3 pipeline ranks, the group has 2"


# ----- the GPT, pipelined ------------------------------------------------------------------
def train_gpt_pipelined(rank, world_size, name, microbatches):
    from plait.models import GPT, GPTConfig
    from plait.parallel.pipeline.partition import build_stage, sequential_layers, split_layers

    config = GPTConfig(layers=3, hidden=32, heads=4, seq_len=8, vocab=29, tied_head=False, dtype="float64")
    reference, pipelined = GPT(config, seed=2), GPT(config, seed=2)
    layers = sequential_layers(pipelined)  # embedding, 3 blocks, head
    schedule = build(name, world_size, microbatches)
    chunks = split_layers(layers, schedule.stages)
    modules = {s: build_stage(layers, chunks[s]) for _, s in schedule.stages_of(rank)}

    def loss_fn(logits, targets):  # logits (b, s, V)
        return F.cross_entropy(logits.reshape(-1, config.vocab), targets.reshape(-1))

    engine = PipelineEngine(schedule, modules, loss_fn, timeout_s=60)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_error = 0.0
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, config.vocab, (2 * microbatches, 9), generator=generator)
        loss = engine.train_step(tokens[:, :-1], tokens[:, 1:], optimizer)
        reference_optimizer.zero_grad()
        want = reference.loss(tokens[:, :-1], tokens[:, 1:])
        want.backward()
        reference_optimizer.step()
        loss_error = max(loss_error, abs(loss - want.item()))
    mine = {name for module in modules.values() for name, _ in module.named_parameters()}
    reference_state, pipelined_state = reference.state_dict(), pipelined.state_dict()
    param_error = max((pipelined_state[name] - reference_state[name]).abs().max().item()
                      for name in reference_state if any(
                          param is pipelined_state[name] or param.data_ptr() == pipelined_state[name].data_ptr()
                          for module in modules.values() for param in module.parameters()))
    return loss_error, param_error, len(mine)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpt_pipelined_matches_one_process(name):
    for loss_error, param_error, held in run_distributed(train_gpt_pipelined, 2, name, 4):
        assert held > 0
        assert loss_error < 1e-10 and param_error < 1e-10, (loss_error, param_error)


def shared_parameters(rank, world_size):
    shared = nn.Linear(4, 4).double()
    engine = PipelineEngine(build("interleaved_1f1b", 1, 2, 2), {0: nn.Sequential(shared), 1: nn.Sequential(shared)},
                            F.mse_loss)
    return len(list(engine.parameters()))


def test_a_parameter_shared_by_two_chunks_is_listed_once():
    assert run_distributed(shared_parameters, 1) == [2]  # weight and bias, not four tensors


class Stalling(nn.Module):
    """Stage 1 hangs in its first forward for longer than its neighbour's deadline."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        import time
        time.sleep(6)
        return self.inner(x)


def hung_stage(rank, world_size):
    schedule = build("1f1b", 2, 4)
    chunks = _chunks(_model(), 2)
    module = chunks[0] if rank == 0 else Stalling(chunks[1])
    engine = PipelineEngine(schedule, {rank: module}, F.cross_entropy, timeout_s=2)
    inputs, targets = _batch(0, 8)
    return _error_text(lambda: engine.train_step(inputs, targets))


def test_a_hung_stage_times_out_naming_the_stage_and_the_action():
    first, second = run_fresh_world(hung_stage, 2, timeout_s=90)
    assert first.startswith("PipelineError: rank 0 (stage 0) waited for the gradient of micro-batch 0 from rank 1 "
                            "(stage 1): "), first
    assert "timed out" in first or "Timeout" in first, first
    assert second is not None and second.startswith("PipelineError: rank 1 (stage 1)"), second


# ----- a weight shared by the first and last stage (tied embedding and head) ----------------
# Hugging Face GPT-2 style: the output head multiplies by the embedding matrix. The first
# stage and the last each hold that one weight; only the sum of both stages' gradients is
# the model's gradient. Tolerance 1e-10 in float64, as above: the same terms summed in
# another order (per micro-batch, then over the holders), a few ulps over a few steps;
# a missing sum is off by the whole of one stage's gradient, ~1e-2 here.
VOCAB, WIDTH, TIED_STEPS = 11, 8, 4


class TiedEmbedding(nn.Module):
    """tokens (b, s) -> (b, s, h): the embedding rows."""

    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, tokens):
        return self.embedding(tokens)


class TiedHead(nn.Module):
    """(b, s, h) -> logits (b, s, V) = x Eᵀ with the embedding's own weight E (V, h)."""

    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, x):
        return x @ self.embedding.weight.t()


def _tied_model():
    torch.manual_seed(3)
    embedding = nn.Embedding(VOCAB, WIDTH)
    layers = [TiedEmbedding(embedding)]
    for _ in range(3):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, TiedHead(embedding)).double()  # 8 layers, one weight at both ends


def _tied_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def train_tied(rank, world_size, name, microbatches, virtual, find_shared=True):
    schedule = build(name, world_size, microbatches, virtual)
    reference, pipelined = _tied_model(), _tied_model()
    chunks = _chunks(pipelined, schedule.stages)
    engine = PipelineEngine(schedule, {s: chunks[s] for _, s in schedule.stages_of(rank)}, _tied_loss,
                            timeout_s=60, model=pipelined if find_shared else None, tied=None if find_shared else ())
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.5, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    loss_error, steps = 0.0, 0
    for step in range(TIED_STEPS):
        tokens = torch.randint(0, VOCAB, (2 * microbatches, 7), generator=torch.Generator().manual_seed(step))
        loss = engine.train_step(tokens[:, :-1], tokens[:, 1:], optimizer)
        reference_optimizer.zero_grad()
        want = _tied_loss(reference(tokens[:, :-1]), tokens[:, 1:])
        want.backward()
        reference_optimizer.step()
        loss_error = max(loss_error, abs(loss - want.item()))
        steps += 1
    held = {id(param) for param in engine.parameters()}
    theirs = dict(reference.named_parameters())
    param_error = max((param - theirs[key]).abs().max().item()
                      for key, param in pipelined.named_parameters() if id(param) in held)
    return steps, loss_error, param_error, engine.shared_parameters


TIED_CASES = [("1f1b", 2, 4, None), ("1f1b", 3, 3, None), ("gpipe", 3, 3, None), ("interleaved_1f1b", 2, 4, 2),
              ("chimera", 2, 4, None), ("zero_bubble", 2, 4, None)]


@pytest.mark.slow
@pytest.mark.parametrize("name,world_size,microbatches,virtual", TIED_CASES)
def test_tied_embedding_and_head_train_as_one_process(name, world_size, microbatches, virtual):
    results = run_distributed(train_tied, world_size, name, microbatches, virtual)
    for rank, (steps, loss_error, param_error, shared) in enumerate(results):
        assert steps == TIED_STEPS
        assert loss_error < 1e-10 and param_error < 1e-10, (rank, loss_error, param_error)
        if name == "chimera":  # both replicas of both ends live on ranks 0 and 1: the replica exchange sums it
            assert shared == {}
        else:
            assert shared == {"0.embedding.weight": (0, world_size - 1)}


@pytest.mark.slow
def test_tied_weight_without_the_model_trains_wrong():
    """Declared independent (tied=(), no model=), each end steps its own part: the check above can fail."""
    results = run_distributed(train_tied, 2, "1f1b", 4, None, False)
    assert max(param_error for _, _, param_error, _ in results) > 1e-4


def moved_stage_device(rank, world_size):
    """The engine follows its stage to another device (the GPU run found it stayed on
    the CPU: no autocast on the GPU, activations received into host memory). "meta"
    stands in for a GPU on a machine without one."""
    engine = PipelineEngine(build("gpipe", 1, 1), {0: nn.Linear(4, 4)}, F.cross_entropy, timeout_s=20)
    before = engine.device.type
    for stage in engine.stages.values():
        stage.to("meta")
    engine.parameters_moved()
    return before, engine.device.type


def test_the_engine_follows_its_parameters_to_their_device():
    assert run_distributed(moved_stage_device, 1) == [("cpu", "meta")]
