"""A weight shared by pipeline stages on different ranks is never silently wrong
(issue 33, item 3): Hugging Face GPT-2 with its tied wte / lm_head (the default), cut
into two stages by hand, on two pipeline ranks with 1F1B and zero bubble.

- stage modules alone, nothing declared: refused at construction, naming both
  parameters, their ranks and the fixes (model=, tied=[...], tied=());
- ``tied=`` declaring the tie, or ``model=`` (the whole model): losses and parameters
  after a few SGD steps equal one process training the whole HF model;
- the untied model (``tie_word_embeddings=False``) with nothing declared: not refused
  (its zero biases and LayerNorm ones are equal on both ranks by construction), exact;
- ``tied=()`` on the tied model (a false "independent"): trains off, which shows the
  comparison above can fail;
- ``plait.parallel.hybrid.build_hybrid`` (dp = tp = 1, pp = 2) given the whole tied model
  and its two halves as layers: finds the tie itself and is exact.

Tolerance 1e-10 absolute (float64), as tests/parallel/test_pipeline_engine.py: the
pipeline sums per-micro-batch gradients (and the tied weight's two halves over the
ranks) where one process sums the whole batch at once, the same terms in another order,
a few ulps (u = 1.1e-16) of O(1) values, compounded over 3 steps of SGD with momentum.
A missing sum is off by a whole stage's share of the gradient: ~1e-3 here.

The fast tests below exercise the decision (``identify``) on descriptions made in one
process: which look-alikes count, which are initialisation patterns.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.parallel.pipeline import build
from plait.parallel.pipeline.engine import PipelineEngine
from plait.parallel.pipeline.engine_checks import check_tied
from plait.parallel.pipeline.shared_params import describe, identify
from plait.testing import run_distributed
from tests.hf_models import tiny_gpt2

VOCAB, SEQ, MICROBATCHES, STEPS = 64, 8, 4, 3
TIE = [[(0, "wte.weight"), (1, "lm_head.weight")]]


def _gpt2(tied: bool):
    """A tiny HF GPT-2 (float64, no dropout), the same on every rank (one seed)."""
    return tiny_gpt2(0, VOCAB, tie_word_embeddings=tied)


class _Blocks(nn.Module):
    """GPT-2 blocks run with the causal mask GPT2Model builds."""

    def __init__(self, gpt, blocks):
        super().__init__()
        self.config = gpt.config
        self.h = nn.ModuleList(blocks)

    def blocks(self, x):
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(x.shape[1]).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=positions)
        for block in self.h:
            x = block(x, attention_mask=mask)
        return x


class FirstHalf(_Blocks):
    """tokens (b, s) -> wte + wpe -> block 0 -> (b, s, h)."""

    def __init__(self, gpt):
        super().__init__(gpt, [gpt.transformer.h[0]])
        self.wte, self.wpe = gpt.transformer.wte, gpt.transformer.wpe

    def forward(self, tokens):
        return self.blocks(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]).unsqueeze(0)))


class SecondHalf(_Blocks):
    """(b, s, h) -> block 1 -> ln_f -> lm_head (tied to wte by default) -> logits."""

    def __init__(self, gpt):
        super().__init__(gpt, [gpt.transformer.h[1]])
        self.ln_f, self.lm_head = gpt.transformer.ln_f, gpt.lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(self.blocks(x)))


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _train(rank, schedule_name, tied_model, **declared):
    """3 SGD steps pipelined and in one process: (max loss error, max parameter error)."""
    schedule = build(schedule_name, 2, MICROBATCHES)
    reference, pipelined = _gpt2(tied_model), _gpt2(tied_model)
    halves = [FirstHalf(pipelined), SecondHalf(pipelined)]
    if declared.pop("whole", False):
        declared["model"] = pipelined
    engine = PipelineEngine(schedule, {rank: halves[rank]}, _loss, timeout_s=60, **declared)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.5, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    loss_error = 0.0
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2 * MICROBATCHES, SEQ + 1), generator=torch.Generator().manual_seed(step))
        loss = engine.train_step(tokens[:, :-1], tokens[:, 1:], optimizer)
        reference_optimizer.zero_grad()
        want = _loss(reference(tokens[:, :-1]).logits, tokens[:, 1:])
        want.backward()
        reference_optimizer.step()
        loss_error = max(loss_error, abs(loss - want.item()))
    theirs = [FirstHalf(reference), SecondHalf(reference)][rank]
    param_error = max((mine - other).abs().max().item()
                      for mine, other in zip(halves[rank].parameters(), theirs.parameters()))
    return loss_error, param_error, dict(engine.shared_parameters)


def _train_hybrid(rank):
    """build_hybrid from the whole tied model: (max loss error, max parameter error, shared)."""
    from plait.parallel.hybrid import build_hybrid, train_step
    from plait.parallel.mesh import DeviceMesh, ParallelDims

    mesh = DeviceMesh.create(ParallelDims(pp=2))
    reference, whole = _gpt2(True), _gpt2(True)
    hybrid = build_hybrid(whole, [FirstHalf(whole), SecondHalf(whole)], mesh, _loss, schedule="1f1b",
                          microbatches=MICROBATCHES, timeout_s=60)
    optimizer = torch.optim.SGD(list(hybrid.parameters()), lr=0.5, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    loss_error = 0.0
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2 * MICROBATCHES, SEQ + 1), generator=torch.Generator().manual_seed(step))
        loss, _, _ = train_step(hybrid, tokens[:, :-1], tokens[:, 1:], optimizer, step=step)
        reference_optimizer.zero_grad()
        want = _loss(reference(tokens[:, :-1]).logits, tokens[:, 1:])
        want.backward()
        reference_optimizer.step()
        loss_error = max(loss_error, abs(loss - want.item()))
    theirs = dict(reference.named_parameters())
    param_error = max((param - theirs[name]).abs().max().item() for name, param in hybrid.names.items())
    return loss_error, param_error, dict(hybrid.engine.shared_parameters)


def shared_weight_cases(rank, world_size):
    results = {}
    for name in ("1f1b", "zero_bubble"):
        try:
            _train(rank, name, True)
            results[(name, "undeclared")] = None
        except ValueError as error:
            results[(name, "undeclared")] = str(error)
        results[(name, "tied")] = _train(rank, name, True, tied=TIE)
        results[(name, "model")] = _train(rank, name, True, whole=True)
        results[(name, "untied")] = _train(rank, name, False)
        results[(name, "false independent")] = _train(rank, name, True, tied=())
    results["build_hybrid"] = _train_hybrid(rank)
    return results


@pytest.mark.slow
def test_hf_gpt2_tied_across_ranks_is_refused_or_exact():
    for rank, results in enumerate(run_distributed(shared_weight_cases, 2, timeout_s=240)):
        for name in ("1f1b", "zero_bubble"):
            assert results[(name, "undeclared")] == (
                "PipelineEngine: stage 0 'wte.weight' on pipeline rank 0 and stage 1 'lm_head.weight' on pipeline "
                "rank 1 ((64, 32) torch.float64) look like one shared weight (the same shape, dtype and initial values "
                "on two ranks, as a tied embedding and output head have) but nothing says whether they are: pass "
                "model= (the whole model the stages were cut from) so ties are found by identity, or "
                "tied=[[(0, 'wte.weight'), (1, 'lm_head.weight')]] for those that are one parameter (their gradients "
                "are then summed), or tied=() if they are independent"), (rank, name)
            loss_error, param_error, shared = results[(name, "tied")]
            assert loss_error < 1e-10 and param_error < 1e-10, (rank, name, "tied", loss_error, param_error)
            assert shared == {"stage 0: wte.weight": (0, 1)}
            loss_error, param_error, shared = results[(name, "model")]
            assert loss_error < 1e-10 and param_error < 1e-10, (rank, name, "model", loss_error, param_error)
            assert shared == {"transformer.wte.weight": (0, 1)}
            loss_error, param_error, shared = results[(name, "untied")]
            assert loss_error < 1e-10 and param_error < 1e-10, (rank, name, "untied", loss_error, param_error)
            assert shared == {}
            _, param_error, shared = results[(name, "false independent")]
            assert shared == {} and param_error > 1e-4, (rank, name, param_error)
        loss_error, param_error, shared = results["build_hybrid"]
        assert loss_error < 1e-10 and param_error < 1e-10, (rank, "build_hybrid", loss_error, param_error)
        assert shared == {"transformer.wte.weight": (0, 1)}


# ----- the decision, in one process -------------------------------------------------------------
def _everyone(stages_by_rank, **declared):
    return [describe(stages, rank, None, declared.get("tied"))[0] for rank, stages in enumerate(stages_by_rank)]


def _block(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).double()


def test_equal_layers_by_construction_are_not_refused():
    """Zero biases, LayerNorm's ones and a value every block of a rank repeats (an
    arange init, as Mamba's A_log) are patterns, not ties; equal names mean nothing."""
    first, second = _block(1), _block(2)
    for module in (first, second):
        nn.init.zeros_(module[0].bias)
    extra = [nn.Parameter(torch.arange(4.0, dtype=torch.float64)) for _ in range(3)]
    holder = [nn.ParameterList(extra[:2]), nn.ParameterList(extra[2:])]
    everyone = _everyone([{0: nn.Sequential(first, holder[0])}, {1: nn.Sequential(second, holder[1])}])
    schedule = build("1f1b", 2, 2)
    assert {name: ranks for name, ranks in identify(everyone, schedule, by_model=False).holders.items()
            if len(ranks) > 1} == {}


def test_a_copied_random_weight_on_two_ranks_is_refused_unless_declared():
    first, second = _block(1), _block(1)  # one seed: the same random matrix on both ranks
    schedule = build("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"stage 0 '0.bias' on pipeline rank 0 and stage 1 '0.bias' on pipeline rank "
                                         r"1 \(\(4,\) torch.float64\); stage 0 '0.weight' on pipeline rank 0 and "
                                         r"stage 1 '0.weight' on pipeline rank 1 \(\(4, 4\) torch.float64\) look like "
                                         r"shared weights .* or tied=\[\[\(0, '0.bias'\), \(1, '0.bias'\)\], "
                                         r"\[\(0, '0.weight'\), \(1, '0.weight'\)\]\] for those"):
        identify(_everyone([{0: first}, {1: second}]), schedule, by_model=False)
    tie = [[(0, "0.weight"), (1, "0.weight")]]
    found = identify(_everyone([{0: first}, {1: second}], tied=tie), schedule, by_model=False, tied=tie)
    assert {name: ranks for name, ranks in found.holders.items() if len(ranks) > 1} == {"stage 0: 0.weight": (0, 1)}
    independent = identify(_everyone([{0: first}, {1: second}], tied=()), schedule, by_model=False, tied=())
    assert all(len(ranks) == 1 for ranks in independent.holders.values())


def test_a_bad_tie_is_named():
    schedule = build("1f1b", 2, 2)
    first, second = _block(1), _block(2)
    tie = [[(0, "0.weight"), (1, "0.wieght")]]
    with pytest.raises(ValueError, match=r"tied= names parameter '0.wieght' of stage 1, which stage 1 on pipeline "
                                         r"rank 1 does not have"):
        identify(_everyone([{0: first}, {1: second}], tied=tie), schedule, by_model=False, tied=tie)
    tie = [[(0, "0.weight"), (1, "0.weight")]]  # two different random matrices declared one
    with pytest.raises(ValueError, match=r"parameter \(0, '0.weight'\) \(tied=\) held by pipeline ranks 0 and 1 "
                                         r"starts with different values: build every rank's model from the same seed"):
        identify(_everyone([{0: first}, {1: second}], tied=tie), schedule, by_model=False, tied=tie)
    with pytest.raises(ValueError, match=r"pass model= or tied=, not both"):
        check_tied((), 2, first)
    with pytest.raises(TypeError, match=r"tied must be a list of groups of \(stage, parameter name\) pairs"):
        check_tied("wte.weight", 2, None)
    with pytest.raises(ValueError, match=r"tied= names stage 2 \('lm_head.weight'\) but the schedule has stages 0..1"):
        check_tied([[(0, "wte.weight"), (2, "lm_head.weight")]], 2, None)
