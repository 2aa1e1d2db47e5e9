"""Checkpoints a hostile user prepared (issue 31): links that lead out of the run,
manifests that claim what their files are not, names the system refuses. Nothing
outside a run is ever read as its checkpoint or deleted by its pruning; a manifest is
believed only where it agrees with its directory and its files; every refusal is one
line naming the value.

A victim run sits beside the hostile one in the data-loss tests: its whole tree
(every entry, what each link points to, every file's bytes) is compared before and
after. The tiny checkpoints are those of tests/train/test_checkpoint.py (dp=1, tp=2,
pp=2, no processes)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
from dataclasses import asdict
from pathlib import Path

import pytest

from plait.train import checkpoint as ckpt
from plait.train import checkpoint_load, rundir
from plait.train import export as export_file
from plait.train.checkpoint_write import write_manifest, write_shard
from tests.train.test_checkpoint import CONFIG, _payload, _write, build_reference, save


@pytest.fixture(scope="module")
def reference():
    return build_reference()


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed) -> its file's sha256, '<dir>',
    or '-> target' for a link: the listing and the bytes."""
    found = {}
    for directory, subdirectories, files in os.walk(root, followlinks=False):
        for name in subdirectories + files:
            path = Path(directory) / name
            mode = os.lstat(path).st_mode
            relative = str(path.relative_to(root))
            if stat.S_ISLNK(mode):
                found[relative] = f"-> {os.readlink(path)}"
            elif stat.S_ISDIR(mode):
                found[relative] = "<dir>"
            else:
                found[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def rewrite_manifest(directory: Path, **changes) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(manifest.get(key), dict):
            manifest[key] = {**manifest[key], **value}
        else:
            manifest[key] = value
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def victim(tmp_path, reference):
    """Another run, beside the hostile one: complete checkpoints at steps 100 and 200."""
    run = tmp_path / "victim"
    save(run, 100, reference)
    save(run, 200, reference)
    return run


# ----------------------------------------------------------------------------- links
def test_pruning_never_deletes_through_a_linked_step_directory(tmp_path, reference, victim):
    """The probe: checkpoints/step_00000200 a link to another run's step directory.
    Before: `plait checkpoint info` called it complete, training resumed from it, and
    pruning deleted manifest.json inside the other run before dying with "Cannot call
    rmtree on a symbolic link"."""
    run = tmp_path / "run"
    save(run, 100, reference)
    link = run / "checkpoints" / "step_00000200"
    link.symlink_to(victim / "checkpoints" / "step_00000200")
    save(run, 300, reference)
    before = tree(victim)
    problem = ckpt.verify(link)
    assert problem == [f"the directory is a symbolic link to {victim / 'checkpoints' / 'step_00000200'}: a "
                       "checkpoint is a directory inside its run, never a link; plait neither reads nor deletes "
                       "through one (not valid)"]
    lines = []
    assert ckpt.prune(run, 1, log=lines.append) == [ckpt.checkpoint_dir(run, 100)]
    assert lines == [f"step_00000200: {problem[0]}: kept as step_00000200.link, not pruned"]
    aside = run / "checkpoints" / "step_00000200.link"
    assert os.readlink(aside) == str(victim / "checkpoints" / "step_00000200")  # the link itself, renamed
    assert tree(victim) == before
    assert ckpt.latest_complete(victim, log=None) == ckpt.checkpoint_dir(victim, 200)


def test_a_linked_newest_step_directory_is_not_resumed_from(tmp_path, reference, victim):
    """Resume (auto) skips the link, naming it, and sets the link itself aside."""
    run = tmp_path / "run"
    save(run, 100, reference)
    (run / "checkpoints" / "step_00000200").symlink_to(victim / "checkpoints" / "step_00000200")
    before = tree(victim)
    lines = []
    assert ckpt.latest_complete(run, log=lines.append) == ckpt.checkpoint_dir(run, 100)
    assert lines[0].startswith("step_00000200: the directory is a symbolic link to") and \
        lines[0].endswith("using step_00000100")
    plan = rundir.decide(run, "auto", run_id="new-run")
    assert plan.checkpoint == ckpt.checkpoint_dir(run, 100)
    assert [(state.path.name, state.reason) for state in plan.set_aside] == [("step_00000200", "link")]
    rundir.apply(plan, run, log=lambda line: None)
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000100", "step_00000200.link"]
    with pytest.raises(ValueError, match="not a complete checkpoint: the directory is a symbolic link"):
        export_file.export(victim.parent / "run" / "checkpoints" / "step_00000200.link", tmp_path / "m.pt", log=None)
    with pytest.raises(ValueError, match="--resume .*: not a complete checkpoint: the directory is a symbolic link"):
        rundir.decide(tmp_path / "new", str(run / "checkpoints" / "step_00000200.link"), run_id="r")
    assert tree(victim) == before


def test_a_linked_checkpoints_directory_is_refused_and_prunes_nothing(tmp_path, reference, victim):
    """Sibling: checkpoints/ itself a link to another run's. Before: pruning (keep 1)
    deleted the other run's step_00000100."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(victim / "checkpoints")
    before = tree(victim)
    message = (f"{run / 'checkpoints'} is a symbolic link: a run's checkpoints are a directory inside it, and plait "
               "neither reads nor deletes checkpoints through a link; replace the link by a directory (copy the "
               "checkpoints in)")
    for call in (ckpt.list_checkpoints, lambda out: ckpt.latest_complete(out, log=None),
                 lambda out: rundir.decide(out, "auto", run_id="r"), lambda out: ckpt.resolve(out, log=None)):
        with pytest.raises(ValueError) as error:
            call(run)
        assert str(error.value).endswith(message)
    lines = []
    assert ckpt.prune(run, 1, log=lines.append) == []
    assert lines == [f"{run / 'checkpoints'}: nothing pruned: a symbolic link"]
    # a step directory named through the linked checkpoints/ is refused too
    assert ckpt.verify(run / "checkpoints" / "step_00000200") == [message]
    assert tree(victim) == before


def test_a_step_directory_linked_inside_the_same_run_or_to_a_file(tmp_path, reference):
    """Siblings: step_00000300 a link to the run's own step_00000200, step_00000400 a link
    to a file, step_00000500 a plain file: each is named and refused, none is followed."""
    run = tmp_path / "run"
    save(run, 100, reference)
    save(run, 200, reference)
    root = run / "checkpoints"
    (root / "step_00000300").symlink_to(root / "step_00000200")
    (tmp_path / "file").write_text("x")
    (root / "step_00000400").symlink_to(tmp_path / "file")
    (root / "step_00000500").write_text("x")
    assert [path.name for path in ckpt.list_checkpoints(run)] == [f"step_00000{step}" for step in range(100, 600, 100)]
    assert ckpt.verify(root / "step_00000300")[0].startswith("the directory is a symbolic link to")
    assert ckpt.verify(root / "step_00000400")[0].startswith("the directory is a symbolic link to")
    assert ckpt.verify(root / "step_00000500") == ["not a directory (not valid)"]
    assert ckpt.latest_complete(run, log=None) == root / "step_00000200"
    assert ckpt.prune(run, 1, log=None) == [root / "step_00000100"]
    assert (root / "step_00000200" / "manifest.json").is_file()  # the newest complete, reached through no link
    assert (tmp_path / "file").read_text() == "x"


def test_pruning_a_checkpoint_with_a_hard_linked_shard_leaves_the_other_file(tmp_path, reference, victim):
    """Sibling: a shard hard-linked to another run's file. Removing a name never changes
    the other name's bytes (and atomic writes replace files, never write into them)."""
    run = tmp_path / "run"
    old = save(run, 100, reference)
    (old / "tp0-pp0.pt").unlink()
    os.link(victim / "checkpoints" / "step_00000100" / "tp0-pp0.pt", old / "tp0-pp0.pt")
    save(run, 200, reference)
    before = tree(victim)
    assert ckpt.prune(run, 1, log=None) == [old]
    assert tree(victim) == before


def test_only_the_names_checkpoint_dir_writes_are_checkpoints(tmp_path, reference):
    """Sibling: step_000000300 (9 digits) and step_٠٠٠٠٠٣٠٠ (Arabic-Indic digits) were
    listed as step 300 beside the real one."""
    run = tmp_path / "run"
    real = save(run, 300, reference)
    for name in ("step_000000300", "step_\u0660\u0660\u0660\u0660\u0660\u0663\u0660\u0660"):
        (run / "checkpoints" / name).mkdir()
    assert ckpt.list_checkpoints(run) == [real]
    assert ckpt.step_of_name("step_00000300") == 300 and ckpt.step_of_name("step_123456789") == 123456789
    assert ckpt.step_of_name("step_000000300") is None and ckpt.step_of_name("step_-0000300") is None


# ----------------------------------------------------------------------------- forged manifests
FORGERIES = {
    "step 999999": (dict(step=999999, data_position=999999),
                    "manifest step 999999 != 200, the step of its directory step_00000200 (not valid)"),
    "negative step": (dict(step=-5, data_position=-5), "manifest step -5 is not an int >= 0"),
    "step true": (dict(step=True), "manifest step True is not an int >= 0"),
    "data_position": (dict(data_position=999999),
                      "manifest data_position 999999 != step 200 (a checkpoint continues the data at its own step)"),
    "tp=2 over tp=2 x pp=2 files as tp=4": (dict(mesh={"tp": 4}), "manifest mesh tp=4 pp=2 needs the files"),
    "mesh without dp": (dict(mesh={"dp": 0}), "manifest mesh {'dp': 0, "),
    "tp=10**9": (dict(mesh={"tp": 10**9}), "manifest mesh tp=1000000000 pp=2 needs 2,000,000,000 shard files, but "
                                           "it lists ['tp0-pp0.pt', 'tp0-pp1.pt', 'tp1-pp0.pt', 'tp1-pp1.pt']"),
    "config against mesh": (dict(config={"tp": 1, "pp": 2}), "manifest config says tp=1 but its mesh says dp=1, "
                                                             "tp=2, pp=2"),
    "wrong shapes": (dict(model={**asdict(CONFIG), "hidden": 32}),
                     "the shards hold 7,136 parameters, but the manifest's model has 26,560: the manifest does not "
                     "describe these files (not valid)"),
    "not a model": (dict(model={**asdict(CONFIG), "heads": 3}), "manifest model is not a GPT plait builds"),
    "entry not a dict": (dict(files={"tp0-pp0.pt": 5}), "manifest entry of 'tp0-pp0.pt' is 5: need"),
    "5,000-character name": (dict(files={"x" * 5000: {"nbytes": 1, "sha256": "0" * 64}}),
                             "manifest lists a 5,000-byte file name 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... "
                             "(5,000 characters), longer than NAME_MAX 255 (not valid)"),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forged_manifest_is_not_complete_and_is_refused(tmp_path, reference, forgery):
    """Before: "step": 999999 was reported and exported as step 999999; a mesh the files
    are not, or a model of other shapes, was "complete"; an entry that is not a dict
    or a 5,000-character name was a traceback (AttributeError, OSError)."""
    changes, expected = FORGERIES[forgery]
    run = tmp_path / "run"
    older = save(run, 100, reference)
    directory = save(run, 200, reference)
    if "files" in changes:
        manifest = json.loads((directory / "manifest.json").read_text())
        changes = {"files": {**manifest["files"], **changes["files"]}}
    rewrite_manifest(directory, **changes)
    problems = ckpt.verify(directory)
    assert problems and problems[0].startswith(expected), problems
    assert all("\n" not in problem and len(problem) < 400 for problem in problems)
    lines = []
    assert ckpt.latest_complete(run, log=lines.append) == older  # the run directory falls back, saying why
    assert lines[0].startswith(f"step_00000200: {expected}")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint_load.load_full(directory)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        export_file.export(directory, tmp_path / "model.pt", log=None)
    assert not (tmp_path / "model.pt").exists()
    with pytest.raises(ValueError, match=f"--resume {directory}: not a complete checkpoint: "):
        rundir.decide(tmp_path / "new", str(directory), run_id="r")


def test_shards_forged_to_match_a_tp2_manifest_are_refused(tmp_path, reference):
    """Sibling: a tp=1 checkpoint whose manifest says tp=2 and lists tp0-pp0.pt twice
    (as tp1-pp0.pt, with its true size and hash): the file's own header says tp 0 of 1."""
    directory = save(tmp_path / "run", 100, reference, tp_size=1, pp_size=1)
    (directory / "tp1-pp0.pt").write_bytes((directory / "tp0-pp0.pt").read_bytes())
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"]["tp1-pp0.pt"] = manifest["files"]["tp0-pp0.pt"]
    manifest["mesh"]["tp"] = 2
    (directory / "manifest.json").write_text(json.dumps(manifest))
    assert ckpt.verify(directory) == [
        "tp0-pp0.pt holds tp_rank 0 of tp_size 1, pp_rank 0 of pp_size 1; its name and the manifest's mesh say "
        "tp_rank 0 of 2, pp_rank 0 of 1 (not valid)",
        "tp1-pp0.pt holds tp_rank 0 of tp_size 1, pp_rank 0 of pp_size 1; its name and the manifest's mesh say "
        "tp_rank 1 of 2, pp_rank 0 of 1 (not valid)"]


def test_a_shard_of_the_wrong_shape_is_refused(tmp_path, reference):
    """Sibling: a shard written (with a manifest to match) whose tensor is not the shape
    its spec gives at the checkpoint's tp."""
    full, specs, optimizer = reference
    payloads = [_payload(full, specs, optimizer, tp, 2, pp, 2) for pp in range(2) for tp in range(2)]
    payloads[0]["model"]["position"] = payloads[0]["model"]["position"][:4]  # replicated: (8, 16) in the model
    for payload in payloads:
        payload["optimizer"].pop("position", None)
    directory = _write(tmp_path / "run", 100, payloads, 2, 2)
    assert ckpt.verify(directory) == ["tp1-pp0.pt: 'position' is (8, 16) unsharded, another shard says (4, 16)"]


@pytest.mark.parametrize("content, expected", [
    ("", "manifest.json unreadable (JSONDecodeError: Expecting value: line 1 column 1 (char 0))"),
    ("[1, 2]", "manifest.json unreadable (not a format-1 plait manifest: need a JSON object with \"format\": 1 "
               "and \"files\")"),
    ("[" * 100_000 + "]" * 100_000, "manifest.json unreadable (RecursionError: maximum recursion depth exceeded"),
    ("{\"format\": 1, \"files\": {}, \"step\": " + "9" * 5000 + "}", "manifest.json unreadable (ValueError: "
                                                                     "Exceeds the limit (4300 digits)"),
    (b'{"format": 1, "\xff": 1}', "manifest.json unreadable (UnicodeDecodeError: "),
])
def test_an_unreadable_manifest_is_named_in_one_line(tmp_path, reference, content, expected):
    """Siblings: an empty, a non-object, a 100,000-deep (before: RecursionError traceback)
    and a 5,000-digit (before: ValueError traceback) manifest, and bytes that are not UTF-8."""
    directory = save(tmp_path / "run", 100, reference)
    manifest = directory / "manifest.json"
    manifest.write_bytes(content if isinstance(content, bytes) else content.encode())
    problems = ckpt.verify(directory)
    assert len(problems) == 1 and problems[0].startswith(expected) and len(problems[0]) < 300, problems
    with pytest.raises(ValueError, match="unreadable"):
        ckpt.read_manifest(directory)


def test_a_manifest_that_is_a_directory_or_a_fifo_is_refused_without_hanging(tmp_path, reference):
    """Siblings: manifest.json a directory, or a FIFO (before: reading it blocked forever)."""
    directory = save(tmp_path / "run", 100, reference)
    manifest = directory / "manifest.json"
    manifest.unlink()
    manifest.mkdir()
    assert ckpt.verify(directory) == ["manifest.json unreadable (not a regular file)"]
    manifest.rmdir()
    os.mkfifo(manifest)

    def stuck(signum, frame):
        raise TimeoutError("reading a FIFO named manifest.json blocked")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(10)
    try:
        assert ckpt.verify(directory) == ["manifest.json unreadable (not a regular file)"]
        with pytest.raises(ValueError, match="unreadable \\(not a regular file\\)"):
            ckpt.read_manifest(directory)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_write_manifest_refuses_what_verify_would(tmp_path, reference):
    full, specs, optimizer = reference
    directory = ckpt.checkpoint_dir(tmp_path, 100)
    files = [write_shard(directory, "tp0-pp0.pt", _payload(full, specs, optimizer, 0, 1, 0, 1))]
    manifest = {"step": 200, "data_position": 200, "mesh": {"dp": 1, "tp": 1, "pp": 1}, "model": asdict(CONFIG)}
    with pytest.raises(ValueError, match="manifest not written to .*step_00000100: manifest step 200 != 100"):
        write_manifest(directory, manifest, files)
    assert not (directory / "manifest.json").exists()


def test_pruning_when_the_newest_is_forged_keeps_the_newest_true_one(tmp_path, reference):
    """Sibling: the newest checkpoint's manifest forged (step 999999 in step_00000300).
    Before: it counted as the newest complete and keep=1 deleted step_00000200 too."""
    run = tmp_path / "run"
    dirs = {step: save(run, step, reference) for step in (100, 200, 300)}
    rewrite_manifest(dirs[300], step=999999, data_position=999999)
    assert ckpt.prune(run, 1, log=None) == [dirs[100]]
    assert ckpt.latest_complete(run, log=None) == dirs[200]
    assert (dirs[300] / "manifest.json").is_file()  # newer than the newest complete: left for resume to set aside


# ----------------------------------------------------------------------------- names and --resume
def test_overlong_names_are_refused_in_one_line(tmp_path, victim):
    """The probe: a 5,000-character name was an OSError traceback (File name too long)."""
    long_path, long_name = "y" * 5000, tmp_path / ("y" * 300)
    for path, says in ((long_path, "the path is 5,000 bytes, longer than PATH_MAX - 1 = 4,095"),
                       (long_name, "is 300 bytes, longer than this filesystem's NAME_MAX 255")):
        for call in (lambda: ckpt.resolve(path, log=None), lambda: export_file.export(path, tmp_path / "m.pt"),
                     lambda: rundir.decide(tmp_path / "new", str(path), run_id="r")):
            with pytest.raises(ValueError) as error:
                call()
            assert says in str(error.value) and "\n" not in str(error.value) and len(str(error.value)) < 300
    with pytest.raises(ValueError, match=r"--out .*: the file name is 250 bytes; the longest this filesystem takes "
                                         r"here is 241 \(NAME_MAX less 14"):
        export_file.export(victim, tmp_path / ("m" * 247 + ".pt"))


def test_resume_from_a_run_directory_takes_its_newest_complete_checkpoint(tmp_path, reference, victim):
    """The probe: `--resume RUN` said "no manifest.json (partial: the save did not
    finish)" though `plait checkpoint info RUN` accepts that directory."""
    broken = save(victim, 300, reference)
    (broken / "tp0-pp0.pt").write_bytes(b"short")
    before = tree(victim)
    plan = rundir.decide(tmp_path / "new", str(victim), run_id="r")
    assert plan.checkpoint == ckpt.checkpoint_dir(victim, 200)
    assert plan.notes[-1] == f"--resume {victim}: its newest complete checkpoint is step_00000200"
    assert plan.notes[0].startswith("step_00000300: tp0-pp0.pt is 5 bytes")
    assert tree(victim) == before
    # --resume OUT (the run's own directory) continues it as auto does
    own = rundir.decide(victim, str(victim), run_id="r")
    assert own.checkpoint == ckpt.checkpoint_dir(victim, 200)
    assert [state.path.name for state in own.set_aside] == ["step_00000300"]
    assert own.notes == (f"--resume {victim} is --out itself: continuing it as --resume auto does",)
    # a run directory without a complete checkpoint says what to pass
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"--resume .*empty: the run directory has no complete checkpoint \("
                                         r"checkpoints/ holds no step_\* directory\); give a checkpoint directory"):
        rundir.decide(tmp_path / "new", str(empty), run_id="r")


def test_a_step_directory_replaced_by_a_link_after_it_was_verified_is_not_removed(tmp_path, reference, victim):
    """The race the descriptor-based removal closes: between prune's verify and its
    removal, step_00000100 becomes a link to another run's directory. The removal opens
    it with O_NOFOLLOW relative to checkpoints/, so it removes nothing (before: the
    manifest was unlinked through the path, i.e. through the link)."""
    run = tmp_path / "run"
    save(run, 100, reference)
    root = run / "checkpoints"
    os.rename(root / "step_00000100", tmp_path / "moved")
    (root / "step_00000100").symlink_to(victim / "checkpoints" / "step_00000100")
    before = tree(victim)
    lines = []
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert ckpt._remove_step_dir(root_fd, "step_00000100", lines.append) is False
    finally:
        os.close(root_fd)
    assert lines == ["step_00000100: not pruned (a symbolic link)"]
    assert tree(victim) == before and os.path.islink(root / "step_00000100")


def test_a_run_directory_whose_name_is_not_utf8_verifies(tmp_path, reference):
    """A guard for the shard check (it loads each shard memory-mapped): torch's mmap path
    must not need the name encoded as UTF-8 (a first version failed here with
    UnicodeEncodeError: surrogates not allowed)."""
    run = tmp_path / os.fsdecode(b"\xff\xfe-run")
    directory = save(run, 100, reference)
    assert ckpt.verify(directory) == []
    assert ckpt.latest_complete(run, log=None) == directory


def test_the_loader_does_not_read_a_shard_through_a_link(tmp_path, reference):
    """A shard replaced by a link after verification (the loop loads with
    check_files=False, after rank 0 verified): the loader opens it with O_NOFOLLOW."""
    directory = save(tmp_path / "run", 100, reference)
    (directory / "tp0-pp0.pt").rename(tmp_path / "elsewhere.pt")
    (directory / "tp0-pp0.pt").symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(ValueError, match=r"tp0-pp0.pt cannot be loaded \(OSError: \[Errno 40\] Too many levels"):
        checkpoint_load.load_full(directory, check_files=False)


def _save_beside_a_planted_link(rank, world_size, config, victim_directory):
    from plait.train.loop import Trainer

    trainer = Trainer(config, log=lambda _: None)  # a fresh --out: starts at step 0
    link = ckpt.checkpoint_dir(config.out, 5)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim_directory)  # planted during the run, after rundir.decide looked
    trainer.save(5)
    return sorted(os.listdir(link.parent)), os.readlink(link.parent / "step_00000005.replaced")


@pytest.mark.slow
def test_a_save_never_writes_through_a_link_planted_during_the_run(tmp_path, reference, victim):
    """Sibling: the step directory a save is about to write is a link planted during the
    run (to another run's partial checkpoint). Before: rank 0 died in shutil.rmtree
    ("Cannot call rmtree on a symbolic link"); now the link itself is set aside and the
    save writes a real directory."""
    from plait.testing import run_distributed
    from plait.train.config import TrainConfig

    partial = victim / "checkpoints" / "step_00000300"
    partial.mkdir()
    (partial / "tp0-pp0.pt").write_bytes(b"the other run's bytes")
    before = tree(victim)
    config = TrainConfig(layers=2, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8,
                         micro_batch=2, dp=1, tp=1, pp=1, eval_interval=0, out=str(tmp_path / "run"), timeout_s=60.0)
    [(names, target)] = run_distributed(_save_beside_a_planted_link, 1, config, partial, timeout_s=120.0)
    assert names == ["step_00000005", "step_00000005.replaced"] and target == str(partial)
    assert ckpt.verify(ckpt.checkpoint_dir(tmp_path / "run", 5)) == []
    assert tree(victim) == before
