"""Files written so that readers see the old file or the whole new one, never a part,
and a full disk is named: what checkpoints and exports are written with.

``atomic_write(path, write, nbytes)``: ``write(temp_name)`` fills a temporary file next
to ``path``; it is fsynced and renamed over ``path``, then the directory is fsynced
(the rename lives in the directory). ``nbytes``, the expected size, is checked against
the free space first, and a write that fails on a full disk (ENOSPC or EDQUOT
anywhere in the exception chain) raises DiskFull naming the path, the bytes needed
and the bytes free (plait.errors.DiskFull, the message activation offload gives
too). The temporary file is removed on every failure.

No write follows a symbolic link: the rename replaces a link at ``path`` itself, never
its target, and anything else at ``path`` that is not a regular file (a device node,
a FIFO, a socket, a directory) is refused by name (NotRegularFile) before anything is
written, so a rename never replaces it. ``open_no_link`` opens a file in place (a
lock, a log appended to) with O_NOFOLLOW: a link there is refused by name (LinkRefused).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

import torch

from plait.errors import DiskFull, is_disk_full

NEW_FILE_MODE = 0o666  # less the umask: the mode open() gives a new file


class LinkRefused(ValueError):
    """A symbolic link stands where plait writes a file in place."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(f"{path} is a symbolic link; plait never writes, truncates or deletes through one (it could "
                         "lead out of the directory plait writes): remove the link, or choose another path")


class NotRegularFile(ValueError):
    """Something that is not a regular file (a device node, a FIFO, a socket, a
    directory) stands where plait writes a file."""

    def __init__(self, path: Path, mode: int, what: str = ""):
        self.path = path
        named = f"{what} {path}" if what else str(path)
        super().__init__(f"{named} exists and is {describe_mode(mode)}, not a regular file; plait writes only "
                         "regular files and never replaces anything else: choose another path")


def describe_mode(mode: int) -> str:
    """What an st_mode is, in words ("a character device", "a FIFO", ...)."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))
    return next((name for test, name in kinds if test(mode)), f"of file type {stat.S_IFMT(mode):#o}")


def check_replaceable(path: Path, what: str = "") -> None:
    """Raise NotRegularFile unless ``path`` is missing, a regular file or a symbolic link
    (which a rename replaces itself); reads only, follows no link. ``what``: the option
    that named it, for the message."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a file as a parent is named where it is made)
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise NotRegularFile(path, mode, what)


def open_no_link(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)`` of a regular file: a
    symbolic link at ``path`` raises LinkRefused, anything else that is not a regular
    file (a FIFO, a device, a socket) NotRegularFile, both before anything is written.
    Opened non-blocking (a FIFO does not hang the open), then set blocking; the descriptor."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP and path.is_symlink():
            raise LinkRefused(path) from None
        if error.errno in (errno.ENXIO, errno.EISDIR, errno.ENODEV):  # a FIFO with no reader, a directory, a device
            check_replaceable(path)
        raise
    file_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(file_mode):
        os.close(fd)
        raise NotRegularFile(path, file_mode)
    os.set_blocking(fd, True)
    return fd


def process_umask() -> int:
    """This process's umask, read without changing it (/proc/self/status, Linux >= 4.7;
    0o022, the common default, where that line is missing)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


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
    A link at ``path`` is replaced itself (never its target); anything else there that is
    not a regular file raises NotRegularFile before anything is written.
    ``nbytes``, the expected size, is checked against the free space first, and a write
    that fails on a full disk raises DiskFull, naming the path and the bytes needed."""
    check_replaceable(path)  # a device node, FIFO or socket is never replaced (a link is: itself)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(path, nbytes)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, NEW_FILE_MODE & ~process_umask())  # as open() would make it (mkstemp makes 0600)
    finally:
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
