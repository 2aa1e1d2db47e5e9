"""Reading a user's small file (a --config TOML, a calibration profile): it must be a
regular file and of bounded size; and where plait caches files when no directory is
given. Torch-free and importing nothing of plait's, so every layer may use it (cost/
as train/).

A path that names a FIFO would block the reader forever (nothing writes to it), a
character device such as /dev/zero never ends, a directory fails late with
IsADirectoryError, and a huge file is read in full before anything looks at it. So
the path is opened with O_NONBLOCK (opening a FIFO then does not wait for a
writer), the opened descriptor is checked (fstat: no race between a check and the
open), and at most ``limit_nbytes + 1`` bytes are read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["default_cache_dir", "read_small_file", "file_kind"]

CHUNK_NBYTES = 1 << 16


def default_cache_dir() -> Path:
    """``~/.cache/plait``: the cache (tokenised corpora, calibration profiles) of a library
    call given no directory. The library reads no environment variable: the ``plait``
    CLI passes ``$PLAIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/plait``, else this
    (plait.cli.environment.cache_dir)."""
    return Path.home() / ".cache" / "plait"


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (for messages)."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_small_file(path, *, limit_nbytes: int, what: str, fix: str) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit_nbytes`` of them.

    Raises ValueError, one line naming ``what`` (e.g. "config file"), the path and
    ``fix``, when the path is not a regular file (a directory, a FIFO, a device, a
    socket) or holds more than ``limit_nbytes`` bytes. FileNotFoundError and other
    OSErrors of the open or read propagate for the caller to word."""

    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{what} {os.fspath(path)!r} is {file_kind(mode)}, not a regular file: {fix}")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while total <= limit_nbytes:  # st_size is not trusted (a file may grow while read): count the bytes
            chunk = os.read(fd, min(CHUNK_NBYTES, limit_nbytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit_nbytes:
            raise ValueError(f"{what} {os.fspath(path)!r} is larger than {limit_nbytes:,} bytes "
                             f"({limit_nbytes // (1 << 20)} MiB), the most plait reads of one: {fix}")
        return b"".join(chunks)
    finally:
        os.close(fd)
