"""Sharded training checkpoints: one file per (tp, pp) coordinate, a manifest as the
commit point, and resharding to another tensor-parallel degree on load. This module
finds, verifies and prunes them; plait.train.checkpoint_write writes them,
plait.train.checkpoint_checks says what a valid one is, plait.train.checkpoint_load
loads one.

Layout: ``RUN/checkpoints/step_00000100/{tp0-pp0.pt, ..., manifest.json}``. The
dp-rank-0 process of every (tp, pp) coordinate writes its shard (``write_shard``),
then global rank 0 writes ``manifest.json`` listing every file's size and sha256
(``write_manifest``). Every file is written to a temporary name, fsynced and renamed,
so a directory without a readable manifest is a partial checkpoint (a crash during
the save) and is skipped by ``latest_complete``.

A shard payload (``torch.save``; loads with ``weights_only=True``)::

    {"format": 1, "tp_rank", "tp_size", "pp_rank", "pp_size": int,
     "model": {name: this rank's slice}, "specs": {name: [dim, full_size] | None},
     "optimizer": {name: {key: tensor}}, "extra": {...}}

Names are those of the unsharded ``GPT``. A sharded tensor's slice on rank r of p is
rows [r*c, (r+1)*c) along ``dim`` of the full tensor zero-padded to p*c rows,
c = ceil(full_size / p) (``plait.parallel.tensor.sharding.shard_tensor``): loading
concatenates the p slices in rank order and drops the padding, so a checkpoint saved
at one tp loads at any other (``plait.train.checkpoint_load``: ``load_full`` then
``reshard``). Cost: a save writes
each parameter and its optimizer state once per (tp, pp) shard, about
3 x 4 bytes x parameters for fp32 AdamW; ``load_full`` holds every shard in memory.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Callable

from plait.train.checkpoint_checks import (MANIFEST_NAME, SHOWN_CHARS, ManifestUnreadable, UnsafeManifest,
                                          check_user_path, cut, manifest_problems, problems_summary, read_manifest,
                                          shard_name, shard_problems, shown, step_of_name)
from plait.train.checkpoint_write import file_sha256

PARTIAL = f"no {MANIFEST_NAME} (partial: the save did not finish)"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """RUN/checkpoints/step_{step:08d}."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


# ----------------------------------------------------------------------------- finding

def _directory_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot be a checkpoint directory (a link, not a directory,
    under a linked checkpoints/), or None."""
    try:
        mode = os.lstat(directory).st_mode
    except FileNotFoundError:
        return f"{cut(str(directory), 2 * SHOWN_CHARS)} does not exist"
    except OSError as error:
        return f"{cut(str(directory), 2 * SHOWN_CHARS)} cannot be read ({error.strerror})"
    if stat.S_ISLNK(mode):
        try:
            target = f" to {cut(os.readlink(directory), 4 * SHOWN_CHARS)}"
        except OSError:
            target = ""
        return (f"the directory is a symbolic link{target}: a checkpoint is a directory inside its run, never a "
                "link; plait neither reads nor deletes through one (not valid)")
    if not stat.S_ISDIR(mode):
        return "not a directory (not valid)"
    parent = directory.parent
    if parent.name == "checkpoints" and parent.is_symlink():
        return _linked_checkpoints(parent)
    return None


def _linked_checkpoints(root: Path) -> str:
    return (f"{root} is a symbolic link: a run's checkpoints are a directory inside it, and plait neither reads "
            "nor deletes checkpoints through a link; replace the link by a directory (copy the checkpoints in)")


_SHARD_PREFIX = re.compile(r"tp[0-9]+-pp[0-9]+\.pt")  # shard_name's files, and a save's temporary files of them
SCANNED_ENTRIES = 10_000  # a checkpoint directory holds one file per shard: enough to tell one, bounded on a huge one


def not_a_checkpoint(directory: Path) -> str | None:
    """What ``directory`` is when it is not a checkpoint directory at all (no manifest,
    not named step_*, no shard file a save would have started), with what to pass
    instead; None when it is one or may be a partial save. Was "no manifest.json
    (partial: the save did not finish)" for /, an empty directory or RUN/checkpoints."""
    if step_of_name(directory.name) is not None or os.path.lexists(directory / MANIFEST_NAME):
        return None
    try:
        with os.scandir(directory) as entries:
            names = [entry.name for entry in itertools.islice(entries, SCANNED_ENTRIES)]
    except OSError:
        return None  # verify names the unreadable directory
    if any(_SHARD_PREFIX.match(name) for name in names):
        return None
    shown_dir = cut(str(directory), 2 * SHOWN_CHARS)
    if any(step_of_name(name) is not None for name in names) or directory.name == "checkpoints":
        return (f"{shown_dir} is a run's checkpoints directory, not a checkpoint: pass the run directory "
                f"{cut(str(directory.parent), 2 * SHOWN_CHARS)}, or one of its step_* directories")
    if "checkpoints" in names:
        return (f"{shown_dir} is a run directory, not a checkpoint: pass it where a run directory is taken, or one "
                "of its checkpoints/step_* directories")
    found = "empty" if not names else f"no {MANIFEST_NAME}, no shard files, not named step_*"
    return (f"{shown_dir} is not a checkpoint directory ({found}): pass a run directory RUN (its newest complete "
            "checkpoint) or a checkpoint directory RUN/checkpoints/step_*")


def verify(directory: str | os.PathLike, *, check_sha256: bool = True) -> list[str]:
    """Why ``directory`` is not a complete checkpoint; [] if it is. Complete: a real
    directory (not a link, nor under a linked checkpoints/), a manifest that agrees with
    its directory and its files (plait.train.checkpoint_checks), every listed file a
    regular file of its size and sha256, every shard's coordinates and shapes right.
    Reads every file to hash it (``check_sha256=False``: sizes only); the shards are
    then loaded memory-mapped to read their headers and shapes."""
    directory = Path(directory)
    problem = _directory_problem(directory)
    if problem is not None:
        return [problem]
    try:
        mode = os.lstat(directory / MANIFEST_NAME).st_mode
    except FileNotFoundError:
        return [not_a_checkpoint(directory) or PARTIAL]
    except OSError as error:
        return [f"{MANIFEST_NAME} unreadable ({error.strerror})"]
    if stat.S_ISLNK(mode):
        return [f"{MANIFEST_NAME} is a symbolic link (a checkpoint's files are regular files inside it)"]
    try:
        manifest = read_manifest(directory)
    except UnsafeManifest as error:
        return [f"{MANIFEST_NAME} lists files outside the checkpoint directory: "
                f"{', '.join(map(shown, error.names[:3]))} (not valid)"]
    except ManifestUnreadable as error:
        return [f"{MANIFEST_NAME} unreadable ({error.reason})"]
    except ValueError:  # removed since the lstat above
        return [PARTIAL]
    problems = manifest_problems(directory, manifest)
    if problems:
        return problems
    for name, entry in manifest["files"].items():
        path = directory / name
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            problems.append(f"{name} missing")
            continue
        except OSError as error:
            problems.append(f"{name} unreadable ({error.strerror})")
            continue
        if stat.S_ISLNK(info.st_mode):
            problems.append(f"{name} is a symbolic link (a checkpoint's files are regular files inside it)")
        elif not stat.S_ISREG(info.st_mode):
            problems.append(f"{name} is not a regular file")
        elif info.st_size != entry["nbytes"]:
            problems.append(f"{name} is {info.st_size} bytes, manifest says {entry['nbytes']} (truncated or "
                            "overwritten)")
        elif check_sha256 and file_sha256(path) != entry["sha256"]:
            problems.append(f"{name} sha256 mismatch (corrupt)")
    return problems or shard_problems(directory, manifest)


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Every RUN/checkpoints/step_* entry, oldest (lowest step) first: directories, and
    links or files with such a name (which verify refuses by name). Only names
    checkpoint_dir writes count (step_ and 8 or more ASCII digits, no extra zeros).
    ValueError if checkpoints/ is a symbolic link (plait reads no run through one)."""
    root = Path(run_dir) / "checkpoints"
    try:
        mode = os.lstat(root).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as error:
        raise ValueError(f"{cut(str(root), 2 * SHOWN_CHARS)} cannot be read ({error.strerror})") from None
    if stat.S_ISLNK(mode):
        raise ValueError(_linked_checkpoints(root))
    if not stat.S_ISDIR(mode):
        return []
    found = [(step, root / name) for name in os.listdir(root) if (step := step_of_name(name)) is not None]
    return [path for _, path in sorted(found)]


def latest_complete(run_dir: str | os.PathLike, log: Callable[[str], None] | None = print) -> Path | None:
    """The newest checkpoint that verifies (None if none does); logs one line per newer
    one skipped: "step_00000200: tp0-pp1.pt sha256 mismatch (corrupt): using step_00000100"."""
    skipped = []
    chosen = None
    for path in reversed(list_checkpoints(run_dir)):
        problems = verify(path)
        if not problems:
            chosen = path
            break
        skipped.append((path, problems))
    using = f"using {chosen.name}" if chosen is not None else "no complete checkpoint left"
    for path, problems in skipped:
        if log is not None:
            log(f"{path.name}: {problems_summary(problems)}: {using}")
    return chosen


def _exists(path: Path) -> bool:
    """Whether anything (a link included) has this name; ValueError for a path the
    system refuses (check_user_path said why before: this is the last guard)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as error:
        raise ValueError(f"{cut(str(path), 2 * SHOWN_CHARS)} cannot be read ({error.strerror})") from None
    return True


def resolve(path: str | os.PathLike, log: Callable[[str], None] | None = print,
            what: str = "PATH") -> tuple[Path, bool]:
    """(checkpoint directory, verified): ``path`` itself if it is a checkpoint
    directory (not yet verified), or a run directory's latest complete checkpoint
    (verified by ``latest_complete``, which logs what it skipped). ``what`` names the
    argument in the one-line ValueError of a path the system refuses."""
    path = check_user_path(path, what)
    if not _exists(path):
        raise ValueError(f"{path} does not exist: pass a run directory (with checkpoints/) or a checkpoint "
                         "directory (checkpoints/step_*)")
    if _exists(path / MANIFEST_NAME) or step_of_name(path.name) is not None:
        return path, False
    if _exists(path / "checkpoints"):
        chosen = latest_complete(path, log=log)
        if chosen is None:
            raise ValueError(f"{path} has no complete checkpoint (none of {len(list_checkpoints(path))} step_* "
                             "directories under checkpoints/ verifies)")
        return chosen, True
    raise ValueError(f"{path} is neither a checkpoint directory (no {MANIFEST_NAME}) nor a run directory (no "
                     "checkpoints/)")


def aside_reason(path: Path) -> str:
    """What set_aside calls a checkpoint that is out of rotation: "link" (a symbolic
    link), "partial" (a directory without a manifest) or "corrupt" (anything else)."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return "link"
        os.lstat(path / MANIFEST_NAME)
    except FileNotFoundError:
        return "partial"
    except OSError:
        pass
    return "corrupt"


def prune(run_dir: str | os.PathLike, keep: int, *, check_sha256: bool = False,
          log: Callable[[str], None] | None = print) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and partial ones (no
    manifest: a save that never finished) older than the newest complete; returns the
    deleted directories. Complete is what ``verify`` says (``check_sha256``: files
    also hashed). A corrupt checkpoint, and a link or file named like a checkpoint,
    is never deleted as if it were old: it is renamed ``step_N.corrupt`` /
    ``step_N.link`` (the link itself, never what it points to; out of rotation) and
    logged. Everything is done relative to checkpoints/ opened without following a
    link (a linked checkpoints/ prunes nothing), and a step directory is opened with
    O_NOFOLLOW before anything in it is removed, so nothing outside the run is ever
    deleted, even if an entry is replaced by a link after it was verified."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r} must be an int >= 1 (the newest complete checkpoint is never deleted)")
    root = Path(run_dir) / "checkpoints"
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    except OSError as error:
        if log is not None:
            log(f"{root}: nothing pruned: {'a symbolic link' if os.path.islink(root) else error.strerror}")
        return []
    try:
        return _prune_in(root, root_fd, keep, check_sha256, log)
    finally:
        os.close(root_fd)


def _prune_in(root: Path, root_fd: int, keep: int, check_sha256: bool, log) -> list[Path]:
    found = sorted((step, name) for name in os.listdir(root_fd) if (step := step_of_name(name)) is not None)
    paths = [root / name for _, name in found]
    problems = {path: verify(path, check_sha256=check_sha256) for path in paths}
    complete = [path for path in paths if not problems[path]]
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = paths.index(complete[-1])
    deleted = []
    for path in paths[:newest]:
        if path in kept:
            continue
        reason = aside_reason(path)
        if reason == "partial" and problems[path] == [PARTIAL]:
            if _remove_step_dir(root_fd, path.name, log):
                deleted.append(path)
            continue
        if not problems[path] and _remove_step_dir(root_fd, path.name, log):
            deleted.append(path)
            continue
        if problems[path]:
            target = set_aside(path, reason)
            if log is not None:
                log(f"{path.name}: {problems_summary(problems[path])}: kept as {target.name}, not pruned")
    return deleted


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _remove_step_dir(root_fd: int, name: str, log) -> bool:
    """Remove checkpoints/``name`` if it is a directory (not a link): its manifest
    first (a half-deleted directory then reads as partial, not corrupt), then the rest
    with shutil.rmtree's descriptor-based walk, which follows no link."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    except OSError as error:  # replaced by a link or a file since it was verified
        if log is not None:
            log(f"{name}: not pruned ({'a symbolic link' if _is_link(name, root_fd) else error.strerror})")
        return False
    try:
        os.unlink(MANIFEST_NAME, dir_fd=fd)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        pass  # none, or a directory of that name: rmtree removes it
    finally:
        os.close(fd)
    try:
        shutil.rmtree(name, dir_fd=root_fd)
    except OSError as error:  # e.g. replaced by a link between the open above and rmtree's own check
        if log is not None:
            log(f"{name}: not pruned ({error})")
        return False
    return True


def set_aside(path: Path, reason: str) -> Path:
    """Rename checkpoint directory ``path`` to ``step_N.<reason>`` (or ``.<reason>.K``
    if taken): kept on disk, out of list_checkpoints, so never resumed from or pruned.
    A link is renamed itself (a rename never follows one)."""
    target = path.with_name(f"{path.name}.{reason}")
    index = 0
    while os.path.lexists(target):
        index += 1
        target = path.with_name(f"{path.name}.{reason}.{index}")
    path.rename(target)
    return target
