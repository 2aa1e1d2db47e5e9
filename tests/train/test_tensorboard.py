"""plait train --log tensorboard: OUT/tensorboard holds TensorBoard event files whose
scalars, read back with TensorBoard's own EventAccumulator, equal metrics.jsonl's
numbers exactly (written as float64 tensor summaries) at every step:

- a real tp=2 run (HF GPT-2, the session's run of tests/train/test_export_hf.py): loss, lr,
  grad_norm, tokens_per_s, step_s, the memory peaks and comm_tp_s (seconds in the tp
  group's collectives, > 0 at tp=2) for every step of metrics.jsonl;
- the metrics log alone (one process, no collective at dp 1): a resume from step 2
  replaces the events of steps 2.. (purge_step) as metrics.jsonl is cut back, and
  without --log tensorboard no event file is written.

Seen failing on the pre-issue code (PYTHONPATH=/work/base34/src): MetricsLog takes no
tensorboard_dir there (TypeError), and TrainConfig has no ``log`` field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.train.metrics import MetricsLog
from plait.train.tensorboard_log import TENSORBOARD_DIR, read_scalars


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_runs_events_equal_its_metrics_jsonl(hf_tp2_run):
    config, _ = hf_tp2_run
    out = Path(config.out)
    records = _metrics(out)
    assert [record["step"] for record in records] == list(range(config.steps))
    scalars = read_scalars(out / TENSORBOARD_DIR)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_s", "saved_peak_bytes", "resident_peak_bytes",
                "comm_tp_s"):
        assert key in scalars, key
    for record in records:
        for key, value in record.items():
            if key != "step":
                assert scalars[key][record["step"]] == value, (key, record["step"])  # exactly: float64 events
    assert all(record["comm_tp_s"] > 0 for record in records)


def _log(path, start_step, losses, tensorboard_dir):
    log = MetricsLog(path, group=None, dp_size=1, write=True, interval=2, start_step=start_step,
                     tensorboard_dir=tensorboard_dir)
    for step, loss in losses.items():
        log.add({"step": step, "loss": loss, "lr": 0.1 * step, "tokens_per_s": 1e3 + step})
        if log.flush_due(step, last=step == max(losses)):
            log.flush()
    log.close()


def test_a_resume_replaces_the_events_of_the_steps_it_redoes(tmp_path):
    events = tmp_path / TENSORBOARD_DIR
    _log(tmp_path / "metrics.jsonl", 0, {0: 4.0, 1: 3.5, 2: 3.25, 3: 3.0}, events)
    _log(tmp_path / "metrics.jsonl", 2, {2: 2.5, 3: 2.0}, events)  # resumed from the step-2 checkpoint
    want = {record["step"]: record["loss"] for record in _metrics(tmp_path)}
    assert want == {0: 4.0, 1: 3.5, 2: 2.5, 3: 2.0}
    scalars = read_scalars(events)
    assert scalars["loss"] == want
    assert scalars["lr"] == {step: 0.1 * step for step in range(4)}
    assert sorted(scalars) == ["loss", "lr", "tokens_per_s"]
    _log(tmp_path / "other.jsonl", 0, {0: 1.0}, None)
    assert len(list(events.iterdir())) == 2  # one event file per writer; none without a tensorboard_dir
