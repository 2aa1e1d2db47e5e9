"""Output paths of plait's commands (--json, --csv, --plot, --out, --output, ...),
checked before the command does any work.

A benchmark that runs for minutes and then cannot write its results has wasted those
minutes, so each command hands its output paths to :func:`prepare_output_paths` first:

- missing parent directories are made, as ``mkdir -p`` would;
- a path that is an existing directory (for a file), whose parent is a file, or where
  no file can be written is refused with a ValueError naming the flag, the path and
  the reason; plait.cli.main prints it as one line and exits 2.

Writability is tried, not inferred from permission bits (which root ignores, and which
say nothing of read-only file systems): a file that exists is opened for appending, and
in a directory a hidden probe file is created and removed at once.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass

STDOUT = "-"  # the path that means standard output, where a flag allows it


@dataclass(frozen=True)
class OutputPath:
    """One output a command will write: the flag that named it, the path, and whether
    the path is a directory the command fills (--timeline-out) rather than a file."""

    flag: str
    path: str
    is_directory: bool = False


def output_file(flag: str, path: str | None, *, stdout_allowed: bool = False) -> OutputPath | None:
    """The output file of ``flag``, or None when there is nothing to check: the flag was
    not given, or it is "-" where that means standard output."""
    if path is None or (stdout_allowed and path == STDOUT):
        return None
    return OutputPath(flag, str(path))


def output_directory(flag: str, path: str | None) -> OutputPath | None:
    """The output directory of ``flag`` (made if missing), or None when not given."""
    return None if path is None else OutputPath(flag, str(path), is_directory=True)


def prepare_output_paths(*outputs: OutputPath | None) -> None:
    """Check every output, then make the missing directories; raises ValueError for the
    first path that cannot be written. Nothing is made unless every check passed."""
    given = [output for output in outputs if output is not None]
    for output in given:
        _check_shape(output)
    for output in given:
        _make_and_try(output)


def _directory_of(output: OutputPath) -> str:
    """The directory that must exist (and take new files) for ``output``."""
    if output.is_directory:
        return output.path
    return os.path.dirname(output.path) or os.curdir


def _check_shape(output: OutputPath) -> None:
    """Refusals that need no change on disk: empty path, directory vs file, a file as parent."""
    flag, path = output.flag, output.path
    if not path:
        raise ValueError(f"{flag} '': give a path")
    if output.is_directory:
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path}: is a file, not a directory; name a directory (it is made if missing)")
    elif os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory; name a file, e.g. one inside it")
    elif path.endswith(("/", os.sep)):
        raise ValueError(f"{flag} {path}: ends in a separator; name a file, e.g. {os.path.join(path, 'out')}")
    # the nearest part of the path that exists must be a directory: mkdir -p goes on from there
    existing = _directory_of(output)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing.rstrip("/" + os.sep)) or os.curdir
    if os.path.isfile(existing):
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {path}: {existing} is not a directory (a broken link or a special file)")


def _make_and_try(output: OutputPath) -> None:
    """mkdir -p the directory, then try writing where the command will write."""
    flag, path = output.flag, output.path
    directory = _directory_of(output)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot make the directory {directory} ({error.strerror})") from None
    if not output.is_directory and os.path.exists(path):
        _try_existing_file(flag, path)
        return
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".plait-write-test-", dir=directory)
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot create files in {directory} ({error.strerror})") from None
    os.close(descriptor)
    os.unlink(probe)


def _try_existing_file(flag: str, path: str) -> None:
    """A regular file is opened for appending (its content stays); a device or pipe
    (/dev/null, a FIFO) is only checked for permission: opening a FIFO would block."""
    if stat.S_ISREG(os.stat(path).st_mode):
        try:
            with open(path, "a"):
                pass
        except OSError as error:
            raise ValueError(f"{flag} {path}: cannot write it ({error.strerror})") from None
    elif not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: cannot write it (permission denied)")
