"""Nothing plait writes, truncates or deletes under a run directory (or at an export's
--out) goes through a symbolic link, or replaces a device node, FIFO or socket (issue 31,
the siblings of the linked-step-directory finding). Every test puts a victim file
outside the run, links to it from where plait writes, and byte-compares it afterwards."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.testing import run_distributed
from plait.train import runlock
from plait.train.metrics import MetricsLog
from plait.train.offload_dirs import prepare_offload_dir, remove_offload_dir
from plait.train.report import write_report
from tests.train.test_checkpoint import build_reference, save
from tests.train.test_report import _synthetic_run

VICTIM_BYTES = b"another user's data: never to be touched by plait\n"


def _victim(tmp_path: Path, name: str) -> Path:
    victims = tmp_path / "victims"
    victims.mkdir(exist_ok=True)
    victim = victims / name
    victim.write_bytes(VICTIM_BYTES)
    return victim


def _run_dir(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    return out


# ---- the run lock -------------------------------------------------------------------------

def test_a_linked_lock_is_refused_by_name_and_its_target_kept(tmp_path):
    out, victim = _run_dir(tmp_path), _victim(tmp_path, "victim_lock.txt")
    (out / runlock.LOCK_NAME).symlink_to(victim)
    with pytest.raises(ValueError, match=r"\.lock is a symbolic link; plait never writes, truncates or deletes"):
        runlock.acquire(out, "run-a")
    with pytest.raises(ValueError, match=r"\.lock is a symbolic link"):
        runlock.check_free(out, "run-a")
    assert victim.read_bytes() == VICTIM_BYTES


def test_a_dangling_lock_link_creates_nothing_at_its_target(tmp_path):
    out = _run_dir(tmp_path)
    target = tmp_path / "elsewhere" / "made_by_plait"
    target.parent.mkdir()
    (out / runlock.LOCK_NAME).symlink_to(target)
    with pytest.raises(ValueError, match=r"\.lock is a symbolic link"):
        runlock.acquire(out, "run-a")
    assert not target.exists()


# ---- the report, the metrics log ------------------------------------------------------------

def test_the_report_replaces_links_never_their_targets(tmp_path):
    out = _run_dir(tmp_path)
    victims = {name: _victim(tmp_path, f"victim-{name}") for name in ("loss.png", "report.json", "report.md")}
    for name, victim in victims.items():
        (out / name).symlink_to(victim)
    metrics, ranks, run = _synthetic_run()
    write_report(out, metrics=metrics, ranks=ranks, run=run)
    for name, victim in victims.items():
        assert victim.read_bytes() == VICTIM_BYTES, f"{name}'s link target was written through"
        assert stat.S_ISREG(os.lstat(out / name).st_mode), f"{name} is still a link"
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stat.S_IMODE(os.stat(out / "report.json").st_mode) == 0o666 & ~_umask(), "not the mode open() gives"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_the_metrics_log_writes_through_no_link(tmp_path):
    out = _run_dir(tmp_path)
    temporary_victim = _victim(tmp_path, "victim-metrics.tmp")
    (out / "metrics.tmp").symlink_to(temporary_victim)  # the fixed temporary name the log used to write first
    log = MetricsLog(out / "metrics.jsonl", group=None, dp_size=1, write=True, interval=1)
    log.add({"step": 0, "loss": 1.5})
    log.flush()
    log.close()
    assert temporary_victim.read_bytes() == VICTIM_BYTES
    assert (out / "metrics.jsonl").read_text() == '{"step": 0, "loss": 1.5}\n'

    other = tmp_path / "second-run"
    other.mkdir()
    victim = _victim(tmp_path, "victim-metrics.jsonl")
    (other / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ValueError, match=r"metrics\.jsonl is a symbolic link"):
        MetricsLog(other / "metrics.jsonl", group=None, dp_size=1, write=True, interval=1)
    assert victim.read_bytes() == VICTIM_BYTES and (other / "metrics.jsonl").is_symlink()


# ---- the offload directory ----------------------------------------------------------------

def test_removing_a_linked_offload_directory_deletes_nothing_it_points_to(tmp_path):
    out = _run_dir(tmp_path)
    victim_dir = tmp_path / "victimdir"
    (victim_dir / "rank0").mkdir(parents=True)
    (victim_dir / "rank0" / "thesis.tex").write_bytes(VICTIM_BYTES)
    (out / "offload").symlink_to(victim_dir)
    remove_offload_dir(out, 0)
    assert (victim_dir / "rank0" / "thesis.tex").read_bytes() == VICTIM_BYTES
    (out / "offload").unlink()
    (out / "offload").mkdir()
    (out / "offload" / "rank0").symlink_to(victim_dir / "rank0")
    remove_offload_dir(out, 0)
    assert (victim_dir / "rank0" / "thesis.tex").read_bytes() == VICTIM_BYTES
    (out / "offload" / "rank0").unlink()
    (out / "offload" / "rank0" / "nested").mkdir(parents=True)  # a real one is removed, offload/ with it
    remove_offload_dir(out, 0)
    assert not (out / "offload").exists()


def _prepare(rank, world_size, out):
    try:
        prepare_offload_dir(Path(out), rank, world_size, ["offload_activations"])
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_a_linked_offload_rank_directory_is_refused_on_every_rank(tmp_path):
    out = _run_dir(tmp_path)
    victim_dir = tmp_path / "victimdir"
    victim_dir.mkdir()
    (out / "offload").mkdir()
    (out / "offload" / "rank1").symlink_to(victim_dir)
    for message in run_distributed(_prepare, 2, str(out), timeout_s=60):
        assert f"rank 1: {out}/offload/rank1 is a symbolic link" in message
    assert list(victim_dir.iterdir()) == []


# ---- export ---------------------------------------------------------------------------------

@pytest.fixture
def checkpoint_run(tmp_path):
    run = tmp_path / "ckpt-run"
    save(run, 100, build_reference())
    return run


def _special(kind: str, path: Path) -> None:
    if kind == "character device":  # our own node, never the system's /dev/full or /dev/null
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 7))
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("kind, is_kind", [("character device", stat.S_ISCHR), ("FIFO", stat.S_ISFIFO)])
def test_export_never_replaces_a_device_node_or_fifo(kind, is_kind, checkpoint_run, tmp_path, capsys):
    if kind == "character device" and os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    node = tmp_path / "node"
    _special(kind, node)
    assert main(["checkpoint", "export", str(checkpoint_run), "--format", "torch", "--out", str(node)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"plait checkpoint: error: --out {node} exists and is a {kind}, not a regular file" in err
    assert is_kind(os.lstat(node).st_mode), f"the {kind} was replaced"
    assert [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(".node")] == []


def test_export_to_a_link_is_refused_and_its_target_kept(checkpoint_run, tmp_path, capsys):
    victim = _victim(tmp_path, "victim.pt")
    link = tmp_path / "model.pt"
    link.symlink_to(victim)
    assert main(["checkpoint", "export", str(checkpoint_run), "--out", str(link)]) == 2
    err = capsys.readouterr().err  # (the message cuts long paths)
    assert err.startswith("plait checkpoint: error: --out ") and err.count("\n") == 1
    assert "is a symbolic link; export neither writes through one nor replaces it: give the file it points to" in err
    assert victim.read_bytes() == VICTIM_BYTES and link.is_symlink()


# ---- plait train, end to end ----------------------------------------------------------------

def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait", "train", "--model", "mlp", "--data", "digits", "--dp", "1",
                           "--tp", "1", "--pp", "1", "--steps", "3", "--sample-chars", "0", "--out", str(out),
                           *extra], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("name", ["loss.png", ".run.json.tmp", "previous"])
def test_dry_run_names_a_link_where_the_run_writes(name, tmp_path):
    out = _run_dir(tmp_path)
    victim = _victim(tmp_path, "victim")
    (out / name).symlink_to(victim if name != "previous" else victim.parent)
    result = _train(out, "--dry-run")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (f"plait train: error: {out}/{name} is a symbolic link; plait never writes, "
                                     "truncates or deletes through one (it could lead out of the directory plait "
                                     "writes): remove the link, or choose another path")
    assert victim.read_bytes() == VICTIM_BYTES


def test_a_fifo_where_the_run_writes_a_file_is_named_before_launch(tmp_path):
    out = _run_dir(tmp_path)
    os.mkfifo(out / "loss.png")  # the pre-issue run trained, then failed writing the plot ("not seekable")
    result = _train(out, "--dry-run")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (f"plait train: error: {out}/loss.png exists and is a FIFO, not a regular file; "
                                     "plait writes only regular files and never replaces anything else: choose "
                                     "another path")
    assert stat.S_ISFIFO(os.lstat(out / "loss.png").st_mode)


@pytest.mark.slow
@pytest.mark.long
def test_plait_train_writes_through_no_link_of_its_run_directory(tmp_path):
    """Findings 1-3 as reported: linked loss.png, launch-config.toml, .lock and offload/."""
    out = _run_dir(tmp_path)
    victims = {name: _victim(tmp_path, f"victim-{name}") for name in ("loss.png", "launch-config.toml", ".lock")}
    for name, victim in victims.items():
        (out / name).symlink_to(victim)
    victim_dir = tmp_path / "victimdir"
    (victim_dir / "rank0").mkdir(parents=True)
    (victim_dir / "rank0" / "thesis.tex").write_bytes(VICTIM_BYTES)
    (out / "offload").symlink_to(victim_dir)
    refused = []
    for _ in range(len(victims) + 1):
        result = _train(out, "--offload-activations")
        assert result.returncode == 2, result.stdout + result.stderr
        named = [link for link in (*victims, "offload") if f"{out}/{link} is a symbolic link" in result.stderr]
        assert len(named) == 1 and result.stderr.count("\n") == 1, result.stderr
        refused.append(named[0])
        (out / named[0]).unlink()  # the user removes the link named; the next run names the next one
    assert sorted(refused) == sorted((*victims, "offload"))
    for name, victim in victims.items():
        assert victim.read_bytes() == VICTIM_BYTES, name
    assert (victim_dir / "rank0" / "thesis.tex").read_bytes() == VICTIM_BYTES
    assert _train(out, "--offload-activations").returncode == 0
    assert not (out / "offload").exists()
