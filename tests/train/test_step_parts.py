"""The run report's step parts: measured by timers around the real calls, set beside the
plan's price of the same layout, a drift flagged with the part that caused it.

One 2-process run (pp=2, a tiny float64 GPT) twice in one world: plain, then with a
data source sleeping DATA_SLEEP_S per batch and an optimizer whose step sleeps
OPTIMIZER_SLEEP_S. time.sleep(N) sleeps at least N, so the injected run's data part
per step is >= the plain one's + N (less the plain run's own data time, which is
< 1 ms) and its optimizer part likewise; a late wake-up or the shared machine adds at
most SLACK_S. The other parts are not touched by the sleeps: they stay within
SLACK_S of the plain run's per step. The parts add up to the wall by construction
(other = the rest): checked to float64 rounding (1e-9 relative over a few additions).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from plait.cli.main import main
from plait.names.step_parts import DATA, OPTIMIZER, STEP_PARTS
from plait.testing import run_distributed
from plait.train.build import batch
from plait.train.config import TrainConfig
from plait.train.loop import Trainer
from plait.train.plan_compare import comparison_lines

DATA_SLEEP_S = 0.080
OPTIMIZER_SLEEP_S = 0.040
SLACK_S = 0.030  # a sleeping process woken late, or a time slice lost on the shared 2-core machine
STEPS = 5


class SleepyAdamW(torch.optim.AdamW):
    """AdamW whose step first sleeps OPTIMIZER_SLEEP_S (a slow optimizer)."""

    def step(self, closure=None):
        time.sleep(OPTIMIZER_SLEEP_S)
        return super().step(closure)


def _sleepy_optimizer(named_parameters, config):
    return SleepyAdamW([param for _, param in named_parameters], lr=config.lr)


def _config(out) -> TrainConfig:
    return TrainConfig(layers=2, hidden=16, heads=2, seq_len=8, data_max_bytes=20_000, global_batch=4, micro_batch=2,
                       dp=1, tp=1, pp=2, steps=STEPS, warmup_steps=0, dtype="float64", eval_interval=0,
                       grad_clip=0.0, checkpoint_interval=0, keep_checkpoints=0, log_interval=STEPS,
                       out=str(out), timeout_s=60.0)


def _plain_and_injected(rank, world_size, plain_out, injected_out):
    Trainer(_config(plain_out), resume="never", log=lambda _: None).train()
    config = _config(injected_out)
    trainer = None

    def sleepy_source(step, dp_rank, dp_size):
        time.sleep(DATA_SLEEP_S)
        return batch(config, trainer.data, step, dp_rank, dp_size)

    trainer = Trainer(config, resume="never", log=lambda _: None, batch_source=sleepy_source,
                      optimizer_factory=_sleepy_optimizer)
    trainer.train()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("step-parts")
    plain, injected = root / "plain", root / "injected"
    run_distributed(_plain_and_injected, 2, str(plain), str(injected), timeout_s=120)
    return {name: json.loads((path / "report.json").read_text()) | {"dir": str(path)}
            for name, path in (("plain", plain), ("injected", injected))}


def _per_step_s(report, part) -> list[float]:
    """Each rank's mean seconds per steady step in ``part``."""
    per_rank = report["step_parts"]["measured"]["per_rank_ms"]
    return [row[part] / 1e3 for _, row in sorted(per_rank.items())]


@pytest.mark.slow
def test_injected_delays_show_in_their_parts_only(runs):
    plain, injected = runs["plain"], runs["injected"]
    for name, sleep_s in ((DATA, DATA_SLEEP_S), (OPTIMIZER, OPTIMIZER_SLEEP_S)):
        for base_s, slow_s in zip(_per_step_s(plain, name), _per_step_s(injected, name)):
            assert sleep_s - 1e-3 <= slow_s - base_s <= sleep_s + SLACK_S, (name, base_s, slow_s)
    for name in STEP_PARTS:
        if name in (DATA, OPTIMIZER):
            continue
        for base_s, slow_s in zip(_per_step_s(plain, name), _per_step_s(injected, name)):
            assert abs(slow_s - base_s) <= SLACK_S, (name, base_s, slow_s)


@pytest.mark.slow
def test_parts_add_up_to_the_wall_on_every_rank(runs):
    for report in runs.values():
        for rank, row in report["step_parts"]["measured"]["per_rank_ms"].items():
            assert sum(row[part] for part in STEP_PARTS) == pytest.approx(row["wall"], rel=1e-9), rank
            assert all(row[part] >= 0 for part in STEP_PARTS), row
        # every step's record holds rank 0's parts, adding up to its step time
        for line in (Path(report["dir"]) / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            parts = [value for key, value in record.items() if key.startswith("part_")]
            assert len(parts) == 8 and sum(parts) == pytest.approx(record["step_s"], rel=1e-9), record
        stages = report["step_parts"]["measured"]["stage_compute_ms"]
        assert sorted(stages) == ["0", "1"] and all(value > 0 for value in stages.values())
        # the coarse split of earlier reports is the same time: compute + comm + bubble + other = wall
        for row in report["ranks"]:
            assert row["compute_s"] + row["comm_s"] + row["bubble_s"] + row["other_s"] == \
                pytest.approx(row["wall_s"], rel=1e-9)


@pytest.mark.slow
def test_drift_flag_names_the_injected_part(runs):
    comparison = runs["injected"]["step_parts"]["comparison"]
    assert comparison is not None, runs["injected"]["step_parts"]["not_priced"]
    assert comparison["flag"]["part"] == DATA and comparison["flag"]["drift"] > 0.25
    assert comparison["parts"][DATA]["plan_ms"] == 0.0
    lines = comparison_lines(runs["injected"]["step_parts"])
    assert any(line.startswith("DRIFT:") and "data" in line for line in lines)
    markdown = (Path(runs["injected"]["dir"]) / "report.md").read_text()
    assert "## Plan vs measured" in markdown and "DRIFT:" in markdown


@pytest.mark.slow
def test_explain_run_prints_the_table_and_refuses_a_non_run(runs, tmp_path, capsys):
    assert main(["plan", "--explain-run", runs["plain"]["dir"]]) == 0
    out = capsys.readouterr().out
    for part in STEP_PARTS:
        assert any(line.startswith(part) for line in out.splitlines()), part
    assert "plan priced with" in out
    assert main(["plan", "--explain-run", str(tmp_path)]) == 2
    assert "not a finished plait train run" in capsys.readouterr().err
