"""What a run directory holds, and what a new run may do with it: never start over
silently, never delete or overwrite an earlier run's results unless asked.

``decide(out, resume, run_id=..., force_fresh=...)`` reads the directory (nothing
changes) and returns a ``ResumePlan`` or raises ValueError saying what it found:

- ``--resume auto``: the newest complete checkpoint; a fresh start only in a
  directory that holds no run (no metrics, checkpoints or report); otherwise stop.
- ``--resume never``: a fresh start in a directory that holds no run; with
  ``--force-fresh`` an earlier run is first moved to ``OUT/previous/<time>/``.
- ``--resume DIR``: that checkpoint, into a directory with no run, into its own run
  (DIR inside ``OUT/checkpoints``, with no newer checkpoint there to overwrite), or
  with ``--force-fresh`` after the earlier run is moved aside. DIR may be a run
  directory (one with ``checkpoints/``): its newest complete checkpoint, the one
  `plait checkpoint info DIR` shows; ``--resume OUT`` (the run's own) is ``auto``.
- A checkpoint that is a symbolic link (or under a linked ``checkpoints/``) is never
  complete (plait.train.checkpoint.verify): never resumed from, and set aside (the
  link renamed ``step_N.link``, never what it points to).
- A restart of the same run (``run.json`` names this ``run_id``: an elastic restart
  after a failure) continues from the run's own newest complete checkpoint, or
  redoes what the run itself wrote.

``apply(plan)`` carries the plan out under the run lock (rank 0): checkpoint
directories newer than the one resumed from that are corrupt or partial are renamed
``step_N.corrupt`` / ``step_N.partial`` (kept, out of rotation: never resumed from or
pruned), and ``--force-fresh`` moves the earlier run aside. ``write_run_record``
then writes ``run.json``. ``metrics.jsonl`` is cut back only to the step of a
checkpoint actually resumed from (plait.train.loop).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from plait.files import file_kind
from plait.train import checkpoint as ckpt
from plait.train.atomic_files import atomic_write

RUN_RECORD = "run.json"
PREVIOUS_DIR = "previous"
# The files of a run: what --force-fresh moves aside, and (but for run.json, written
# at the start) what shows that a directory holds a run.
RUN_FILES = ("metrics.jsonl", "report.md", "report.json", "loss.png", "config.toml", RUN_RECORD)
RESULT_FILES = ("metrics.jsonl", "report.md", "report.json")
RESUME_FIXES = "use --resume DIR (a checkpoint to continue from), --resume never --force-fresh (moves the " \
               "earlier run to {out}/previous/), or another --out"


@dataclass(frozen=True)
class CheckpointState:
    path: Path
    step: int
    problems: tuple[str, ...]  # () when complete

    @property
    def complete(self) -> bool:
        return not self.problems

    @property
    def partial(self) -> bool:
        return self.reason == "partial"

    @property
    def reason(self) -> str:
        """What set_aside calls it: "partial", "corrupt" or "link" (ckpt.aside_reason)."""
        return ckpt.aside_reason(self.path)

    def describe(self) -> str:
        return self.path.name + (f" ({'; '.join(self.problems[:2])})" if self.problems else "")


@dataclass(frozen=True)
class Survey:
    """A run directory's contents, as far as resuming is concerned."""

    out: Path
    checkpoints: tuple[CheckpointState, ...]  # newest first; verified up to and including the newest complete one
    metrics_steps: int                        # records in metrics.jsonl
    results: tuple[str, ...]                  # result files present
    run_id: str | None                        # run.json's, if any

    @property
    def newest_complete(self) -> CheckpointState | None:
        return next((state for state in self.checkpoints if state.complete), None)

    @property
    def holds_run(self) -> bool:
        """Whether an earlier run left anything here that a new run would overwrite."""
        return bool(self.checkpoints or self.metrics_steps or self.results)

    def describe(self) -> str:
        parts = []
        if self.metrics_steps:
            parts.append(f"metrics.jsonl with {self.metrics_steps} steps")
        parts += [name for name in self.results if name != "metrics.jsonl"]
        if self.checkpoints:
            broken = [state for state in self.checkpoints if not state.complete]
            head = (f"{len(self.checkpoints)} checkpoint{'s' * (len(self.checkpoints) != 1)}"
                    + (", all corrupt or partial" if len(broken) == len(self.checkpoints) else ""))
            parts.append(head + ": " + ", ".join(state.describe() for state in self.checkpoints[:4])
                         + (f", and {len(self.checkpoints) - 4} more" if len(self.checkpoints) > 4 else ""))
        return "; ".join(parts) if parts else "nothing"


@dataclass(frozen=True)
class ResumePlan:
    checkpoint: Path | None                      # resume from it; None: start at step 0
    set_aside: tuple[CheckpointState, ...] = ()  # newer broken checkpoints to rename
    move_aside_earlier_run: bool = False          # --force-fresh
    own_restart: bool = False
    notes: tuple[str, ...] = field(default=())


def _metrics_steps(path: Path) -> int:
    if not path.is_file():
        return 0
    count = 0
    with open(path, "rb") as file:
        for line in file:
            count += bool(line.strip())
    return count


def _run_id(out: Path) -> str | None:
    try:
        return str(json.loads((out / RUN_RECORD).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def survey(out: str | os.PathLike, *, verify_all: bool = False) -> Survey:
    """Read ``out``. Checkpoints are verified newest first (sizes and sha256) until a
    complete one is found (all of them with ``verify_all``)."""
    out = Path(out)
    states, found = [], False
    for path in reversed(ckpt.list_checkpoints(out)):
        step = ckpt.step_of_name(path.name)
        if found and not verify_all:
            states.append(CheckpointState(path, step, ()))  # older than a complete one: not read
            continue
        problems = tuple(ckpt.verify(path))
        found = found or not problems
        states.append(CheckpointState(path, step, problems))
    results = tuple(name for name in RESULT_FILES if (out / name).is_file())
    return Survey(out=out, checkpoints=tuple(states), metrics_steps=_metrics_steps(out / "metrics.jsonl"),
                  results=results, run_id=_run_id(out))


def _newer_than(survey_: Survey, step: int) -> tuple[CheckpointState, ...]:
    return tuple(state for state in survey_.checkpoints if state.step > step)


def decide(out: str | os.PathLike, resume: str, *, run_id: str | None, force_fresh: bool = False) -> ResumePlan:
    """What a run started with ``--resume resume`` does in ``out`` (module docstring);
    raises ValueError naming what it found and the ways forward."""
    out = Path(out)
    given, notes = resume, ()
    if resume not in ("auto", "never") and _is_run_dir(ckpt.check_user_path(resume, "--resume")):
        if _same_dir(Path(resume), out):  # this run's own directory: what auto does
            notes = (f"--resume {resume} is --out itself: continuing it as --resume auto does",)
            resume = "auto"
    if force_fresh and resume == "auto":
        raise ValueError(f"--force-fresh replaces an earlier run, but --resume {given} continues it: use --resume "
                         "never --force-fresh to start over, or drop --force-fresh")
    found = survey(out) if out.is_dir() else Survey(out, (), 0, (), None)
    own = run_id is not None and found.run_id == run_id
    fixes = RESUME_FIXES.format(out=out)
    if own:  # an elastic restart: this run's own files
        newest = found.newest_complete
        if newest is not None:
            corrupt = tuple(state for state in _newer_than(found, newest.step) if not state.partial)
            return ResumePlan(newest.path, set_aside=corrupt, own_restart=True,
                              notes=(f"restart of this run: continuing from its newest checkpoint {newest.path.name}",))
        if resume not in ("auto", "never"):
            path, notes = _checked_dir(resume)
            return ResumePlan(path, own_restart=True, notes=notes)
        return ResumePlan(None, own_restart=True,
                          notes=("restart of this run before its first checkpoint: starting again at step 0",))
    if resume == "auto":
        newest = found.newest_complete
        if newest is not None:
            broken = tuple(state for state in _newer_than(found, newest.step) if not state.complete)
            return ResumePlan(newest.path, set_aside=broken, notes=notes)
        if not found.holds_run:
            return ResumePlan(None, notes=notes)
        raise ValueError(f"--resume auto found an earlier run in {out} but no complete checkpoint to continue it "
                         f"from ({found.describe()}); nothing was changed: {fixes}")
    if resume == "never":
        if not found.holds_run:
            return ResumePlan(None)
        if force_fresh:
            return ResumePlan(None, move_aside_earlier_run=True)
        raise ValueError(f"--resume never would start over in {out}, which holds an earlier run "
                         f"({found.describe()}): add --force-fresh to move it to {out / PREVIOUS_DIR}/, use "
                         f"--resume auto to continue it, or choose another --out")
    path, notes = _checked_dir(resume)
    inside = path.resolve().parent == (out / "checkpoints").resolve()
    if inside:
        newer = _newer_than(found, ckpt.step_of_name(path.name))
        if newer:
            raise ValueError(f"--resume {resume}: {out} holds newer checkpoints that this run would overwrite ("
                             f"{', '.join(state.path.name for state in newer)}): move them out of "
                             f"{out / 'checkpoints'}, or resume into another --out")
        return ResumePlan(path, notes=notes)
    if found.holds_run and not force_fresh:
        raise ValueError(f"--resume {resume} into {out}, which holds another run ({found.describe()}): choose "
                         f"another --out, or add --force-fresh to move that run to {out / PREVIOUS_DIR}/")
    return ResumePlan(path, move_aside_earlier_run=found.holds_run, notes=notes)


def _is_run_dir(path: Path) -> bool:
    """A run directory (it has checkpoints/), not a checkpoint directory (no manifest,
    not named step_*)."""
    return (os.path.lexists(path / "checkpoints") and not os.path.lexists(path / ckpt.MANIFEST_NAME)
            and ckpt.step_of_name(path.name) is None)


def _same_dir(first: Path, second: Path) -> bool:
    try:
        return os.path.samefile(first, second)
    except OSError:
        return False


def _checked_dir(resume: str) -> tuple[Path, tuple[str, ...]]:
    """(checkpoint directory, notes) of ``--resume resume``: a complete checkpoint
    directory, or a run directory's newest complete checkpoint (as `plait checkpoint
    info RUN` shows it); ValueError naming why not."""
    path = ckpt.check_user_path(resume, "--resume")
    if not os.path.lexists(path):
        raise ValueError(f"--resume {resume}: {path} does not exist; give a checkpoint directory "
                         "(RUN/checkpoints/step_*), a run directory (its newest complete checkpoint), or "
                         "--resume auto|never")
    if not path.is_symlink() and not path.is_dir():
        raise ValueError(f"--resume {resume}: {path} is {file_kind(os.stat(path).st_mode)}, not a directory; give a "
                         "checkpoint directory "
                         "(RUN/checkpoints/step_*), a run directory (its newest complete checkpoint), or "
                         "--resume auto|never")
    if _is_run_dir(path):
        skipped = []
        newest = ckpt.latest_complete(path, log=skipped.append)
        if newest is None:
            raise ValueError(f"--resume {resume}: the run directory has no complete checkpoint ("
                             + ("; ".join(skipped[:3]) or "checkpoints/ holds no step_* directory")
                             + "); give a checkpoint directory (RUN/checkpoints/step_*) instead")
        return newest, (*skipped, f"--resume {resume}: its newest complete checkpoint is {newest.name}")
    problems = ckpt.verify(path)
    if problems and problems[0] == ckpt.not_a_checkpoint(path):  # not a checkpoint at all: say what it is
        raise ValueError(f"--resume {resume}: {problems[0]}")
    if problems:
        raise ValueError(f"--resume {resume}: not a complete checkpoint: " + "; ".join(problems[:3]))
    return path, ()


def apply(plan: ResumePlan, out: str | os.PathLike, log=print) -> list[str]:
    """Carry out the side effects of ``plan`` (rank 0, under the run lock); returns
    the log lines it printed."""
    out = Path(out)
    lines = list(plan.notes)
    for state in plan.set_aside:
        target = ckpt.set_aside(state.path, state.reason)
        lines.append(f"{state.describe()} is newer than {plan.checkpoint.name if plan.checkpoint else 'step 0'} but "
                     f"not complete: kept as {target} (not resumed from, never pruned)")
    if plan.move_aside_earlier_run:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = out / PREVIOUS_DIR / stamp
        for index in range(1, 1000):
            if not target.exists():
                break
            target = out / PREVIOUS_DIR / f"{stamp}.{index}"
        target.mkdir(parents=True)
        for name in (*RUN_FILES, "checkpoints"):
            if (out / name).exists():
                (out / name).rename(target / name)
        lines.append(f"--force-fresh: the earlier run in {out} was moved to {target}")
    for line in lines:
        log(line)
    return lines


def write_run_record(out: str | os.PathLike, run_id: str, resumed_from: Path | None) -> None:
    """``OUT/run.json``: which run writes here (a restart of it recognises its own files)."""
    record = {"run_id": run_id, "started_unix_s": time.time(), "host": os.uname().nodename, "pid": os.getpid(),
              "resumed_from": None if resumed_from is None else str(resumed_from)}
    text = json.dumps(record, indent=2) + "\n"
    # a temporary file of its own, renamed over run.json: a link planted at run.json (or at a
    # fixed temporary name) during the run is replaced itself, never written through
    atomic_write(Path(out) / RUN_RECORD, lambda name: Path(name).write_text(text), len(text))
