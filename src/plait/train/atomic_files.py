"""Files written so that readers see the old file or the whole new one, never a part,
and a full disk is named: what checkpoints and exports are written with.

``atomic_write(path, write, nbytes)``: ``write(temp_name)`` fills a temporary file next
to ``path``; it is fsynced and renamed over ``path``, then the directory is fsynced
(the rename lives in the directory). ``nbytes``, the expected size, is checked against
the free space first, and a write that fails on a full disk (ENOSPC or EDQUOT
anywhere in the exception chain) raises DiskFull naming the path, the bytes needed
and the bytes free (plait.errors.DiskFull, the message activation offload gives
too). The temporary file is removed on every failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from plait.errors import DiskFull, is_disk_full


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (the entry lives in the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[str], None], nbytes: int = 0) -> None:
    """``write(temp_name)`` writes a temporary file next to ``path``; fsync it, rename
    it over ``path``, fsync the directory: readers see the old file or the whole new one.
    ``nbytes``, the expected size, is checked against the free space first, and a write
    that fails on a full disk raises DiskFull, naming the path and the bytes needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(path, nbytes)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(temp_name)
        with open(temp_name, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException as error:
        Path(temp_name).unlink(missing_ok=True)
        if is_disk_full(error):
            raise DiskFull(path, nbytes) from None
        raise
    fsync_dir(path.parent)


def check_free_space(path: Path, nbytes: int) -> None:
    """Raise DiskFull unless ``path``'s filesystem has ``nbytes`` free."""
    if nbytes and shutil.disk_usage(path.parent).free < nbytes:
        raise DiskFull(path, nbytes)


def torch_save(value, path: str) -> None:
    """torch.save through a Python file, so a full disk surfaces as OSError(ENOSPC), at
    least in the exception chain (given a path, torch's C++ writer reports only
    "unexpected pos")."""
    with open(path, "wb") as file:
        torch.save(value, file)
