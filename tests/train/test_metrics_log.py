"""plait.train.metrics: metrics.jsonl written every log_interval steps, losses averaged
over the dp ranks in one collective per flush, the same bits however steps are grouped.

Single-process: the cadence, the file (held back until a flush, then appended; cut
back on restart), and the refusals. Multi-process (slow): the mean over dp ranks, added
in rank order, bitwise the same whether a flush holds one step or many; and a
training run at dp=2 makes one gradient all-reduce per step and one metrics
all-gather per flush, nothing else on the dp group.
"""

from __future__ import annotations

import json
import math

import pytest

from plait.testing import run_distributed
from plait.train.config import TrainConfig
from plait.train.metrics import MetricsLog, read_metrics


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_flush_is_due_every_interval_at_the_end_and_at_checkpoints(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl", group=None, dp_size=1, write=False, interval=4)
    assert [step for step in range(12) if log.flush_due(step)] == [3, 7, 11]
    assert log.flush_due(5, last=True) and log.flush_due(5, checkpoint=True)
    assert not log.flush_due(5)
    every = MetricsLog(tmp_path / "m.jsonl", group=None, dp_size=1, write=False, interval=1)
    assert all(every.flush_due(step) for step in range(5))


def test_records_are_held_until_a_flush_then_appended(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, group=None, dp_size=1, write=True, interval=3)
    for step in range(2):
        log.add({"step": step, "loss": 1.0 + step})
    assert _lines(path) == []  # nothing written before the flush
    flushed = log.flush()
    assert [record["step"] for record in flushed] == [0, 1]
    assert _lines(path) == [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 2.0}]  # one process: its own loss
    assert log.flush() == []  # nothing held: nothing written
    log.add({"step": 2, "loss": 3.5})
    log.flush()
    log.close()
    assert [record["step"] for record in _lines(path)] == [0, 1, 2]
    assert [record["step"] for record in log.records] == [0, 1, 2]


def test_a_restart_cuts_the_file_back_to_the_steps_before_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "loss": float(step)}) + "\n" for step in range(6))
                    + '{"step": 6, "lo')  # a line cut by a crash
    log = MetricsLog(path, group=None, dp_size=1, write=True, interval=10, start_step=4)
    assert [record["step"] for record in log.records] == [0, 1, 2, 3]
    assert [record["step"] for record in _lines(path)] == [0, 1, 2, 3]
    log.add({"step": 4, "loss": 9.0})
    log.close()  # held records of a run that stopped between flushes are dropped
    assert [record["step"] for record in read_metrics(path, before=100)] == [0, 1, 2, 3]


def test_only_the_writer_touches_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, group=None, dp_size=1, write=False, interval=1)
    log.add({"step": 0, "loss": 1.0})
    assert log.flush()[0]["loss"] == 1.0
    log.close()
    assert not path.exists() and log.records == []


@pytest.mark.parametrize("interval", [0, -1, 1.5, True])
def test_a_bad_interval_is_refused(tmp_path, interval):
    with pytest.raises(ValueError, match="log interval must be an int >= 1"):
        MetricsLog(tmp_path / "m.jsonl", group=None, dp_size=1, write=False, interval=interval)


def test_log_interval_is_a_config_field_with_a_default_of_ten():
    assert TrainConfig().log_interval == 10
    with pytest.raises(ValueError, match="log_interval=0 must be >= 1"):
        TrainConfig(log_interval=0)


# ----- multi-process ------------------------------------------------------------------------
# per rank and step: values whose float64 sum depends on the order they are added in
LOSSES = [[1.0, 0.1, 1e16, 3.0, 2.5], [1e16, 0.2, 1.0, -1e16, 2.5], [-1e16, 0.3, -1e16, 1.0, 7.0]]


def _flushed_losses(rank, world_size, path, groups):
    log = MetricsLog(path, group=None, dp_size=world_size, write=rank == 0, interval=1)
    losses, step = [], 0
    for size in groups:  # flush after ``size`` steps each time
        for _ in range(size):
            log.add({"step": step, "loss": LOSSES[rank][step]})
            step += 1
        losses += [record["loss"] for record in log.flush()]
    log.close()
    return losses


@pytest.mark.slow
def test_the_mean_over_dp_ranks_has_the_same_bits_however_steps_share_a_flush(tmp_path):
    world_size, steps = 3, len(LOSSES[0])
    expected = []
    for step in range(steps):
        total = 0.0
        for rank in range(world_size):  # rank order
            total += LOSSES[rank][step]
        expected.append(total / world_size)
    one_by_one = run_distributed(_flushed_losses, world_size, str(tmp_path / "a.jsonl"), [1] * steps)
    all_at_once = run_distributed(_flushed_losses, world_size, str(tmp_path / "b.jsonl"), [steps])
    mixed = run_distributed(_flushed_losses, world_size, str(tmp_path / "c.jsonl"), [2, 3])
    for result in (one_by_one, all_at_once, mixed):
        assert all(losses == expected for losses in result), (result, expected)  # every rank, bitwise
    assert [record["loss"] for record in _lines(tmp_path / "b.jsonl")] == expected
    assert math.isclose(expected[1], 0.2)


def _train_and_count(rank, world_size, config):
    from plait import comm
    from plait.train.loop import Trainer

    trainer = Trainer(config, resume="never", log=lambda _: None)
    trainer.train()
    return {name: entry["calls"] for name, entry in comm.stats(trainer.mesh.group["dp"]).items()}


@pytest.mark.slow
def test_a_dp_run_makes_one_gradient_all_reduce_per_step_and_one_metrics_collective_per_flush(tmp_path):
    config = TrainConfig(layers=2, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8,
                         micro_batch=4, dp=2, tp=1, pp=1, steps=7, log_interval=3, eval_interval=0,
                         checkpoint_interval=0, keep_checkpoints=0, out=str(tmp_path / "run"), timeout_s=60.0)
    counts = run_distributed(_train_and_count, 2, config, timeout_s=300)
    for calls in counts:
        # 7 steps: one all-reduce of the whole gradient (< 25 MiB) each; flushes after steps 2, 5 and 6
        assert calls == {"all_reduce": 7, "all_gather": 3}, calls
    records = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [record["step"] for record in records] == list(range(7))
