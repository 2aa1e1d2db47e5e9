"""plait train through real torchrun agents: a rank killed mid-run (elastic restart
from the last complete checkpoint), and two "nodes" on 127.0.0.1 training together.

Both are compared with the same job run in one world of the test harness: the
ranks do the same arithmetic in the same order, so the loss curves must be equal
bit for bit (no tolerance is needed: nothing here reorders a floating-point sum).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from plait.testing import run_distributed
from plait.train.config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.long]


def _config(out, **overrides) -> TrainConfig:
    values = dict(layers=2, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8, micro_batch=2,
                  dp=2, tp=1, pp=2, steps=10, warmup_steps=2, eval_interval=5, eval_batches=1,
                  checkpoint_interval=4, keep_checkpoints=0, out=str(out), timeout_s=60.0)
    values.update(overrides)
    return TrainConfig(**values)


def _train_rank(rank, world_size, config):
    from plait.train.loop import Trainer

    Trainer(config, log=lambda _: None).train()


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def test_a_killed_rank_restarts_from_the_last_checkpoint_and_loses_nothing(tmp_path):
    expected = _config(tmp_path / "expected")
    run_distributed(_train_rank, 4, expected, timeout_s=300)

    config = _config(tmp_path / "killed")
    config_file = tmp_path / "job.toml"
    config_file.write_text(config.to_toml())
    # rank 3 SIGKILLs itself before step 6 of the first attempt; the last checkpoint is step 4
    result = subprocess.run([sys.executable, "-m", "plait", "train", "--config", str(config_file),
                             "--max-restarts", "1", "--sample-chars", "20"],
                            env=_env(PLAIT_FAULT_KILL="3:6"), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resuming from" in result.stdout + result.stderr
    killed = _records(tmp_path / "killed")
    assert [record["step"] for record in killed] == list(range(10))  # every step once, none lost or repeated
    assert [r["loss"] for r in killed] == [r["loss"] for r in _records(tmp_path / "expected")]
    assert [r.get("val_loss") for r in killed] == [r.get("val_loss") for r in _records(tmp_path / "expected")]
    assert (tmp_path / "killed" / "report.md").exists()
    assert "sample from the trained model" in result.stdout


def test_two_nodes_on_localhost_match_one_node(tmp_path):
    # the reference run's messages go over gloo, the torchrun one's through shared memory:
    # the transport must not change a bit of the losses
    expected = _config(tmp_path / "one-node", steps=5, checkpoint_interval=0, transport="gloo")
    run_distributed(_train_rank, 4, expected, timeout_s=300)

    config = _config(tmp_path / "two-nodes", steps=5, checkpoint_interval=0)
    config_file = tmp_path / "job.toml"
    config_file.write_text(config.to_toml())
    port = _free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-nodes-{port}",
                                "-m", "plait", "train", "--config", str(config_file)],
                               env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=300)[0])
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(output[-2000:] for output in outputs)
    got, want = _records(tmp_path / "two-nodes"), _records(tmp_path / "one-node")
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    report = json.loads((tmp_path / "two-nodes" / "report.json").read_text())
    assert report["ranks_reported"] == 4 and report["run"]["world_size"] == 4
    # both agents run on this host: every group of every rank talks through shared memory
    # (tp=1: its groups of one rank send nothing)
    transports = report["collectives"]["transports"]
    assert sorted(transports) == ["0", "1", "2", "3"]
    assert all(description.startswith("shm with group ranks" if group != "tp" else "none")
               for by_group in transports.values() for group, description in by_group.items()), transports
    assert transports["0"]["world"].startswith("shm with group ranks [0, 1, 2, 3]")
    reference = json.loads((tmp_path / "one-node" / "report.json").read_text())["collectives"]["transports"]
    assert reference["0"]["world"] == "gloo", reference
