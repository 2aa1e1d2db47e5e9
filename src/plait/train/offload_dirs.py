"""A training rank's offload directory, ``<out>/offload/rank<r>``: where activation
offload writes its files and optimizer offload maps its (unlinked) state files.

Neither ``offload/`` nor ``rank<r>`` may be a symbolic link: a link there is refused by
name before any step (prepare), and removal goes through descriptors opened with
O_NOFOLLOW (``shutil.rmtree`` with ``dir_fd``, which follows no link), so a link put
there during the run is never followed out of the run: nothing outside ``--out`` is
written or deleted.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import torch.distributed as dist

from plait.train.atomic_files import LinkRefused, open_no_link

OFFLOAD_DIR_NAME = "offload"
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def offload_dir(out: Path, rank: int) -> Path:
    """``<out>/offload/rank<rank>``."""
    return Path(out) / OFFLOAD_DIR_NAME / f"rank{rank}"


def _check_no_link(path: Path) -> None:
    """LinkRefused if ``path`` is a symbolic link; OSError (ENOTDIR) if it is not a directory."""
    if path.is_symlink():
        raise LinkRefused(path)
    if path.exists() and not stat.S_ISDIR(os.lstat(path).st_mode):
        raise NotADirectoryError(f"{path} is not a directory")


def prepare_offload_dir(out: Path, rank: int, world_size: int, wanting: list[str]) -> Path:
    """This rank's directory, created and checked writable on every rank at once (one
    all-gather, so every rank must call it): a rank that cannot write is named on all
    of them before any step. ``offload/`` or ``rank<r>`` being a symbolic link is
    refused by name (LinkRefused, a ValueError) on every rank, before anything is
    written through it. ``wanting``: the settings that need it, for the message."""
    directory = offload_dir(out, rank)
    problem, linked = None, None
    try:
        Path(out).mkdir(parents=True, exist_ok=True)  # --out itself (the user's choice, a link allowed) may be new
        for path in (directory.parent, directory):
            _check_no_link(path)
            path.mkdir(exist_ok=True)
            _check_no_link(path)  # a link made between the check and the mkdir
        probe = directory / ".probe"
        os.close(open_no_link(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
        probe.unlink()
    except LinkRefused as error:
        problem = linked = f"rank {rank}: {error}"
    except OSError as error:
        problem = f"rank {rank} cannot write its offload directory {directory}: {error}"
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (problem, linked))
    problems = [entry for entry, _ in everyone if entry]
    if any(link for _, link in everyone):
        raise ValueError("; ".join(problems))
    if problems:
        raise OSError("; ".join(problems) + f" ({' and '.join(wanting)} need{'s' if len(wanting) == 1 else ''} "
                      "a writable --out on every node)")
    return directory


def remove_offload_dir(out: Path, rank: int) -> None:
    """Remove this rank's directory, and ``offload/`` itself once the last rank is out;
    through descriptors that follow no link: a link at ``offload`` or ``rank<r>`` is
    left alone (nothing it points to is deleted)."""
    try:
        out_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # --out itself: the user's own choice
    except OSError:
        return
    try:
        try:
            offload_fd = os.open(OFFLOAD_DIR_NAME, _DIRECTORY_FLAGS, dir_fd=out_fd)
        except OSError:  # missing, or a link (ELOOP / ENOTDIR): nothing of ours to remove
            return
        try:
            shutil.rmtree(f"rank{rank}", dir_fd=offload_fd)  # refuses a link at rank<r>; follows none inside
        except OSError:
            pass
        finally:
            os.close(offload_fd)
        try:
            os.rmdir(OFFLOAD_DIR_NAME, dir_fd=out_fd)  # only an empty directory, never a link's target
        except OSError:
            pass
    finally:
        os.close(out_fd)
