"""plait train --precision bf16-mixed / fp16-mixed.

Oracle: plain torch on one process doing what mixed precision means here: the GPT in
fp32 (master weights), each micro-batch's forward under torch.autocast, the loss in
fp32, loss/m backward, AdamW; for fp16 torch.amp.GradScaler around it. One plait
process runs the same arithmetic in the same order, so its loss curve is equal bitwise.
Layouts over several processes regroup the fp32 gradient sums (dp averaging, pipeline
stages): held to the fp32 layouts' tolerance scaled by the 16-bit unit roundoff
(below). An overflow on one rank skips the step on all, and the scaler's state
survives a resume bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.testing import run_distributed
from plait.train.config import TrainConfig

STEPS = 6


def _config(out, **overrides) -> TrainConfig:
    values = dict(layers=4, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8, micro_batch=2,
                  dp=1, tp=1, pp=1, steps=STEPS, warmup_steps=2, lr=3e-3, min_lr=3e-4, grad_clip=0.0,
                  eval_interval=0, checkpoint_interval=0, keep_checkpoints=0, out=str(out), timeout_s=60.0)
    values.update(overrides)
    return TrainConfig(**values)


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _train_rank(rank, world_size, config, until=None):
    from plait.train.loop import Trainer

    Trainer(config, resume="auto", log=lambda _: None).train(until=until)


def _reference(config: TrainConfig, device: str = "cpu") -> tuple[list[float], list[float]]:
    """(losses, loss scales) of plain torch doing mixed precision on one process (on
    ``device``: tests/gpu runs it on CUDA)."""
    from plait.models.gpt import GPT
    from plait.parallel.tensor import UNSHARDED, vocab_parallel_cross_entropy
    from plait.train.corpus import lm_batch, load_corpus
    from plait.train.build import gpt_config, make_optimizer

    corpus = load_corpus(config.data, max_bytes=config.data_max_bytes, val_fraction=config.val_fraction)
    model = GPT(gpt_config(config, corpus.vocab_size), seed=config.seed).to(device)
    optimizer = make_optimizer(model.named_parameters(), config)
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[config.precision]
    scaler = torch.amp.GradScaler(device) if config.precision == "fp16-mixed" else None
    m = config.global_batch // config.micro_batch
    losses, scales = [], []
    for step in range(config.steps):
        inputs, targets = lm_batch(corpus.train, step, config.global_batch, config.seq_len, seed=config.seed)
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in range(m):
            rows = slice(mb * config.micro_batch, (mb + 1) * config.micro_batch)
            with torch.autocast(device, dtype=dtype):
                logits = model(inputs[rows])
            loss = vocab_parallel_cross_entropy(logits.float(), targets[rows], UNSHARDED, corpus.vocab_size).mean()
            total += float(loss.detach())
            (scaler.scale(loss / m) if scaler is not None else loss / m).backward()
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            optimizer.step()
        losses.append(total / m)
    return losses, scales


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_one_process_equals_plain_torch_autocast_bitwise(precision, tmp_path):
    config = _config(tmp_path / "run", precision=precision)
    run_distributed(_train_rank, 1, config, timeout_s=300)
    records = _records(tmp_path / "run")
    losses, scales = _reference(config)
    assert len(records) == len(losses) == STEPS
    assert [record["loss"] for record in records] == losses
    if precision == "fp16-mixed":
        assert [record["loss_scale"] for record in records] == scales
    fp32 = _reference_fp32_first_loss(config)
    assert losses[0] != fp32, "16-bit compute must change the arithmetic, or this test compares fp32 with itself"


def _reference_fp32_first_loss(config: TrainConfig) -> float:
    from plait.models.gpt import GPT
    from plait.parallel.tensor import UNSHARDED, vocab_parallel_cross_entropy
    from plait.train.corpus import lm_batch, load_corpus
    from plait.train.build import gpt_config

    corpus = load_corpus(config.data, max_bytes=config.data_max_bytes, val_fraction=config.val_fraction)
    model = GPT(gpt_config(config, corpus.vocab_size), seed=config.seed)
    inputs, targets = lm_batch(corpus.train, 0, config.global_batch, config.seq_len, seed=config.seed)
    m = config.global_batch // config.micro_batch
    total = 0.0
    for mb in range(m):
        rows = slice(mb * config.micro_batch, (mb + 1) * config.micro_batch)
        total += float(vocab_parallel_cross_entropy(model(inputs[rows]), targets[rows], UNSHARDED,
                                                    corpus.vocab_size).mean())
    return total / m


# bf16 keeps 8 significant bits: unit roundoff u = 2^-8. The multi-process layouts
# differ from one process only in how fp32 gradient sums are grouped, but the 16-bit
# forward of the next step rounds activations that then differ by an fp32 ulp to
# different bf16 values, so the curves drift apart by O(u) per step in the loss (~4):
# 6 steps x 4 x 2^-8 ~ 0.1 bounds it; the same run in fp32 agrees to 1e-5.
BF16_TOLERANCE = STEPS * 4 * 2.0 ** -8


@pytest.mark.slow
def test_layouts_stay_within_the_bf16_rounding_of_one_process(tmp_path):
    reference, _ = _reference(_config(tmp_path / "ref", precision="bf16-mixed"))
    config = _config(tmp_path / "run", precision="bf16-mixed", dp=2, pp=2, grad_reduce_dtype="bf16")
    run_distributed(_train_rank, 4, config, timeout_s=300)
    losses = [record["loss"] for record in _records(tmp_path / "run")]
    assert len(losses) == STEPS
    worst = max(abs(a - b) for a, b in zip(losses, reference))
    assert worst <= BF16_TOLERANCE, f"max |loss - reference| = {worst:.3g} > {BF16_TOLERANCE:.3g}"


@pytest.mark.slow
def test_fp16_resume_keeps_the_loss_scale_and_is_bitwise(tmp_path):
    whole = _config(tmp_path / "whole", precision="fp16-mixed", dp=2, pp=2, checkpoint_interval=3)
    run_distributed(_train_rank, 4, whole, timeout_s=300)
    part = whole.replace(out=str(tmp_path / "part"))
    run_distributed(_train_rank, 4, part, 3, timeout_s=300)
    run_distributed(_train_rank, 4, part, timeout_s=300)
    want, got = _records(tmp_path / "whole"), _records(tmp_path / "part")
    assert len(want) == len(got) == STEPS
    assert [(r["loss"], r["loss_scale"]) for r in got] == [(r["loss"], r["loss_scale"]) for r in want]


def test_bad_precision_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="precision='bf16' is not valid: .*fp32, bf16-mixed, fp16-mixed"):
        _config(tmp_path, precision="bf16")
    with pytest.raises(ValueError, match="mixed precision keeps fp32 master weights; set dtype=float32"):
        _config(tmp_path, precision="bf16-mixed", dtype="float64")
    with pytest.raises(ValueError, match="grad_reduce_dtype='fp16' with precision='bf16-mixed'"):
        _config(tmp_path, precision="bf16-mixed", grad_reduce_dtype="fp16")
