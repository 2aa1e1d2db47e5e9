"""parallelize's plan in one process: the wildcard matcher, the styles and their
strings, the fused layout's shard/gather index, and every refusal (by name, before
the model changes), checked with check_plan at the tp it would run at. The layers'
arithmetic at tp 2 (Linear, HF Conv1D with fused GQA parts, Embedding with a padded
vocabulary and padding_idx) runs on real ranks in test_plan_parity.py (slow)."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from plait.parallel.tensor import (
    UNSHARDED,
    ColwiseParallel,
    ParallelPlan,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    VocabParallel,
    check_plan,
    gpt2_plan,
    parallelize,
    plan_for,
)
from plait.parallel.tensor.plan import name_matches
from plait.parallel.tensor.sharding import ShardSpec, fused_gather_index, shard_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for hf_models
from hf_models import tiny_gpt2  # noqa: E402


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2()


def test_star_matches_one_dotted_component():
    assert name_matches("transformer.h.*.mlp.c_fc", "transformer.h.0.mlp.c_fc")
    assert name_matches("transformer.h.*.mlp.c_fc", "transformer.h.11.mlp.c_fc")
    assert not name_matches("transformer.h.*.mlp.c_fc", "transformer.h.0.x.mlp.c_fc")
    assert not name_matches("h.*.mlp.c_fc", "transformer.h.0.mlp.c_fc")  # anchored: the whole name
    assert name_matches("h.*.attn.c_*", "h.3.attn.c_proj")
    assert name_matches("h.[01].ln_?", "h.1.ln_2") and not name_matches("h.[01].ln_?", "h.2.ln_2")


def test_styles_have_kinds_and_strings_name_them():
    plan = ParallelPlan(styles={"a": "colwise", "b": "rowwise", "c": "vocab", "d": "sequence", "e": "replicate"})
    assert [style.kind for style in plan.styles.values()] == ["colwise", "rowwise", "vocab", "sequence", "replicate"]
    assert plan.styles["a"] == ColwiseParallel() and plan.styles["d"] == SequenceParallel()
    with pytest.raises(TypeError, match="'columnwise' is not a style"):
        ParallelPlan(styles={"a": "columnwise"})
    with pytest.raises(ValueError, match="fused=1 must be >= 2 parts"):
        ColwiseParallel(fused=1)
    with pytest.raises(ValueError, match="cannot be padded"):
        ColwiseParallel(fused=3, pad=True)
    with pytest.raises(ValueError, match="the parts sum to 40, not the layer's out_features=48"):
        ColwiseParallel(fused=(16, 16, 8)).parts(48)
    assert ColwiseParallel(fused=(32, 8, 8)).parts(48) == (32, 8, 8)


@pytest.mark.parametrize("parts, size", [((12, 12, 12), 2), ((16, 4, 4), 4), ((6, 6, 6), 3)])
def test_fused_shards_concatenate_back_to_the_original_order(parts, size):
    full = torch.arange(sum(parts) * 2, dtype=torch.float64).view(sum(parts), 2)
    spec = ShardSpec(0, sum(parts), parts)
    shards = [shard_tensor(full, spec, rank, size) for rank in range(size)]
    starts = [0] + [sum(parts[:j + 1]) for j in range(len(parts))]
    for rank, shard in enumerate(shards):  # rank r holds its 1/p of every part: whole heads of each
        expected = torch.cat([full[starts[j]:starts[j + 1]].chunk(size)[rank] for j in range(len(parts))])
        assert torch.equal(shard, expected)
    assert torch.equal(torch.cat(shards).index_select(0, fused_gather_index(parts, size)), full)


def test_parallelize_at_tp1_is_the_model_itself(gpt2):
    model = copy.deepcopy(gpt2)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    parallelize(model, UNSHARDED, plan_for(model))
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "ColwiseLinear"
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[name], state[name]) for name in state)  # HF's orientation
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, gpt2(tokens).logits)


def test_unknown_module_type_is_refused_by_name(gpt2):
    with pytest.raises(TypeError, match=r"'transformer.h.0.attn' is a GPT2Attention"):
        check_plan(gpt2, {"transformer.h.*.attn": ColwiseParallel()}, 2)
    with pytest.raises(TypeError, match=r"VocabParallel takes an nn.Embedding, but 'lm_head' is a Linear"):
        check_plan(gpt2, {"lm_head": VocabParallel()}, 2)


def test_heads_tp_does_not_divide_are_refused_before_anything_changes():
    model = tiny_gpt2(n_embd=48, n_head=6)  # every width divides by 4; the 6 heads do not
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"transformer.h.0.attn: num_heads=6 is not divisible by tp=4; use tp in "
                                         r"1, 2, 3, 6"):
        check_plan(model, plan_for(model), 4)
    check_plan(model, plan_for(model), 3)
    assert all(torch.equal(model.state_dict()[name], before[name]) for name in before)


def test_a_width_tp_does_not_divide_is_refused_with_the_size_and_fix(gpt2):
    mlp = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8))
    with pytest.raises(ValueError, match=r"0: out_features=12 is not divisible by tp=8 .*pad=True.*1, 2, 3, 4, 6, 12"):
        check_plan(mlp, {"0": ColwiseParallel(), "2": RowwiseParallel()}, 8)
    with pytest.raises(ValueError, match=r"fused part 0 size=32 is not divisible by tp=3"):
        check_plan(gpt2, {"transformer.h.*.attn.c_attn": ColwiseParallel(fused=3)}, 3)
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.c_attn: part 0 of 32 columns gives each of tp=4 "
                                         r"ranks 8, not whole heads of head_dim=16: use a tp that divides the number "
                                         r"of heads \(2\)"):
        check_plan(gpt2, {"transformer.h.*.attn.c_attn": ColwiseParallel(fused=3, head_dim=16)}, 4)


def test_a_plan_entry_matching_nothing_or_twice_is_refused(gpt2):
    with pytest.raises(ValueError, match=r"plan entry 'h.\*.mlp.c_fc' matches no module of GPT2LMHeadModel"):
        check_plan(gpt2, {"h.*.mlp.c_fc": ColwiseParallel()}, 2)
    stage_plan = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise", "lm_head": "colwise"}
    stage = gpt2.transformer.h[0].mlp  # what a pipeline stage holds is named like the whole model; here: none of it
    assert check_plan(stage, stage_plan, 2, missing_ok=True) == []
    matched = check_plan(gpt2, {**stage_plan, "lm_head": "replicate", "score": "colwise"}, 2, missing_ok=True)
    assert [name for name, _, _ in matched] == ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
                                                "transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj", "lm_head"]
    with pytest.raises(ValueError, match=r"'transformer.h.0.mlp.c_fc' is matched by two plan entries"):
        check_plan(gpt2, {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.0.mlp.c_*": "colwise"}, 2)


def test_a_weight_tied_to_a_module_left_whole_is_refused(gpt2):
    with pytest.raises(ValueError, match=r"'lm_head.weight' is the same Parameter as 'transformer.wte.weight'"):
        check_plan(gpt2, {"transformer.wte": VocabParallel()}, 2)


def test_sequence_parallelism_needs_every_parameter_claimed(gpt2):
    plan = gpt2_plan(gpt2, sequence_parallel=True)
    styles = {pattern: style for pattern, style in plan.styles.items() if pattern != "transformer.wpe"}
    with pytest.raises(ValueError, match=r"parameters 'transformer.wpe.weight' are in no plan entry"):
        check_plan(gpt2, ParallelPlan(styles=styles, sequence_parallel=True, adapter=plan.adapter), 2)
    with pytest.raises(ValueError, match="sequence_parallel=False: build the plan with sequence_parallel=True"):
        check_plan(gpt2, {"lm_head": ColwiseParallel(input_layout="sequence-sharded", pad=True)}, 2)
    with pytest.raises(ValueError, match=r"the TensorParallel has sequence_parallel=False but the plan has "
                                         r"sequence_parallel=True"):
        parallelize(copy.deepcopy(gpt2), UNSHARDED, plan)


def test_attention_needs_both_projections_sharded_and_no_cross_attention(gpt2):
    with pytest.raises(ValueError, match=r"h.0.attn: GPT2Attention needs c_attn ColwiseParallel\(fused=3\)"):
        check_plan(gpt2, {"transformer.h.*.attn.c_attn": ColwiseParallel()}, 2, adapter=plan_for(gpt2).adapter)
    with pytest.raises(ValueError, match="add_cross_attention=True is not supported"):
        gpt2_plan(tiny_gpt2(add_cross_attention=True))


def test_plan_for_names_the_models_it_knows():
    with pytest.raises(TypeError, match=r"no ready tensor-parallel plan for Sequential \(plans exist for "
                                        r"GPT2LMHeadModel, GPT2Model, plait's GPT"):
        plan_for(nn.Sequential(nn.Linear(2, 2)))
    assert "lm_head" not in gpt2_plan(tiny_gpt2().transformer).styles  # the bare GPT2Model: no head
    assert plan_for(tiny_gpt2()).styles["lm_head"] == ColwiseParallel(gather_output=True, pad=True,
                                                                     input_layout="replicated")


def test_parallelizing_twice_is_refused(gpt2):
    model = parallelize(copy.deepcopy(gpt2), UNSHARDED, plan_for(gpt2))
    with pytest.raises(ValueError, match=r"'transformer.wte' is already tensor-parallel \(VocabEmbedding\)"):
        check_plan(model, plan_for(model), 1)
    assert isinstance(Replicate(), Replicate)
