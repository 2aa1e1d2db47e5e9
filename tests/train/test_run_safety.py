"""plait train keeps a run safe, checked on real processes (launcher -> torchrun agent
-> ranks), with what the kernel says rather than what plait says: the process tree
from /proc/*/stat, listening sockets from /proc/net/tcp{,6} and each process's
socket descriptors, files and their bytes from the disk.

- a second run on the same --out is refused at once; the first finishes intact;
- SIGTERM, SIGHUP, SIGINT or SIGKILL to the launcher, or to the agent, leave no
  process of the run alive 10 s later, the directory unlocked, and every
  checkpoint that has a manifest verifies (the run resumes from the newest);
- every listening socket of the run is bound to 127.0.0.1;
- an error in the ranks is printed once, without torchrun's traceback;
- a disk that fills up during a save is named, and nothing is counted complete;
- two launchers (--nnodes 2) train together on one shared --out.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from plait.testing import run_distributed
from plait.testing.procfs import alive, cmdline, descendants, listening_sockets
from plait.train import checkpoint as ckpt
from plait.train import runlock
from plait.train.config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.long]

WORKER = Path(__file__).with_name("agent_worker.py")
TINY = dict(layers=2, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8, micro_batch=2, dp=2,
            tp=1, pp=1, eval_interval=0, warmup_steps=2, timeout_s=60.0)
STOP_WITHIN_S = 10.0


def flags(**values) -> list[str]:
    return [item for key, value in values.items() for item in (f"--{key.replace('_', '-')}", str(value))]


def env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def launch(out: Path, log: Path, *extra: str, environment=None, **values) -> subprocess.Popen:
    """`plait train` on the tiny GPT (2 processes), output to ``log`` (stdout and stderr)."""
    command = [sys.executable, "-m", "plait", "train", *flags(**{**TINY, **values}), "--sample-chars", "0",
               "--out", str(out), *extra]
    return subprocess.Popen(command, env=environment or env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


# ----------------------------------------------------------------------------- what the kernel says
def run_tree(launcher: subprocess.Popen, ranks: int) -> tuple[int, list[int]]:
    """(agent pid, rank pids) once all of them exist."""
    def found():
        below = descendants(launcher.pid)
        agents = [pid for pid in below if "plait.train.agent" in cmdline(pid)]
        workers = [pid for pid in below if "--run-id" in cmdline(pid) and "plait.train.agent" not in cmdline(pid)]
        return (agents[0], workers) if len(agents) == 1 and len(workers) == ranks else None

    return wait_for(found, 120, f"the agent and {ranks} ranks")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train_rank(rank, world_size, config):
    from plait.train.loop import Trainer

    Trainer(config, log=lambda _: None).train()


def reference_losses(tmp_path: Path, **values) -> list[float]:
    config = TrainConfig(**{**TINY, **values, "out": str(tmp_path / "reference")})
    run_distributed(_train_rank, config.world_size, config, timeout_s=300)
    return [record["loss"] for record in records(tmp_path / "reference")]


# ----------------------------------------------------------------------------- one writer
def test_a_second_run_on_the_same_out_is_refused_and_the_first_is_intact(tmp_path):
    """The probe: run B, started 8 s after A with another seed, "resumed" A's in-flight
    checkpoint; both wrote steps 110-150 and A's results were gone.

    A's launcher is stopped (SIGSTOP) once A has a checkpoint, so A is certainly still
    running when B starts however fast its 40 steps are: a stopped launcher cannot exit
    and so holds the lock (CI once saw A finish during B's start-up). A's ranks go on.
    """
    out = tmp_path / "run"
    first = launch(out, tmp_path / "a.log", steps=40, checkpoint_interval=10)
    try:
        wait_for(lambda: (ckpt.checkpoint_dir(out, 10) / ckpt.MANIFEST_NAME).exists(), 180, "A's first checkpoint")
        os.kill(first.pid, signal.SIGSTOP)
        written_before = (out / "metrics.jsonl").read_bytes()
        try:
            second = subprocess.run([sys.executable, "-m", "plait", "train", *flags(**TINY, steps=40, seed=1),
                                     "--sample-chars", "0", "--out", str(out)], env=env(), capture_output=True,
                                    text=True, timeout=120)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"{out} is in use by another plait train run: pid {first.pid}" in second.stderr
        assert first.wait(timeout=300) == 0, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        first.kill()
    assert (out / "metrics.jsonl").read_bytes().startswith(written_before)  # B wrote nothing
    got = records(out)
    assert [record["step"] for record in got] == list(range(40))
    assert [record["loss"] for record in got] == reference_losses(tmp_path, steps=40, checkpoint_interval=10)


# ----------------------------------------------------------------------------- stop signals
@pytest.mark.parametrize("target, number", [
    ("launcher", signal.SIGTERM), ("launcher", signal.SIGHUP), ("launcher", signal.SIGINT),
    ("launcher", signal.SIGKILL), ("agent", signal.SIGTERM), ("agent", signal.SIGHUP), ("agent", signal.SIGKILL)])
def test_a_stop_signal_stops_every_process_of_the_run(target, number, tmp_path):
    """The probe: SIGTERM or SIGKILL to the launcher left torchrun and all ranks running,
    still writing into --out."""
    out = tmp_path / "run"
    launcher = launch(out, tmp_path / "run.log", steps=100_000, checkpoint_interval=2)
    try:
        agent, ranks = run_tree(launcher, ranks=2)
        wait_for(lambda: len(ckpt.list_checkpoints(out)) >= 2, 180, "two checkpoints")
        everyone = [launcher.pid, agent, *ranks]
        os.kill(launcher.pid if target == "launcher" else agent, number)
        sent = time.monotonic()
        try:
            wait_for(lambda: not any(alive(pid) for pid in everyone), STOP_WITHIN_S, "every process to exit")
        except AssertionError:
            survivors = [f"{pid} {cmdline(pid)[:80]}" for pid in everyone if alive(pid)]
            raise AssertionError(f"alive {STOP_WITHIN_S} s after {number.name} to the {target}: {survivors}")
        stopped_after_s = time.monotonic() - sent
        code = launcher.wait(timeout=30)
    finally:
        launcher.kill()
        for pid in descendants(launcher.pid):
            os.kill(pid, signal.SIGKILL)
    log = (tmp_path / "run.log").read_text()
    assert code != 0, log[-2000:]
    if target == "launcher" and number != signal.SIGKILL:
        assert code == 128 + number and f"stopped by {number.name}" in log
    assert "Traceback" not in log, log[-3000:]
    assert stopped_after_s < STOP_WITHIN_S
    assert runlock.holder(out) is None  # the directory is free for the next run
    saved = [path for path in ckpt.list_checkpoints(out) if (path / ckpt.MANIFEST_NAME).exists()]
    assert saved and all(ckpt.verify(path) == [] for path in saved)  # nothing half-written counts as complete
    steps = [record["step"] for record in records(out)]
    assert steps == list(range(len(steps)))


def test_after_a_stop_the_run_resumes_from_its_newest_checkpoint(tmp_path):
    out = tmp_path / "run"
    launcher = launch(out, tmp_path / "first.log", steps=30, checkpoint_interval=2)
    try:
        run_tree(launcher, ranks=2)
        wait_for(lambda: len(ckpt.list_checkpoints(out)) >= 2, 180, "two checkpoints")
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        launcher.kill()
    newest = ckpt.latest_complete(out, log=None)
    again = subprocess.run([sys.executable, "-m", "plait", "train", *flags(**TINY, steps=30, checkpoint_interval=2),
                            "--sample-chars", "0", "--out", str(out)], env=env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resuming from {newest}" in again.stdout
    got = records(out)
    assert [record["step"] for record in got] == list(range(30))
    assert [record["loss"] for record in got] == reference_losses(tmp_path, steps=30, checkpoint_interval=2)


# ----------------------------------------------------------------------------- loopback
def test_every_listening_socket_of_the_run_is_on_loopback(tmp_path):
    """The probe: torchrun's c10d store listened on *:PORT (two ports, no authentication)."""
    out = tmp_path / "run"
    launcher = launch(out, tmp_path / "run.log", steps=100_000, checkpoint_interval=0)
    try:
        agent, ranks = run_tree(launcher, ranks=2)
        wait_for(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size, 180,
                 "the first step")
        sockets = listening_sockets([launcher.pid, agent, *ranks])
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    by_process = defaultdict(list)
    for pid, address, port in sockets:
        by_process[pid].append(address)
    assert len(by_process[agent]) >= 2, sockets  # the rendezvous store and the store shared with the ranks
    assert all(by_process[rank] for rank in ranks), sockets  # gloo's listener in every rank
    assert {address for _, address, _ in sockets} == {"127.0.0.1"}, sockets


# ----------------------------------------------------------------------------- errors once
def _agent(mode: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait.train.agent", "--nnodes", "1", "--nproc-per-node", "3",
                           "--rdzv-backend", "plait-c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "t",
                           "--local-addr", "127.0.0.1", "--monitor-interval", "0.2", str(WORKER), mode],
                          env=env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("mode, first_line, other_line", [
    ("same", "plait train: ranks 0-2 failed: ValueError: every rank found the bad value 7: use 8", None),
    ("one", "plait train: rank 1 failed: ValueError: rank one found the bad value 42: use 43",
     "plait train: ranks 0, 2 stopped after it: killed by SIGTERM"),
])
def test_a_rank_error_is_printed_once_without_torchruns_traceback(mode, first_line, other_line, tmp_path):
    result = _agent(mode, tmp_path)
    assert result.returncode == 2  # a user error: the plait command's status for one
    lines = result.stderr.strip().splitlines()
    assert lines[0] == first_line, result.stderr
    assert result.stderr.count("bad value") == 1
    assert lines[1:] == ([other_line] if other_line else [])
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


def test_a_diverged_run_is_one_line_without_a_traceback(tmp_path):
    """Before: LossScaleError (a RuntimeError) was taken for a bug: its line, then the
    rank's traceback, exit 1. Now it is a plait.errors.PlaitError: one line, exit 2."""
    result = _agent("diverged", tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "plait train: ranks 0-2 failed: LossScaleError: the gradients held inf or NaN at 1 steps in a row; the loss "
        "scale is down to 32768: the model diverged (lower the learning rate, or train in bf16 or fp32)"], \
        result.stderr
    assert "Traceback" not in result.stderr


def test_a_bug_in_a_rank_is_printed_once_with_its_traceback(tmp_path):
    result = _agent("bug", tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("plait train: rank 0 failed: ZeroDivisionError: division by zero\n")
    assert result.stderr.count("Traceback") == 1 and "agent_worker.py" in result.stderr
    assert _agent("ok", tmp_path).returncode == 0


def test_a_killed_rank_is_named_once(tmp_path):
    out = tmp_path / "run"
    launcher = launch(out, tmp_path / "run.log", environment=env(PLAIT_FAULT_KILL="1:3"), steps=20,
                      checkpoint_interval=2)
    assert launcher.wait(timeout=300) != 0
    log = (tmp_path / "run.log").read_text()
    assert log.count("rank 1 failed: killed by SIGKILL") == 1, log[-3000:]
    assert "Traceback" not in log and "ChildFailedError" not in log
    assert f"The newest complete checkpoint is {ckpt.checkpoint_dir(out, 2)}" in log


# ----------------------------------------------------------------------------- a disk that fills up
def test_a_disk_filling_up_during_a_save_is_named_and_nothing_counts_complete(tmp_path):
    from plait.train import budget
    from plait.train.build import load_data

    config = TrainConfig(**TINY, steps=6, checkpoint_interval=1, keep_checkpoints=0)
    one = budget.checkpoint_bytes(config, load_data(config))
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    size_kib = (int(1.6 * one) + (96 << 10)) // 1024  # room for one checkpoint (and the small files), not two
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a small tmpfs needs root (CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        out = mount_point / "run"
        launcher = launch(out, tmp_path / "run.log", steps=6, checkpoint_interval=1, keep_checkpoints=0)
        code = launcher.wait(timeout=300)
        log = (tmp_path / "run.log").read_text()
        assert code != 0, log[-3000:]
        assert log.count("no space left on device writing") == 1, log[-3000:]
        assert "Traceback" not in log and "unexpected pos" not in log
        assert f"{out / 'checkpoints' / 'step_00000002' / 'tp0-pp0.pt'}: it needs about" in log
        assert [path.name for path in ckpt.list_checkpoints(out)] == ["step_00000001", "step_00000002"]
        assert ckpt.verify(ckpt.checkpoint_dir(out, 1)) == []
        assert not (ckpt.checkpoint_dir(out, 2) / ckpt.MANIFEST_NAME).exists()  # not counted complete
        assert ckpt.latest_complete(out, log=None) == ckpt.checkpoint_dir(out, 1)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


# ----------------------------------------------------------------------------- several nodes
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Two processes per node, as in one world of two: each rank then uses one thread of the two cores, and the
# floating-point sums are the same bit for bit (one process per node would use two threads each).
TWO_NODES = dict(pp=2, steps=6, checkpoint_interval=3)


def _two_nodes(tmp_path: Path, out: Path, second_node_flags=()) -> list[tuple[int, str]]:
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [launch(out, tmp_path / f"node{index}.log", "--nnodes", "2", "--rdzv-endpoint", endpoint,
                    *(second_node_flags if index else ()), **TWO_NODES)
             for index in range(2)]
    try:
        return [(node.wait(timeout=300), (tmp_path / f"node{index}.log").read_text())
                for index, node in enumerate(nodes)]
    finally:
        for node in nodes:
            node.kill()


def test_two_nodes_share_one_out_and_match_one_node(tmp_path):
    out = tmp_path / "run"
    results = _two_nodes(tmp_path, out)
    assert [code for code, _ in results] == [0, 0], "\n".join(log[-2000:] for _, log in results)
    assert [record["loss"] for record in records(out)] == reference_losses(tmp_path, **TWO_NODES)
    assert json.loads((out / "report.json").read_text())["run"]["world_size"] == 4
    assert runlock.holder(out) is None


def test_nodes_launched_with_different_configs_say_so_once_per_node(tmp_path):
    """A rank-side error (only the ranks see every node's config): one line per node."""
    results = _two_nodes(tmp_path, tmp_path / "run", second_node_flags=("--lr", "0.001"))
    for code, log in results:
        assert code != 0
        assert log.count("have a different config from rank 0's") == 1, log[-3000:]
        assert "Traceback" not in log
