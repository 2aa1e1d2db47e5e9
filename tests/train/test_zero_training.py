"""plait train --zero-stage 1|2 [--offload optimizer]: AdamW's state and step (stage 2:
the gradients too) sharded over the dp group (plait.parallel.zero.optimizer), with
tensor and pipeline parallelism.

- float64 on dp2 x tp2 x pp2... on 4 processes dp2 x pp2 and dp2 x tp2: the loss
  curve equals --zero-stage 0 bitwise without clipping (with 2 dp ranks each averaged
  element is a + b either way, and AdamW steps each element alone), and within
  float64 roundoff with clipping (the norm sums the squares in another order:
  relative 1e-15, stated bound 1e-12);
- the optimizer state measured from live storages is 1/dp of stage 0's;
- stage 2 (each micro-batch's gradients reduce-scattered inside its backward) equals
  stage 0 within float64 roundoff (it sums over the dp ranks inside each micro-batch,
  then over micro-batches: the same terms in another order, relative ~1e-15; stated
  bound 1e-12), and keeps 1/dp of the gradients;
- stage 3 (the parameters gathered around each block's forward and backward, pp=1)
  equals stage 0 within the same roundoff, with 1/dp of the parameters, gradients
  and optimizer state held after a step; its checkpoints resume bitwise and into
  stage 0 at another dp;
- with the optimizer state offloaded to files the loss curve is bitwise the same, the
  state is out of memory (the report's optimizer_bytes: the step counts only) and the
  offload directory is gone after the run;
- a resume at the same layout is bitwise; a zero-stage-1 checkpoint resumes into
  plain data parallelism (stage 0, another dp) with the same loss to roundoff
  (checkpoints hold torch's per-parameter state, gathered from the shards), and a
  stage-2 offloaded one into stage 1 at another dp;
- bad settings are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.testing import run_distributed
from plait.train.config import TrainConfig
from tests.train import runs


def _config(out, **overrides) -> TrainConfig:
    values = dict(layers=4, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8, micro_batch=2,
                  dp=2, tp=1, pp=2, steps=4, warmup_steps=1, dtype="float64", eval_interval=0, grad_clip=0.0,
                  checkpoint_interval=0, keep_checkpoints=0, out=str(out), timeout_s=60.0)
    values.update(overrides)
    return TrainConfig(**values)


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _report_memory(out) -> list[dict]:
    return json.loads((Path(out) / "report.json").read_text())["memory"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(dp=2, pp=2), dict(dp=2, tp=2, pp=1)])
def test_zero_one_trains_as_plain_data_parallelism(tmp_path, mesh):
    configs = [_config(tmp_path / f"zero{stage}-{clip}", zero_stage=stage, grad_clip=clip, **mesh)
               for stage in (0, 1) for clip in (0.0, 0.05)]
    run_distributed(runs.train_each, 4, configs, timeout_s=300)
    plain, plain_clipped, zero, zero_clipped = (_metrics(config.out) for config in configs)
    assert [row["loss"] for row in zero] == [row["loss"] for row in plain]  # bitwise
    assert any(row["grad_norm"] > 0.05 for row in plain_clipped)  # the clipping was active
    for got, want in zip(zero_clipped, plain_clipped, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12, abs=0)
    for stage0, stage1 in zip(_report_memory(configs[0].out), _report_memory(configs[2].out)):
        assert stage1["optimizer_bytes"] * 2 == pytest.approx(stage0["optimizer_bytes"], rel=0.02)
        assert stage1["params_bytes"] >= stage0["params_bytes"]  # whole (padded to dp shards)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(dp=2, pp=2), dict(dp=2, tp=2, pp=1)])
def test_zero_two_and_offload_train_as_plain_data_parallelism(tmp_path, mesh):
    overrides = [dict(zero_stage=0), dict(zero_stage=2), dict(zero_stage=2, offload="optimizer"),
                 dict(zero_stage=1, offload="optimizer"), dict(zero_stage=1)]
    configs = [_config(tmp_path / f"run{index}", grad_clip=0.05, **mesh, **extra)
               for index, extra in enumerate(overrides)]
    run_distributed(runs.train_each, 4, configs, timeout_s=300)
    plain, zero2, zero2_offloaded, zero1_offloaded, zero1 = (_metrics(config.out) for config in configs)
    for got, want in zip(zero2, plain, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12, abs=0)
    assert [row["loss"] for row in zero2_offloaded] == [row["loss"] for row in zero2]  # bitwise
    assert [row["loss"] for row in zero1_offloaded] == [row["loss"] for row in zero1]
    memory = [_report_memory(config.out) for config in configs]
    for stage0, stage2, offloaded in zip(memory[0], memory[1], memory[2]):
        assert stage2["grads_bytes"] * 2 == pytest.approx(stage0["grads_bytes"], rel=0.02)
        assert offloaded["offloaded_bytes"] == pytest.approx(stage2["optimizer_bytes"], rel=0.02)
        assert offloaded["optimizer_bytes"] < 0.02 * stage2["optimizer_bytes"]  # the step counts
    for config in configs:
        assert not (Path(config.out) / "offload").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(dp=2, tp=2, pp=1), dict(dp=4, pp=1)])
def test_zero_three_trains_as_plain_data_parallelism(tmp_path, mesh):
    overrides = [dict(zero_stage=0), dict(zero_stage=3), dict(zero_stage=3, offload="optimizer")]
    configs = [_config(tmp_path / f"run{index}", grad_clip=0.05, **mesh, **extra)
               for index, extra in enumerate(overrides)]
    run_distributed(runs.train_each, 4, configs, timeout_s=300)
    plain, zero3, offloaded = (_metrics(config.out) for config in configs)
    for got, want in zip(zero3, plain, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12, abs=0)
    assert [row["loss"] for row in offloaded] == [row["loss"] for row in zero3]  # bitwise
    dp = mesh["dp"]
    for stage0, stage3 in zip(_report_memory(configs[0].out), _report_memory(configs[1].out)):
        # 1/dp of each, plus the padding of every unit to dp shards (a few elements each)
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert stage3[key] * dp == pytest.approx(stage0[key], rel=0.02), key
        # the gathered parameters autograd keeps for the backward are parameters, not activations
        assert stage3["saved_activations_peak_bytes"] == stage0["saved_activations_peak_bytes"]
        assert stage3["engine_activations_peak_bytes"] == stage0["engine_activations_peak_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [
    (dict(zero_stage=1), dict(zero_stage=0, dp=1, pp=2)),  # into plain data parallelism, another dp
    (dict(zero_stage=2, offload="optimizer"), dict(zero_stage=1, dp=1, pp=2)),
    (dict(zero_stage=3, dp=2, tp=2, pp=1), dict(zero_stage=0, dp=1, tp=2, pp=1)),
])
def test_zero_checkpoints_resume_bitwise_and_into_another_layout(tmp_path, saved, resumed):
    """A run stopped at step 2 and resumed at the same layout equals the run of 4 steps
    bitwise; its step-2 checkpoint, resumed by ``resumed`` on 2 processes, gives the
    same losses to float64 roundoff."""
    whole = _config(tmp_path / "whole", steps=4, **saved)
    first = _config(tmp_path / "resumed", steps=2, checkpoint_interval=2, keep_checkpoints=2, **saved)
    run_distributed(runs.train_each, 4, [whole, first], timeout_s=300)
    second = _config(tmp_path / "resumed", steps=4, checkpoint_interval=2, keep_checkpoints=2, **saved)
    run_distributed(runs.train_each, 4, [second], "auto", timeout_s=300)
    want = [row["loss"] for row in _metrics(whole.out)]
    assert [row["loss"] for row in _metrics(second.out)] == want
    checkpoint = sorted((tmp_path / "resumed" / "checkpoints").iterdir())[0]
    other = _config(tmp_path / "other", steps=4, **resumed)
    run_distributed(runs.train_each, 2, [other], str(checkpoint), timeout_s=300)
    assert [row["loss"] for row in _metrics(other.out)] == pytest.approx(want[2:], rel=1e-12, abs=0)


@pytest.mark.parametrize("overrides,message", [
    (dict(zero_stage=3), "zero_stage=3 with pp=2: stage 3 gathers"),
    (dict(zero_stage=3, pp=1, dp=4, offload_activations=True), "zero_stage=3 with offload_activations=true"),
    (dict(zero_stage=5), "zero_stage=5 is not valid: 0 (off), 1, 2 or 3"),
    (dict(zero_stage=2, schedule="chimera"), "zero_stage=2 with schedule='chimera'"),
    (dict(offload="optimizer"), "offload='optimizer' with zero_stage=0"),
    (dict(offload="cpu"), "offload='cpu' is not valid"),
    (dict(zero_stage=1, schedule="chimera"), "zero_stage=1 with schedule='chimera'"),
    (dict(zero_stage=1, compression="topk:0.01"), "zero_stage=1 with compression='topk:0.01'"),
    (dict(zero_stage=1, optimizer="sgd", grad_reduce_dtype="bf16"), "zero_stage=1 with grad_reduce_dtype='bf16'"),
])
def test_bad_zero_settings_are_named(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(tmp_path, **overrides)
