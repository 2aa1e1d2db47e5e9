"""plait.train.rundir: what a run may do with a run directory. Never a silent start
over an earlier run, nothing of it deleted or overwritten unless asked; broken newer
checkpoints kept out of rotation; a restart of the same run recognises its own files.

Every refusal is checked to change nothing: the directory's files and their bytes
are snapshotted before and compared after."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from plait.train import checkpoint as ckpt
from plait.train import rundir
from tests.train.test_checkpoint import _flip_byte, build_reference, save


@pytest.fixture(scope="module")
def reference():
    return build_reference()


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` -> sha256 of its bytes (directories as '<dir>')."""
    found = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        found[relative] = "<dir>" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def metrics(out: Path, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / (s + 1)}) + "\n"
                                               for s in range(steps)))


def run_with(tmp_path, reference, steps=(100, 200, 300), corrupt=()) -> Path:
    out = tmp_path / "run"
    metrics(out, max(steps))
    for step in steps:
        directory = save(out, step, reference)
        if step in corrupt:
            _flip_byte(directory / "tp0-pp0.pt")
    (out / "report.json").write_text("{}")
    return out


def test_an_empty_or_missing_directory_starts_fresh(tmp_path):
    for resume in ("auto", "never"):
        assert rundir.decide(tmp_path / "missing", resume, run_id="r") == rundir.ResumePlan(None)
        assert rundir.decide(tmp_path, resume, run_id="r") == rundir.ResumePlan(None)


def test_all_checkpoints_corrupt_is_refused_and_nothing_changes(tmp_path, reference):
    """The probe: every checkpoint with one corrupt shard. Before: plait started at step 0,
    rewrote metrics.jsonl and later deleted the corrupt directories."""
    out = run_with(tmp_path, reference, corrupt=(100, 200, 300))
    before = snapshot(out)
    with pytest.raises(ValueError) as refused:
        rundir.decide(out, "auto", run_id="new-run")
    message = str(refused.value)
    assert "no complete checkpoint" in message and "metrics.jsonl with 300 steps" in message
    assert "3 checkpoints, all corrupt or partial: step_00000300 (tp0-pp0.pt sha256 mismatch (corrupt))" in message
    assert "--resume DIR" in message and "--resume never --force-fresh" in message and "another --out" in message
    assert snapshot(out) == before


def test_vanished_checkpoints_are_refused(tmp_path, reference):
    """checkpoints/ removed after the launcher looked: metrics remain, nothing to resume."""
    out = run_with(tmp_path, reference)
    for directory in ckpt.list_checkpoints(out):
        for file in directory.iterdir():
            file.unlink()
        directory.rmdir()
    before = snapshot(out)
    with pytest.raises(ValueError, match=r"found an earlier run .* \(metrics.jsonl with 300 steps; report.json\)"):
        rundir.decide(out, "auto", run_id="new-run")
    assert snapshot(out) == before


def test_broken_newer_checkpoints_are_kept_not_resumed_or_pruned(tmp_path, reference):
    out = run_with(tmp_path, reference, steps=(100, 200, 300, 400), corrupt=(300,))
    partial = ckpt.checkpoint_dir(out, 400)
    (partial / ckpt.MANIFEST_NAME).unlink()
    before = snapshot(out)
    plan = rundir.decide(out, "auto", run_id="new-run")
    assert plan.checkpoint == ckpt.checkpoint_dir(out, 200)
    assert [state.path.name for state in plan.set_aside] == ["step_00000400", "step_00000300"]
    assert snapshot(out) == before  # deciding changes nothing
    lines = rundir.apply(plan, out, log=lambda line: None)
    assert "kept as" in lines[0] and "not resumed from, never pruned" in lines[0]
    kept = {path.name for path in (out / "checkpoints").iterdir()}
    assert kept == {"step_00000100", "step_00000200", "step_00000300.corrupt", "step_00000400.partial"}
    # the files themselves are untouched, only their directories renamed
    after = snapshot(out)
    renamed = {name.replace(".corrupt", "").replace(".partial", ""): digest for name, digest in after.items()}
    assert renamed == before
    assert ckpt.list_checkpoints(out) == [ckpt.checkpoint_dir(out, 100), ckpt.checkpoint_dir(out, 200)]
    # later saves prune the old complete ones only
    for step in (500, 600):
        save(out, step, reference)
    assert ckpt.prune(out, 1, log=None) == [ckpt.checkpoint_dir(out, step) for step in (100, 200, 500)]
    assert (out / "checkpoints" / "step_00000300.corrupt" / "tp0-pp0.pt").exists()


def test_prune_keeps_a_corrupt_checkpoint_it_would_have_rotated_away(tmp_path, reference):
    out = tmp_path / "run"
    for step in (100, 200, 300):
        save(out, step, reference)
    (ckpt.checkpoint_dir(out, 100) / "tp1-pp1.pt").write_bytes(b"short")  # corrupt by size
    lines = []
    assert ckpt.prune(out, 1, log=lines.append) == [ckpt.checkpoint_dir(out, 200)]
    assert (out / "checkpoints" / "step_00000100.corrupt" / "tp1-pp1.pt").read_bytes() == b"short"
    assert lines == ["step_00000100: tp1-pp1.pt is 5 bytes, manifest says "
                     f"{(ckpt.checkpoint_dir(out, 300) / 'tp1-pp1.pt').stat().st_size} (truncated or "
                     "overwritten): kept as step_00000100.corrupt, not pruned"]


def test_resume_never_needs_force_fresh_over_an_earlier_run(tmp_path, reference):
    out = run_with(tmp_path, reference)
    before = snapshot(out)
    with pytest.raises(ValueError, match="--resume never would start over .* add --force-fresh"):
        rundir.decide(out, "never", run_id="new-run")
    with pytest.raises(ValueError, match="--force-fresh replaces an earlier run, but --resume auto continues it"):
        rundir.decide(out, "auto", run_id="new-run", force_fresh=True)
    assert snapshot(out) == before
    plan = rundir.decide(out, "never", run_id="new-run", force_fresh=True)
    assert plan == rundir.ResumePlan(None, move_aside_earlier_run=True)
    rundir.apply(plan, out, log=lambda line: None)
    (moved,) = (out / rundir.PREVIOUS_DIR).iterdir()
    assert {name: digest for name, digest in snapshot(moved).items()} == before  # all of it, byte for byte
    assert rundir.decide(out, "never", run_id="new-run") == rundir.ResumePlan(None)


def test_resume_dir_inside_the_run_refuses_to_overwrite_newer_checkpoints(tmp_path, reference):
    out = run_with(tmp_path, reference)
    with pytest.raises(ValueError, match=r"holds newer checkpoints that this run would overwrite \("
                                         r"step_00000300, step_00000200\)"):
        rundir.decide(out, str(ckpt.checkpoint_dir(out, 100)), run_id="new-run")
    assert rundir.decide(out, str(ckpt.checkpoint_dir(out, 300)), run_id="new-run").checkpoint == \
        ckpt.checkpoint_dir(out, 300)


def test_resume_dir_into_another_run_needs_force_fresh(tmp_path, reference):
    source = run_with(tmp_path / "a", reference)
    other = run_with(tmp_path / "b", reference, steps=(100,))
    checkpoint = ckpt.checkpoint_dir(source, 300)
    with pytest.raises(ValueError, match="which holds another run"):
        rundir.decide(other, str(checkpoint), run_id="new-run")
    plan = rundir.decide(other, str(checkpoint), run_id="new-run", force_fresh=True)
    assert plan.checkpoint == checkpoint and plan.move_aside_earlier_run
    assert rundir.decide(tmp_path / "fresh", str(checkpoint), run_id="r") == rundir.ResumePlan(checkpoint)


def test_resume_dir_that_is_missing_says_so(tmp_path):
    """Before: "partial: the save did not finish" for a path that does not exist."""
    with pytest.raises(ValueError, match=r"nowhere does not exist; give a checkpoint directory"):
        rundir.decide(tmp_path / "run", str(tmp_path / "nowhere"), run_id="r")


def test_a_restart_of_the_same_run_continues_its_own_files(tmp_path, reference):
    out = run_with(tmp_path, reference, steps=(100, 200), corrupt=(200,))
    rundir.write_run_record(out, "this-run", None)
    plan = rundir.decide(out, "never", run_id="this-run")  # a restart ignores "never": these files are its own
    assert plan.own_restart and plan.checkpoint == ckpt.checkpoint_dir(out, 100)
    assert [state.path.name for state in plan.set_aside] == ["step_00000200"]
    # no complete checkpoint yet: the run starts again at 0 over its own metrics
    for directory in ckpt.list_checkpoints(out):
        (directory / ckpt.MANIFEST_NAME).unlink()
    assert rundir.decide(out, "auto", run_id="this-run") == rundir.ResumePlan(
        None, own_restart=True, notes=("restart of this run before its first checkpoint: starting again at step 0",))
    with pytest.raises(ValueError, match="no complete checkpoint"):
        rundir.decide(out, "auto", run_id="another-run")
