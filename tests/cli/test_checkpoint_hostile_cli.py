"""`plait checkpoint info|export` and `plait train` on checkpoints a hostile user
prepared (issue 31): a step directory that is a link to another run's, forged
manifests, names longer than the system takes, `--resume RUN_DIR`. The other
("victim") run's whole tree, every entry and every file's bytes, is compared before
and after; each refusal is one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plait.cli.main import main
from tests.train.test_checkpoint import build_reference, save
from tests.train.test_checkpoint_hostile import rewrite_manifest, tree


@pytest.fixture(scope="module")
def reference():
    return build_reference()


@pytest.fixture
def victim(tmp_path, reference):
    run = tmp_path / "victim"
    save(run, 100, reference)
    save(run, 200, reference)
    return run


def one_line_error(err: str, command: str = "checkpoint") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"plait {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_info_and_export_refuse_a_linked_step_directory(tmp_path, reference, victim, capsys):
    """The probe: info called RUN (whose step_00000200 links to another run's) complete at
    step 200, and export wrote the other run's weights."""
    run = tmp_path / "run"
    save(run, 100, reference)
    link = run / "checkpoints" / "step_00000200"
    link.symlink_to(victim / "checkpoints" / "step_00000200")
    before = tree(victim)
    assert main(["checkpoint", "info", str(run)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("plait checkpoint: step_00000200: the directory is a symbolic link to")
    assert "using step_00000100" in captured.err and "step 100," in captured.out
    assert main(["checkpoint", "info", str(link)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"{link} is not a complete checkpoint: the directory is a symbolic link to {link.readlink()}" in line
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "export", str(link), "--out", str(out)]) == 2
    one_line_error(capsys.readouterr().err)
    assert not out.exists()
    assert main(["checkpoint", "export", str(run), "--out", str(out)]) == 0
    assert f"exported step 100 of {run / 'checkpoints' / 'step_00000100'}" in capsys.readouterr().out
    assert tree(victim) == before


@pytest.mark.parametrize("forgery, expected", [
    ("step", "manifest step 999999 != 200, the step of its directory step_00000200 (not valid)"),
    ("tp=2 over tp=1", "manifest mesh tp=2 pp=1 needs the files ['tp0-pp0.pt', 'tp1-pp0.pt'], but it lists "
                       "['tp0-pp0.pt'] (not valid)"),
    ("shapes", "the shards hold 7,136 parameters, but the manifest's model has 26,560: the manifest does not describe "
               "these files (not valid)"),
])
def test_a_forged_manifest_exits_2_in_info_and_export(tmp_path, reference, capsys, forgery, expected):
    """The probe: "step": 999999 was reported and exported as step 999999; tp=2 over a
    tp=1 run's files and a model of other shapes were "complete" for info."""
    tp = 1 if forgery == "tp=2 over tp=1" else 2
    directory = save(tmp_path / "run", 200, reference, tp_size=tp, pp_size=tp)
    manifest = json.loads((directory / "manifest.json").read_text())
    changes = {"step": dict(step=999999, data_position=999999), "tp=2 over tp=1": dict(mesh={"tp": 2}),
               "shapes": dict(model={**manifest["model"], "hidden": 32})}[forgery]
    rewrite_manifest(directory, **changes)
    assert main(["checkpoint", "info", str(directory)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"{directory} is not a complete checkpoint: {expected}" in line
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "export", str(directory), "--out", str(out)]) == 2
    assert expected in one_line_error(capsys.readouterr().err)
    assert not out.exists()


def test_a_5000_character_name_exits_2_in_one_line(tmp_path, victim, capsys):
    """The probe: a 5,000-character name was an OSError traceback (File name too long),
    as the path, as export's --out, and as a file name inside a manifest."""
    long_name = "y" * 5000
    assert main(["checkpoint", "info", long_name]) == 2
    assert "the path is 5,000 bytes, longer than PATH_MAX - 1 = 4,095" in one_line_error(capsys.readouterr().err)
    assert main(["checkpoint", "info", str(tmp_path / long_name[:300])]) == 2
    assert "is 300 bytes, longer than this filesystem's NAME_MAX 255" in one_line_error(capsys.readouterr().err)
    assert main(["checkpoint", "export", str(victim), "--out", str(tmp_path / (long_name[:300] + ".pt"))]) == 2
    assert "longer than this filesystem's NAME_MAX 255" in one_line_error(capsys.readouterr().err)
    directory = victim / "checkpoints" / "step_00000200"
    manifest = json.loads((directory / "manifest.json").read_text())
    rewrite_manifest(directory, files={**manifest["files"], long_name: {"nbytes": 1, "sha256": "0" * 64}})
    assert main(["checkpoint", "info", str(directory)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "manifest lists a 5,000-byte file name" in line and len(line) < 600


# ----------------------------------------------------------------------------- plait train
TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--data-max-bytes", "60000",
        "--global-batch", "8", "--micro-batch", "2", "--dp", "1", "--tp", "1", "--pp", "1", "--eval-interval", "0",
        "--sample-chars", "0", "--checkpoint-interval", "1"]


def plait(*argv: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "plait", *argv], env=environment, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.long
def test_training_on_beside_a_linked_step_directory_leaves_the_other_run_intact(tmp_path):
    """The probe, end to end: RUN's checkpoints/step_00000002 links to VICTIM's newest
    checkpoint. Before: `plait train --keep-checkpoints 1` resumed from it, then pruning
    deleted VICTIM's manifest.json and died ("Cannot call rmtree on a symbolic link").
    Now the link is skipped (named), set aside as itself, and VICTIM is byte-identical
    after the run, after info and after export; `--resume VICTIM` then resumes from
    VICTIM's newest complete checkpoint."""
    victim, run = tmp_path / "victim", tmp_path / "run"
    trained = plait("train", *TINY, "--steps", "2", "--out", str(victim))
    assert trained.returncode == 0, trained.stdout + trained.stderr
    shutil.copytree(victim / "checkpoints" / "step_00000001", run / "checkpoints" / "step_00000001")
    (run / "checkpoints" / "step_00000002").symlink_to(victim / "checkpoints" / "step_00000002")
    before = tree(victim)

    resumed = plait("train", *TINY, "--steps", "3", "--keep-checkpoints", "1", "--out", str(run))
    assert tree(victim) == before, resumed.stdout + resumed.stderr  # before: victim's manifest.json deleted
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from {run / 'checkpoints' / 'step_00000001'}; step_00000002 (the directory is a symbolic " \
           "link to" in resumed.stdout
    assert "it will be kept as step_00000002.link" in resumed.stdout
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000002.link", "step_00000003"]

    for argv in (["checkpoint", "info", str(run)], ["checkpoint", "export", str(run), "--out", str(tmp_path / "m.pt")],
                 ["checkpoint", "info", str(run / "checkpoints" / "step_00000002.link")]):
        plait(*argv)
    assert tree(victim) == before

    # --resume VICTIM (a run directory) resumes from its newest complete checkpoint, as info shows it
    from plait.train.config import TrainConfig
    from plait.train.launch import check_resume_choice, prepare_data

    config = TrainConfig(layers=2, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8,
                         micro_batch=2, dp=1, tp=1, pp=1, out=str(tmp_path / "new"))
    lines = []
    plan = check_resume_choice(config, str(victim), prepare_data(config), log=lines.append)
    assert plan.checkpoint == victim / "checkpoints" / "step_00000002"
    assert lines == [f"plait train: --resume {victim}: its newest complete checkpoint is step_00000002; resuming "
                     f"from {victim / 'checkpoints' / 'step_00000002'}"]
    assert tree(victim) == before


def test_resume_a_run_directory_through_the_cli_says_what_it_resumes(tmp_path, reference, capsys):
    """`plait train --resume RUN_DIR` with a run directory that holds no complete
    checkpoint says what to pass (one line, exit 2); before it said "no manifest.json
    (partial: the save did not finish)"."""
    run = tmp_path / "run"
    directory = save(run, 100, reference)
    (directory / "manifest.json").unlink()
    code = main(["train", *TINY, "--steps", "2", "--resume", str(run), "--out", str(tmp_path / "new")])
    line = one_line_error(capsys.readouterr().err, "train")
    assert code == 2
    assert (f"--resume {run}: the run directory has no complete checkpoint (step_00000100: no manifest.json "
            "(partial: the save did not finish): no complete checkpoint left); give a checkpoint directory "
            "(RUN/checkpoints/step_*) instead") in line
