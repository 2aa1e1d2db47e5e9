"""plait train --model hf:CONFIG: a Hugging Face causal LM built from a config.json the
test writes (tiny GPT-2 and Llama-style configs, tests/hf_models.py), trained by
plait's trainer under its layouts, against one process written here from plain torch
and transformers: AutoModelForCausalLM.from_config after the same seed, the whole
global batch, AdamW (decay on matrices only), torch's clip_grad_norm_, plait's LR
schedule.

float64 throughout: the layouts differ from the reference only in the order sums are
taken (dp averaging, micro-batch accumulation, ZeRO's reduce-scatter), a relative
roundoff of ~1e-15 per step that AdamW's normalised update keeps from growing over a
few steps; the stated bound is 1e-10 on losses of ~4.5.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from plait.testing import run_distributed
from plait.train.config import TrainConfig
from tests.train import runs

TOLERANCE = 1e-10  # float64, a few steps (module docstring)
STEPS = 3
VOCAB = 96  # covers the character vocabulary of the stdlib text read (92 at 60 kB)


def _tiny(kind: str, seed: int = 0, **overrides):
    """tests/hf_models.py's tiny GPT-2 or Llama-style model (float64), vocab VOCAB unless overridden."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_models import tiny_gpt2, tiny_llama

    make = {"gpt2": tiny_gpt2, "llama": tiny_llama}[kind]
    return make(seed, **{"vocab_size": VOCAB, **overrides})


def _write_config(directory: Path, kind: str, **overrides) -> Path:
    """A tiny model's config.json (no weights), as config.save_pretrained writes it."""
    directory.mkdir(parents=True, exist_ok=True)
    _tiny(kind, **overrides).config.save_pretrained(directory)
    return directory


def _config(out, model_dir, **overrides) -> TrainConfig:
    values = dict(model=f"hf:{model_dir}", seq_len=16, data_max_bytes=60_000, global_batch=8, micro_batch=2, dp=1,
                  tp=1, pp=1, steps=STEPS, warmup_steps=1, dtype="float64", lr=3e-3, min_lr=3e-4, grad_clip=1.0,
                  eval_interval=0, checkpoint_interval=0, keep_checkpoints=0, out=str(out), timeout_s=60.0)
    values.update(overrides)
    return TrainConfig(**values)


def _reference(config: TrainConfig) -> tuple[list[float], dict]:
    """(losses, final named parameters) of one process, the whole global batch, plain
    torch and transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from plait.train.build import batch, load_data, make_optimizer

    data = load_data(config)  # the char corpus, or the tokenized text (plait.train.text_data)
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.hf_source)).double()
    optimizer = make_optimizer(model.named_parameters(), config)
    losses = []
    for step in range(config.steps):
        inputs, targets = batch(config, data, step, 0, 1)  # the whole global batch
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or float("inf"))
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {name: param.detach() for name, param in model.named_parameters()}


def _worst(losses, reference) -> float:
    assert len(losses) == len(reference) == STEPS, f"{len(losses)} and {len(reference)} steps, expected {STEPS}"
    return max(abs(a - b) for a, b in zip(losses, reference))


def _build_error(rank, world_size, config) -> str:
    """The message of the Trainer's refusal to build ``config`` (every rank alike)."""
    from plait.train.loop import Trainer

    with pytest.raises(ValueError) as raised:
        Trainer(config, resume="never", log=lambda _: None)
    return str(raised.value)


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    """On 2 ranks: dp2 with ZeRO-3 (one gathered unit per GPT-2 block, the tied
    embedding kept gathered); tp2 through GPT-2's plan (fused c_attn, Conv1D, vocab-
    parallel tied embedding) with selective recomputation (each block's attention);
    dp2 with full recomputation of the Llama-style model's blocks: each equals one
    process, and the checkpoints hold the reference's weights. A head count tp does
    not divide is refused by the plan's adapter, naming the module."""
    gpt2 = _write_config(tmp_path / "gpt2", "gpt2")
    llama = _write_config(tmp_path / "llama", "llama")
    configs = [_config(tmp_path / "zero3", gpt2, dp=2, zero_stage=3),
               _config(tmp_path / "tp2", gpt2, tp=2, recompute="selective"),
               _config(tmp_path / "full", llama, dp=2, recompute="full")]
    run_distributed(runs.train_each, 2, configs, timeout_s=300)
    references = {gpt2: _reference(configs[0]), llama: _reference(configs[2])}
    assert references[gpt2][0][-1] < references[gpt2][0][0], "the reference must learn"
    for config, model_dir in zip(configs, (gpt2, gpt2, llama)):
        worst = _worst(runs.losses(config.out), references[model_dir][0])
        assert worst <= TOLERANCE, f"{config.out}: max |loss - reference| = {worst:.3g}"
    _check_checkpoint(tmp_path / "zero3", "gpt2", references[gpt2][1])
    _check_checkpoint(tmp_path / "tp2", "gpt2", references[gpt2][1])  # the fused c_attn in HF's q|k|v order

    from plait.train.build import load_data
    from plait.train.hf_generate import model_from_checkpoint, sample

    trained, _ = model_from_checkpoint(tmp_path / "tp2")  # the closing sample's model: HF's, the trained weights
    assert max(float((param.detach() - references[gpt2][1][name]).abs().max())
               for name, param in trained.named_parameters()) <= TOLERANCE
    text = sample(trained, load_data(configs[1]), "def ", chars=8, seq_len=16)
    assert text.startswith("def ") and len(text) >= 12

    odd = _write_config(tmp_path / "odd", "gpt2", n_head=3, n_embd=24)
    messages = run_distributed(_build_error, 2, _config(tmp_path / "odd-run", odd, tp=2), timeout_s=120)
    assert "num_heads=3 is not divisible by tp=2" in messages[0]


def _check_checkpoint(out: Path, model_type: str, reference: dict) -> None:
    """The run's checkpoint verifies, holds HF's parameters by HF's names, unsharded
    in HF's layout: equal to the single-process reference's after the same steps
    (float64 roundoff, as the losses), and config.json sits in the run and the
    checkpoint."""
    from plait.train import checkpoint as ckpt, checkpoint_load

    path = ckpt.latest_complete(out)
    assert ckpt.verify(path) == []
    manifest, model, _, _ = checkpoint_load.load_full(path)
    assert manifest["model"]["kind"] == "hf" and manifest["model"]["model_type"] == model_type
    for where in (out, path):
        assert json.loads((where / "config.json").read_text())["model_type"] == model_type
    assert sorted(model) == sorted(reference)
    worst = max(float((model[name] - reference[name]).abs().max()) for name in reference)
    assert worst <= TOLERANCE, f"{out}: checkpoint weights off the reference's by {worst:.3g}"


@pytest.mark.slow
def test_pipelines_match_one_process(tmp_path):
    """On 4 ranks, through the automatic split: dp2 x pp2 of GPT-2 (its tied embedding
    and head on the first and last stage, their gradients summed) reading JSONL
    documents through a byte-level BPE trained on them (--tokenizer train:bpe:300
    --text-field body), and tp2 x pp2 of the Llama-style model (sharded by its plan,
    then split): each equals one process."""
    gpt2 = _write_config(tmp_path / "gpt2", "gpt2", vocab_size=320)
    llama = _write_config(tmp_path / "llama", "llama")
    documents = tmp_path / "docs.jsonl"
    root = Path(sysconfig.get_paths()["stdlib"])
    documents.write_text("".join(json.dumps({"body": path.read_text()[:4000], "n": index}) + "\n"
                                 for index, path in enumerate(sorted(root.glob("[a-c]*.py"))[:12])))
    configs = [_config(tmp_path / "dp2pp2", gpt2, dp=2, pp=2, data=str(documents), tokenizer="train:bpe:300",
                       text_field="body", val_fraction=0.1),
               _config(tmp_path / "tp2pp2", llama, tp=2, pp=2)]
    run_distributed(runs.train_each, 4, configs, timeout_s=300)
    for config, model_type in zip(configs, ("gpt2", "llama")):
        losses, weights = _reference(config)
        worst = _worst(runs.losses(config.out), losses)
        assert worst <= TOLERANCE, f"{config.out}: max |loss - reference| = {worst:.3g}"
        _check_checkpoint(Path(config.out), model_type, weights)


def test_bad_models_are_refused_by_name(tmp_path):
    from plait.train.hf_model import build, load_config

    with pytest.raises(ValueError, match="does not exist; give a Hugging Face config.json"):
        load_config(str(tmp_path / "missing"))
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="'t5' .* is not a causal language model"):
        load_config(str(tmp_path / "t5"))
    from transformers import BertConfig

    bert = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)
    BertConfig(**bert).save_pretrained(tmp_path / "bert")  # a causal-LM class, but attending both ways
    with pytest.raises(ValueError, match="BertLMHeadModel is not causal"):
        build(str(tmp_path / "bert"), dtype="float64", seed=0)
    BertConfig(**bert, is_decoder=True).save_pretrained(tmp_path / "bert-decoder")
    build(str(tmp_path / "bert-decoder"), dtype="float64", seed=0)
    with pytest.raises(ValueError, match="model='cnn' is not valid: use one of gpt, mlp, or hf:CONFIG"):
        TrainConfig(model="cnn")
    small = _write_config(tmp_path / "small", "gpt2", vocab_size=32)
    from plait.train.build import build_model, load_data

    config = _config(tmp_path / "run", small)
    with pytest.raises(ValueError, match=r"vocab_size \(32\) is smaller than the data's vocabulary \(92 ids"):
        build_model(config, load_data(config))
    assert build(str(small), dtype="float64", seed=0).config.vocab_size == 32
    saved = _tiny("gpt2", vocab_size=32, seed=7)  # a directory with weights: from_pretrained, not a fresh init
    saved.save_pretrained(tmp_path / "pretrained")
    loaded = build(str(tmp_path / "pretrained"), dtype="float64", seed=0)
    assert all(torch.equal(param, dict(saved.named_parameters())[name]) for name, param in loaded.named_parameters())

    from transformers import GPTNeoXConfig

    from plait.train import hf_layout

    GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  vocab_size=VOCAB).save_pretrained(tmp_path / "neox")
    uncovered = _config(tmp_path / "run", tmp_path / "neox", tp=2)
    with pytest.raises(ValueError, match=r"no ready tensor-parallel plan for GPTNeoXForCausalLM \(plans exist for "
                                         r"GPT2LMHeadModel.*Llama.*use tp=1"):
        hf_layout.tensor_plan(hf_layout.meta_model(uncovered), uncovered)
    with pytest.raises(ValueError, match="eval_interval=5 with model='hf:.*' and pp=2: .* set eval_interval=0"):
        _config(tmp_path / "run", small, pp=2, eval_interval=5)
    with pytest.raises(ValueError, match="layers=8, dropout=0.1 with model='hf:.*': the HF config fixes the arch"):
        _config(tmp_path / "run", small, layers=8, dropout=0.1)
    with pytest.raises(ValueError, match="sequence_parallel=true with model='hf:.*' and pp=2"):
        _config(tmp_path / "run", small, tp=2, pp=2, sequence_parallel=True)
    # Chimera's two replicas would put both ends of GPT-2's tied embedding/head on one rank (measured: 3e-5 off)
    chimera = _config(tmp_path / "run", small, pp=2, schedule="chimera")
    with pytest.raises(ValueError, match=r"schedule='chimera' with model=.*transformer.wte.weight are shared"):
        hf_layout.layers(build(str(small), dtype="float64", seed=0), chimera)
