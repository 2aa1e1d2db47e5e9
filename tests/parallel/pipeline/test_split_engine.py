"""An automatically split HF model trains under every schedule exactly as one process
(issue 34, item 2): ``split(model, ids, stages=...)`` cuts HF GPT-2 (tied wte / lm_head:
the engine pairs the tie by its model name, ``model=``, or as the split declares it,
``tied=pieces.tied``) and the Llama-style model (its
boundaries carry the hidden states with position ids and rotary cos/sin: tuples) and
``PipelineEngine`` trains the stages with GPipe, 1F1B, interleaved 1F1B (2 ranks x 2
chunks) and zero bubble; the loss is HF's causal-LM loss (``causal_lm_loss``, labels =
the inputs, shifted inside).

Tolerance 1e-10 absolute (float64), as tests/parallel/test_pipeline_engine.py: the
pipeline sums m per-micro-batch gradients (and the tied weight's two stage halves over
the ranks) where one process sums the whole batch at once, the same terms in another
order: a few ulps (u = 1.1e-16) of O(1) values over 2 SGD steps with momentum. A missing
tie sum or a dropped boundary gradient is off by a stage's share: > 1e-4 here.
"""

import pytest
import torch

from plait.parallel.pipeline import build, split
from plait.parallel.pipeline.engine import PipelineEngine
from plait.parallel.pipeline.graph_split import causal_lm_loss
from plait.testing import run_distributed
from tests.hf_models import tiny_gpt2, tiny_llama

VOCAB, SEQ, MICROBATCHES, MICRO, STEPS = 64, 8, 4, 2, 2
SCHEDULES = (("gpipe", None), ("1f1b", None), ("interleaved_1f1b", 2), ("zero_bubble", None))
MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}
BY_TIED = ("gpipe", "interleaved_1f1b")  # these declare the split's ties; the others pass model=


def _batch(step):
    return torch.randint(0, VOCAB, (MICRO * MICROBATCHES, SEQ), generator=torch.Generator().manual_seed(10 + step))


def _train(rank, model_name, schedule_name, virtual):
    """STEPS SGD steps of the split model on 2 ranks and of the whole model in one
    process: (max loss error, max gradient error, max parameter error, shared names)."""
    schedule = build(schedule_name, 2, MICROBATCHES, virtual)
    reference, model = MODELS[model_name](0, VOCAB), MODELS[model_name](0, VOCAB)
    pieces = split(model, _batch(0)[:MICRO], stages=schedule.stages, kwargs={"use_cache": False})
    # the tie found by its model name (model=), or declared from the split (tied=, what a stage converted
    # after the split, e.g. by a tensor-parallel plan, still gives)
    declared = dict(tied=pieces.tied) if schedule_name in BY_TIED else dict(model=model)
    engine = PipelineEngine(schedule, pieces.stage_modules(schedule, rank), causal_lm_loss, timeout_s=60, **declared)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.5, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    loss_error = grad_error = 0.0
    theirs = dict(reference.named_parameters())
    names = {id(param): name for name, param in model.named_parameters()}
    for step in range(STEPS):
        ids = _batch(step)
        loss = engine.train_step(ids, ids, optimizer)
        reference_optimizer.zero_grad()
        # HF's loss of the whole batch, in float64 (HF's own upcasts to float32: see test_split.py)
        want = causal_lm_loss(reference(ids, use_cache=False).logits, ids)
        want.backward()
        grad_error = max([grad_error] + [(param.grad - theirs[names[id(param)]].grad).abs().max().item()
                                         for param in engine.parameters()])
        reference_optimizer.step()
        loss_error = max(loss_error, abs(loss - want.item()))
    param_error = max((param - theirs[names[id(param)]]).abs().max().item() for param in engine.parameters())
    return loss_error, grad_error, param_error, dict(engine.shared_parameters)


def split_cases(rank, world_size):
    return {(model_name, schedule_name): _train(rank, model_name, schedule_name, virtual)
            for model_name in MODELS for schedule_name, virtual in SCHEDULES}


@pytest.mark.slow
def test_split_hf_models_train_as_one_process_under_every_schedule():
    for rank, results in enumerate(run_distributed(split_cases, 2, timeout_s=240)):
        for (model_name, schedule_name), (loss_error, grad_error, param_error, shared) in results.items():
            case = (rank, model_name, schedule_name, loss_error, grad_error, param_error)
            assert loss_error < 1e-10 and grad_error < 1e-10 and param_error < 1e-10, case
            if model_name == "gpt2":  # the tied embedding: on the first stage's rank and on the last's
                name = "stage 0: transformer.wte.weight" if schedule_name in BY_TIED else "transformer.wte.weight"
                assert shared == {name: (0, 1)}, case
            else:
                assert shared == {}, case
