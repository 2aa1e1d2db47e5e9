"""The run report's step parts: measured by timers around the real calls, set beside the
plan's price of the same layout, a drift flagged with the part that caused it.

One 2-process run (pp=2, a tiny float64 GPT) twice in one world: plain, then with a
data source sleeping DATA_SLEEP_S per batch, an optimizer whose step sleeps
OPTIMIZER_SLEEP_S, and the first stage's backward sleeping BACKWARD_SLEEP_S per
micro-batch (a gradient hook on one of its parameters). time.sleep(N) sleeps at least
N, so the injected run's data part per step is >= the plain one's + N (less the plain
run's own data time, which is < 1 ms) and its optimizer part likewise; a late wake-up
or the shared machine adds at most SLACK_S. The backward sleeps are the first stage's
compute (M per step on pp rank 0, M micro-batches) and, as 1F1B's first stage runs the
last backward, the pipeline's drain on pp rank 1: it waits M x BACKWARD_SLEEP_S longer
for the step's closing loss sum, which is pp_bubble (it waits before pp rank 0 posted
its part; plait.train.step_breakdown), not dp_comm: dp_comm stays within SLACK_S of the
plain run's (the collectives' own cost, < 1 ms here, not the wait for the drain). The
other parts are not touched by the sleeps: they stay within SLACK_S of the plain run's
per step. The parts add up to the wall by construction (other = the rest): checked to
float64 rounding (1e-9 relative over a few additions).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from plait.cli.main import main
from plait.names.step_parts import COMPUTE, DATA, DP_COMM, OPTIMIZER, PP_BUBBLE, STEP_PARTS
from plait.parallel.hybrid import remainder_s
from plait.parallel.step_times import StepTimes
from plait.testing import run_distributed
from plait.train.build import batch
from plait.train.config import TrainConfig
from plait.train.loop import Trainer
from plait.train.plan_compare import comparison_lines

DATA_SLEEP_S = 0.080
OPTIMIZER_SLEEP_S = 0.040
BACKWARD_SLEEP_S = 0.040  # per micro-batch backward of the first stage
MICROBATCHES = 2  # global_batch 4 / micro_batch 2
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
    stages = trainer.hybrid.engine.stages
    if 0 in stages:  # the first stage's backward sleeps once per micro-batch (its first parameter's gradient)
        next(stages[0].parameters()).register_hook(lambda grad: time.sleep(BACKWARD_SLEEP_S))
    trainer.train()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("step-parts")
    plain, injected = root / "plain", root / "injected"
    run_distributed(_plain_and_injected, 2, str(plain), str(injected), timeout_s=120)
    return {name: json.loads((path / "report.json").read_text()) | {"dir": str(path)}
            for name, path in (("plain", plain), ("injected", injected))}


def _per_step_s(report, part) -> list[float]:
    """Each rank's mean seconds per steady step in ``part``, in pipeline-rank order."""
    per_rank = report["step_parts"]["measured"]["per_rank_ms"]
    pp_of = {str(rank["rank"]): rank["coords"]["pp"] for rank in report["ranks"]}
    return [row[part] / 1e3 for rank, row in sorted(per_rank.items(), key=lambda item: pp_of[item[0]])]


@pytest.mark.slow
def test_injected_delays_show_in_their_parts_only(runs):
    plain, injected = runs["plain"], runs["injected"]
    drain_s = MICROBATCHES * BACKWARD_SLEEP_S
    # (part, pipeline rank) -> the sleep it must gain per step
    expected = {(DATA, 0): DATA_SLEEP_S, (DATA, 1): DATA_SLEEP_S, (OPTIMIZER, 0): OPTIMIZER_SLEEP_S,
                (OPTIMIZER, 1): OPTIMIZER_SLEEP_S, (COMPUTE, 0): drain_s, (PP_BUBBLE, 1): drain_s}
    for name in STEP_PARTS:
        for pp, (base_s, slow_s) in enumerate(zip(_per_step_s(plain, name), _per_step_s(injected, name))):
            sleep_s = expected.get((name, pp))
            if sleep_s is None:
                assert abs(slow_s - base_s) <= SLACK_S, (name, pp, base_s, slow_s)
            elif name == PP_BUBBLE:  # a wait: the other rank's sleep (its post of the loss sum), not this rank's
                assert abs(slow_s - base_s - sleep_s) <= SLACK_S, (name, pp, base_s, slow_s)
            elif name == COMPUTE:  # the sleeps are in it; its own kernels (8 ms) may run faster beside an idle peer
                assert sleep_s <= slow_s <= base_s + sleep_s + SLACK_S, (name, pp, base_s, slow_s)
            else:
                assert sleep_s - 1e-3 <= slow_s - base_s <= sleep_s + SLACK_S, (name, pp, base_s, slow_s)
    # the drain is not the loss sum's cost: dp_comm stays small on both ranks
    assert all(seconds <= SLACK_S for seconds in _per_step_s(injected, DP_COMM)), _per_step_s(injected, DP_COMM)


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


def test_other_is_the_honest_remainder():
    # parts of 1.5 + 0.5 s: within float rounding of a 2 s wall the remainder is 0, not -ulp
    rounded = StepTimes(wall_s=2.0, compute_s=1.5, dp_comm_s=0.5 + 1e-12)
    assert remainder_s(rounded) == 0.0
    assert remainder_s(StepTimes(wall_s=2.0, compute_s=1.5, dp_comm_s=0.25)) == 0.25
    # an over-count (two timers overlapping by 0.1 s) is kept: the parts still add up to the wall
    over = StepTimes(wall_s=2.0, compute_s=1.5, dp_comm_s=0.6)
    over.other_s = remainder_s(over)
    assert over.other_s == pytest.approx(-0.1, rel=1e-12)
    assert sum(getattr(over, name) for name in ("compute_s", "dp_comm_s", "other_s")) == pytest.approx(2.0, rel=1e-15)
