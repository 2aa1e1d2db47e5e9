"""Llama-style Hugging Face decoders under ``parallelize(model, tp, llama_plan(model))``
(plait.parallel.tensor.llama): LlamaForCausalLM with grouped-query attention (8 query
over 4 key/value heads), tied and untied, at tp 2 with and without sequence
parallelism, at tp 4 untied without and tied with it; Phi-3's fused qkv_proj (GQA
parts) and gate_up_proj at tp 2 with and without; Mistral (tp 2) and Qwen2 (biased
q/k/v, tp 2 with SP); all in one world of 4 ranks, against one process running the
unsharded model on the same data: logits, HF's loss, the gathered gradients and the
parameters after 2 AdamW steps; the gathered state dict is the original's, key for key
and bit for bit; a tp not dividing the key/value heads is refused before anything
changes.

Tolerances (float64, ε = 2⁻⁵² ≈ 2.2e-16): tp splits each matmul's reduction over the
hidden or ffn dim into p partial sums added by the all-reduce, the same terms in
another order, so logits and gradients differ by a few ε·Σ|terms| (≤ 1e-13 here,
where |terms| ≤ ~10); AdamW's step is lr·m/(√v + eps), smooth in g with slope at most
lr/eps for gradients near 0 (1e-2/1e-8 · 1e-16 = 1e-10), so the parameters after 2
steps agree to 1e-10. HF's loss casts the logits to float32 (``logits.float()`` in
ForCausalLMLoss), so it is compared at float32's rtol 1e-6; the gradients come from a
float64 cross-entropy written here."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.testing import run_distributed
from tests.hf_models import tiny_llama, tiny_phi3

BATCH, SEQ, VOCAB, STEPS = 2, 8, 64, 2
LOGITS_ATOL, GRAD_ATOL, PARAM_ATOL, HF_LOSS_RTOL = 1e-12, 1e-12, 1e-10, 1e-6
# 8 query heads over 4 key/value heads (head_dim 4): tp 2 and 4 both divide them
GQA = dict(num_attention_heads=8, num_key_value_heads=4)


def _build(arch: str, tied: bool):
    """The tiny float64 model of ``arch``; Mistral and Qwen2 (q/k/v biases) as tiny_llama's sizes."""
    if arch == "phi3":
        return tiny_phi3(tie_word_embeddings=tied)
    if arch == "llama":
        return tiny_llama(tie_word_embeddings=tied, **GQA)
    import transformers  # imported where used: seconds, and only the ranks and the reference need it

    prefix = {"mistral": "Mistral", "qwen2": "Qwen2"}[arch]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=32,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, **GQA)
    torch.manual_seed(0)
    return getattr(transformers, f"{prefix}ForCausalLM")(config).double()


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(50 + step))


def _loss64(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in float64 (HF's own loss runs in float32)."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _train(model, gather_grads, gather_state):
    """STEPS AdamW steps; per step: logits, HF's loss, the float64 loss and the (gathered)
    gradients; then the (gathered) state dict."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    record = []
    for step in range(STEPS):
        tokens = _tokens(step)
        out = model(input_ids=tokens, labels=tokens)
        loss = _loss64(out.logits, tokens)
        optimizer.zero_grad()
        loss.backward()
        record.append(dict(logits=out.logits.detach().clone(), hf_loss=out.loss.item(), loss=loss.item(),
                           grads=gather_grads(model)))
        optimizer.step()
    return record, gather_state(model)


def _reference(arch: str, tied: bool):
    model = _build(arch, tied)
    return _train(model, lambda m: {name: p.grad.clone() for name, p in m.named_parameters()},
                  lambda m: {name: t.clone() for name, t in m.state_dict().items()})


def _parallel_rank(rank, world_size):
    """World 4: tp=2 on ranks {0,1} (no SP) and {2,3} (SP), then tp=4 on all with and
    without SP; Llama tied and untied, Phi-3 at tp 2; the refusal. Each group's rank 0
    returns its scenarios' records."""
    from plait.parallel.tensor import TensorParallel, gather_grads, gather_state_dict, parallelize
    from plait.parallel.tensor.llama import llama_plan

    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    # tp=2: pair {0,1} without SP, {2,3} with; tp=4: untied without SP, tied with (the
    # tied x SP crossings at tp=2); Mistral (no SP) and Qwen2 (SP) read as Llama
    runs = [(2, pairs[rank // 2], rank >= 2, arch, tied) for arch, tied in
            (("llama", False), ("llama", True), ("phi3", False), ("qwen2" if rank >= 2 else "mistral", False))]
    runs += [(4, None, False, "llama", False), (4, None, True, "llama", True)]
    results = {}
    for tp_size, group, sp, arch, tied in runs:
        model = _build(arch, tied)
        original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        tp = TensorParallel(group=group, sequence_parallel=sp)
        parallelize(model, tp, llama_plan(model, sequence_parallel=sp))
        state = gather_state_dict(model, tp)
        same = list(state) == list(original) and all(torch.equal(state[k], original[k]) for k in original)
        record, final = _train(model, lambda m: gather_grads(m, tp), lambda m: gather_state_dict(m, tp))
        if tp.rank == 0:
            results[(tp_size, sp, arch, tied)] = dict(record=record, final=final, state_equal=same)
    # the bare LlamaModel (no "model." prefix, no head) at tp=2: its last_hidden_state, forward
    bare, whole = _build("llama", False).model, _build("llama", False).model
    tp = TensorParallel(group=pairs[rank // 2], sequence_parallel=rank >= 2)
    parallelize(bare, tp, llama_plan(bare, sequence_parallel=tp.sequence_parallel))
    bare_error = (bare(_tokens(0)).last_hidden_state - whole(_tokens(0)).last_hidden_state).abs().max().item()
    # the refusal: tiny_llama's 2 key/value heads at tp=4, before anything is converted
    model = tiny_llama()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    try:
        parallelize(model, TensorParallel(group=None), llama_plan(model))
        refusal = None
    except ValueError as error:
        refusal = str(error)
    untouched = type(model.model.layers[0].self_attn.k_proj) is nn.Linear and all(
        torch.equal(before[k], v) for k, v in model.state_dict().items())
    return dict(results=results, refusal=refusal, untouched=untouched, bare_error=bare_error)


def _close(name, got, want, atol):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    error = (got - want).abs().max().item()
    assert error <= atol, f"{name}: max |difference| {error:.3e} > {atol:.0e}"


@pytest.mark.slow
def test_llama_style_models_at_tp_2_and_4_with_and_without_sp_match_one_process():
    ranks = run_distributed(_parallel_rank, 4, timeout_s=240)
    references = {(arch, tied): _reference(arch, tied) for arch, tied in
                  (("llama", False), ("llama", True), ("phi3", False), ("mistral", False), ("qwen2", False))}
    results = {**ranks[0]["results"], **ranks[2]["results"]}
    assert sorted(results) == sorted([(2, False, "llama", False), (2, False, "llama", True), (2, False, "phi3", False),
                                      (2, False, "mistral", False), (2, True, "llama", False),
                                      (2, True, "llama", True), (2, True, "phi3", False), (2, True, "qwen2", False),
                                      (4, False, "llama", False), (4, True, "llama", True)])
    for (tp_size, sp, arch, tied), got in results.items():
        where = f"{arch} tp={tp_size} sp={sp} tied={tied}"
        ref_record, ref_final = references[(arch, tied)]
        assert got["state_equal"], f"{where}: the gathered state dict is not the original's"
        for step, (mine, ref) in enumerate(zip(got["record"], ref_record)):
            _close(f"{where} step {step} logits", mine["logits"], ref["logits"], LOGITS_ATOL)
            assert mine["loss"] == pytest.approx(ref["loss"], rel=0, abs=LOGITS_ATOL), (where, step)
            assert mine["hf_loss"] == pytest.approx(ref["hf_loss"], rel=HF_LOSS_RTOL), (where, step)
            assert list(mine["grads"]) == list(ref["grads"]), where
            for name in ref["grads"]:
                _close(f"{where} step {step} grad {name}", mine["grads"][name], ref["grads"][name], GRAD_ATOL)
        assert list(got["final"]) == list(ref_final), where
        for name in ref_final:
            _close(f"{where} after {STEPS} steps {name}", got["final"][name], ref_final[name], PARAM_ATOL)
    for rank in ranks:
        assert rank["bare_error"] <= LOGITS_ATOL, rank["bare_error"]
        assert rank["untouched"], "a refused plan changed the model"
        assert "tp=4 does not divide num_key_value_heads=2" in rank["refusal"], rank["refusal"]
        assert "use tp in 1, 2" in rank["refusal"], rank["refusal"]


def test_llama_plan_splits_by_name_and_plan_for_picks_it():
    from transformers import GPT2Config

    from plait.parallel.tensor import plan_for
    from plait.parallel.tensor.llama import llama_plan

    llama, phi3 = tiny_llama(), tiny_phi3()
    plan = plan_for(llama)
    kinds = {pattern: style.kind for pattern, style in plan.styles.items()}
    assert kinds["model.embed_tokens"] == "vocab" and kinds["lm_head"] == "colwise"
    assert [kinds[f"model.layers.*.self_attn.{p}_proj"] for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    assert [kinds[f"model.layers.*.mlp.{p}_proj"] for p in ("gate", "up", "down")] == ["colwise"] * 2 + ["rowwise"]
    assert kinds["model.norm"] == kinds["model.layers.*.input_layernorm"] == "sequence"
    assert plan.adapter.name == "llama" and plan.seq_dim == 1 and not plan.sequence_parallel
    assert llama_plan(llama.config, sequence_parallel=True).sequence_parallel
    assert "layers.*.self_attn.q_proj" in llama_plan(llama.model).styles  # the bare LlamaModel: no "model."
    fused = plan_for(phi3).styles  # 8 query, 4 key/value heads of 4: parts 32, 16, 16
    assert fused["model.layers.*.self_attn.qkv_proj"].fused == (32, 16, 16)
    assert fused["model.layers.*.mlp.gate_up_proj"].fused == 2
    with pytest.raises(TypeError, match="model_type='gpt2'"):
        llama_plan(GPT2Config())


def test_the_adapter_refuses_a_tp_not_dividing_the_kv_heads_and_localizes_heads():
    import copy
    import pickle

    from plait.parallel.tensor import UNSHARDED, parallelize
    from plait.parallel.tensor.llama import LocalHeadsConfig, llama_plan

    model = tiny_llama()  # 4 query heads over 2 key/value heads
    plan = llama_plan(model)
    styles = {f"model.layers.0.self_attn.{p}_proj": plan.styles[f"model.layers.*.self_attn.{p}_proj"] for p in "qkvo"}
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads=2 .* use tp in 1, 2"):
        plan.adapter.check(model, styles, 4)
    del styles["model.layers.0.self_attn.k_proj"]  # half an attention sharded would mix shard and whole
    with pytest.raises(ValueError, match="k_proj=None"):
        plan.adapter.check(model, styles, 2)
    phi3 = tiny_phi3()
    tokens = _tokens(0)
    expected = phi3(tokens).logits
    parallelize(phi3, UNSHARDED, llama_plan(phi3))  # a group of one: the same model
    attention = phi3.model.layers[1].self_attn
    assert isinstance(attention.config, LocalHeadsConfig) and attention.config.num_attention_heads == 8
    assert attention.config._attn_implementation == phi3.config._attn_implementation == "sdpa"
    assert phi3.config.num_attention_heads == 8 and type(phi3.config).__name__ == "Phi3Config"
    assert torch.equal(phi3(tokens).logits, expected)
    for copied in (copy.deepcopy(phi3), pickle.loads(pickle.dumps(phi3))):
        assert torch.equal(copied(tokens).logits, expected)
