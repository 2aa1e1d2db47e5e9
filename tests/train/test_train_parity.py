"""plait train's hybrid layouts against one process training the same model.

The oracle is written here from plain torch: the unsharded GPT, the whole global
batch, AdamW, torch's clip_grad_norm_. Every layout (dp × tp × pp) must give its
loss curve within 1e-5 for 20 steps in float32: the layouts differ only in the
order floating-point sums are taken (micro-batch accumulation, dp averaging,
tp partial sums), which moves a loss of ~4 by a few float32 ulps (1 ulp at 4 is
4.8e-7) per step; AdamW's normalised update keeps those differences from
growing much over 20 steps. Resume (same layout) is bitwise; resharding (another
layout) is held to the same 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.testing import run_distributed
from plait.train.config import TrainConfig

TOLERANCE = 1e-5
STEPS = 20


def _config(out, **overrides) -> TrainConfig:
    values = dict(layers=4, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8, micro_batch=2,
                  dp=1, tp=1, pp=1, steps=STEPS, warmup_steps=3, lr=3e-3, min_lr=3e-4, eval_interval=0,
                  checkpoint_interval=0, keep_checkpoints=0, out=str(out), timeout_s=60.0)
    values.update(overrides)
    return TrainConfig(**values)


def _records(out) -> list[dict]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _losses(out) -> list[float]:
    return [record["loss"] for record in _records(out)]


def _worst(losses, reference, steps: int) -> float:
    """max |a - b| over the two curves, which must both have ``steps`` entries (zip
    alone would compare a short run's prefix and pass)."""
    assert len(losses) == len(reference) == steps, f"{len(losses)} and {len(reference)} steps, expected {steps}"
    return max(abs(a - b) for a, b in zip(losses, reference))


def _train_rank(rank, world_size, config, resume="auto", until=None):
    from plait.train.loop import Trainer

    trainer = Trainer(config, resume=resume, log=lambda _: None)
    trainer.train(until=until)
    return None


def _reference_losses(config: TrainConfig) -> list[float]:
    """One process, the whole batch, no plait parallelism."""
    return _reference_run(config)[0]


def _reference_run(config: TrainConfig) -> tuple[list[float], list[float]]:
    """(losses, pre-clip global gradient norms) of the single-process run."""
    from plait.models.gpt import GPT
    from plait.train.corpus import lm_batch, load_corpus
    from plait.train.build import gpt_config, make_optimizer

    corpus = load_corpus(config.data, max_bytes=config.data_max_bytes, val_fraction=config.val_fraction)
    model = GPT(gpt_config(config, corpus.vocab_size), seed=config.seed)
    optimizer = make_optimizer(model.named_parameters(), config)
    losses, norms = [], []
    for step in range(config.steps):
        inputs, targets = lm_batch(corpus.train, step, config.global_batch, config.seq_len, seed=config.seed)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        # torch skips nothing at max_norm=inf and returns the pre-clip norm either way
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or float("inf"))
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        optimizer.step()
        losses.append(float(loss.detach()))
        norms.append(float(norm))
    return losses, norms


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference_losses(_config(tmp_path_factory.mktemp("reference")))


LAYOUTS = [dict(dp=1, tp=1, pp=1), dict(dp=2, tp=2, pp=1), dict(dp=2, tp=1, pp=2), dict(dp=1, tp=2, pp=2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: f"dp{d['dp']}-tp{d['tp']}-pp{d['pp']}")
def test_layout_matches_one_process(layout, reference, tmp_path):
    config = _config(tmp_path / "run", **layout)
    run_distributed(_train_rank, config.world_size, config, timeout_s=300)
    losses = _losses(tmp_path / "run")
    assert reference[-1] < reference[0] - 0.5, "the reference must learn, or the comparison says little"
    worst = _worst(losses, reference, STEPS)
    assert worst <= TOLERANCE, f"{layout}: max |loss - reference| = {worst:.3g} > {TOLERANCE}"


@pytest.mark.slow
def test_other_schedules_and_compression_free_paths_match(reference, tmp_path):
    """Interleaved 1F1B (2 chunks per rank) with sequence parallelism on tp=2."""
    config = _config(tmp_path / "run", dp=1, tp=2, pp=2, schedule="interleaved_1f1b", virtual=2, micro_batch=4,
                     sequence_parallel=True)
    run_distributed(_train_rank, 4, config, timeout_s=300)
    assert _worst(_losses(tmp_path / "run"), reference, STEPS) <= TOLERANCE


@pytest.mark.slow
def test_resume_is_bitwise_and_resharding_matches(tmp_path):
    whole = _config(tmp_path / "whole", dp=2, pp=2, steps=12, checkpoint_interval=6)
    run_distributed(_train_rank, 4, whole, timeout_s=300)
    expected = _losses(tmp_path / "whole")

    # stopped after 6 steps (checkpoint at 6), then resumed in the same layout
    part = whole.replace(out=str(tmp_path / "part"))
    run_distributed(_train_rank, 4, part, "auto", 6, timeout_s=300)
    assert len(_losses(tmp_path / "part")) == 6
    run_distributed(_train_rank, 4, part, timeout_s=300)
    assert len(expected) == 12
    assert _losses(tmp_path / "part") == expected  # bitwise: the same arithmetic in the same order

    # the dp2 x pp2 checkpoint at step 6 loaded into tp2 x pp2 and into one process
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_00000006"
    for layout, world in ((dict(dp=1, tp=2, pp=2), 4), (dict(dp=1, tp=1, pp=1), 1)):
        out = tmp_path / f"reshard-{world}"
        run_distributed(_train_rank, world, whole.replace(out=str(out), **layout), str(checkpoint), timeout_s=300)
        worst = _worst(_losses(out), expected[6:], 6)
        assert worst <= TOLERANCE, f"resharded into {layout}: {worst:.3g}"


@pytest.mark.slow
def test_chimera_matches_one_process(reference, tmp_path):
    """Chimera (two pipeline replicas, gradients exchanged) on tp2 x pp2."""
    config = _config(tmp_path / "chimera", dp=1, tp=2, pp=2, schedule="chimera")
    run_distributed(_train_rank, 4, config, timeout_s=300)
    assert _worst(_losses(tmp_path / "chimera"), reference, STEPS) <= TOLERANCE


CLIP = 0.5  # the pre-clip norms of this run are 1.1 to 2.5: clipping scales every step's gradient by 0.2 to 0.45


@pytest.mark.slow
def test_a_tied_head_with_gradient_clipping_matches_one_process(tmp_path):
    """A tied head (pp=1: the embedding weight is the output weight) on dp2 x tp2
    against its own single-process reference, with a max-norm small enough that
    clipping fires: the pre-clip global norm plait records (summed over dp, tp
    shards and the tied weight once) must exceed it and match torch's, and the
    clipped losses must still match torch's clip_grad_norm_ run."""
    tied = _config(tmp_path / "tied", dp=2, tp=2, pp=1, tied_head=True, grad_clip=CLIP)
    run_distributed(_train_rank, 4, tied, timeout_s=300)
    records = _records(tmp_path / "tied")
    tied_reference, reference_norms = _reference_run(tied)
    norms = [record["grad_norm"] for record in records]
    assert len(norms) == len(reference_norms) == STEPS
    assert sum(norm > CLIP for norm in norms) >= STEPS // 2, f"clipping must really fire: pre-clip norms {norms}"
    worst_norm = max(abs(a / b - 1) for a, b in zip(norms, reference_norms))
    assert worst_norm <= 1e-4, f"pre-clip norm off by {worst_norm:.3g} (relative) from torch's"
    unclipped = _reference_losses(tied.replace(grad_clip=0.0))
    assert _worst(unclipped, tied_reference, STEPS) > 100 * TOLERANCE, "clipping must change the curve"
    assert _worst([record["loss"] for record in records], tied_reference, STEPS) <= TOLERANCE


@pytest.mark.slow
def test_lossy_compression_keeps_tensor_parallel_replicas_identical(tmp_path):
    """Top-k with error feedback on dp2 x tp2: the LayerNorm, bias and position
    parameters every tp rank holds must stay bitwise equal (they are compressed in
    buckets of their own, alike on every tp rank); load_full checks it."""
    from plait.train import checkpoint as ckpt, checkpoint_load

    config = _config(tmp_path / "topk", dp=2, tp=2, pp=1, steps=6, compression="topk:0.1+ef")
    run_distributed(_train_rank, 4, config, timeout_s=300)
    losses = _losses(tmp_path / "topk")
    assert len(losses) == 6 and losses[-1] < losses[0]
    checkpoint_load.load_full(ckpt.latest_complete(tmp_path / "topk"), check_replicas=True)  # raises if replicas differ


def _train_with_a_full_disk_on_rank(rank, world_size, config, failing_rank):
    """Rank ``failing_rank``'s shard write fails as a full disk would (OSError)."""
    from plait.train import loop

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    original = loop.write_shard  # the name the trainer's save calls
    if rank == failing_rank:
        loop.write_shard = full_disk
    try:
        _train_rank(rank, world_size, config)
    finally:
        loop.write_shard = original  # the pooled worker serves later tests


@pytest.mark.slow
def test_a_failed_shard_write_is_reported_on_every_rank(tmp_path):
    from plait.testing import RankError

    config = _config(tmp_path / "run", pp=2, steps=2)
    with pytest.raises(RankError) as raised:
        run_distributed(_train_with_a_full_disk_on_rank, 2, config, 1, timeout_s=120)
    message = str(raised.value)
    assert "ranks 0, 1" in message  # both raise at once, neither waits for a timeout
    assert message.count("rank 1 could not write its shard") >= 2 and "No space left on device" in message
    assert not (tmp_path / "run" / "checkpoints" / "step_00000002" / "manifest.json").exists()
