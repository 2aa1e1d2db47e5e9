"""One writer per run directory: an exclusive ``flock`` on ``OUT/.lock``.

``plait train``'s launcher takes the lock before any process starts and holds it for
the whole run; the kernel releases it when the last process holding the file open
exits, so a crashed or killed run never leaves a stale lock behind. The launcher
passes its descriptor on to the torchrun agent: a launcher killed by SIGKILL keeps
the directory locked until the agent and its ranks are gone. A second run on the
same directory is refused at once, naming the holder (pid, host, start time, run
id) that the holder wrote into the file.

Processes of one run share its lock: a process whose run id equals the holder's
goes ahead without taking it (the ranks the launcher started, and the other nodes
of a multi-node run whose ``--out`` is on a shared filesystem). Without a launcher
(``torchrun ... -m plait train``) every rank calls ``acquire`` itself: the first
takes the lock, the rest of the run shares it.

The file is never deleted: removing it while it is held would let a second run lock
a new file of the same name. It is opened with O_NOFOLLOW: a symbolic link (or a
device, a FIFO) named ``.lock`` is refused by name, never truncated or written through.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from plait.train.atomic_files import open_no_link

LOCK_NAME = ".lock"
HOLDER_RECORD_WAIT_S = 2.0  # how long a refused run waits for a new holder to write its record


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run directory: what the holder wrote into the lock file."""

    pid: int
    host: str
    started_unix_s: float
    run_id: str

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started_unix_s))
        return f"pid {self.pid} on host {self.host}, started {started} (run {self.run_id})"


class RunDirectoryBusy(ValueError):
    """Another run holds the run directory's lock."""

    def __init__(self, out: Path, holder: LockHolder | None):
        self.holder = holder
        who = holder.describe() if holder is not None else "a process whose lock record cannot be read"
        super().__init__(f"{out} is in use by another plait train run: {who}; wait for it to finish, stop it, "
                         f"or choose another --out")


class RunLock:
    """The lock of one run directory, held (``owned``) or shared with its holder."""

    def __init__(self, path: Path, fd: int | None, holder: LockHolder):
        self.path, self._fd, self.holder = path, fd, holder

    @property
    def owned(self) -> bool:
        """True if this process holds the flock; False if the run's holder does."""
        return self._fd is not None

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"the lock on {self.path} is held by {self.holder.describe()}, not by this process")
        return self._fd

    def release(self) -> None:
        """Drop the lock (closing the descriptor is what releases a flock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def _read_holder(path: Path) -> LockHolder | None:
    try:
        record = json.loads(path.read_text())
        return LockHolder(pid=int(record["pid"]), host=str(record["host"]),
                          started_unix_s=float(record["started_unix_s"]), run_id=str(record["run_id"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _open(path: Path) -> int:
    """The lock file, opened without following a link (O_NOFOLLOW): a link or anything
    but a regular file at ``path`` is refused by name before anything is written to it."""
    try:
        return open_no_link(path, os.O_RDWR | os.O_CREAT)
    except OSError as error:
        raise ValueError(f"cannot open the run lock {path}: {error.strerror}; choose an --out you can write "
                         "to") from None


def acquire(out: str | os.PathLike, run_id: str, *, started_unix_s: float | None = None) -> RunLock:
    """Lock ``out`` for the run ``run_id`` (creating the directory), or share the lock
    of that run's holder; raise RunDirectoryBusy naming the holder if another run has it."""
    out = Path(out)
    if not run_id:
        raise ValueError("run_id must be a non-empty string that every process of the run shares")
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _wait_for_record(path)
        if holder is not None and holder.run_id == run_id:
            return RunLock(path, None, holder)
        raise RunDirectoryBusy(out, holder) from None
    holder = LockHolder(pid=os.getpid(), host=socket.gethostname(),
                        started_unix_s=time.time() if started_unix_s is None else started_unix_s, run_id=run_id)
    record = (json.dumps(asdict(holder)) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    os.fsync(fd)
    return RunLock(path, fd, holder)


def _wait_for_record(path: Path) -> LockHolder | None:
    """The holder's record; a holder that has just taken the lock may not have written
    it yet, so an unreadable record is read again for up to HOLDER_RECORD_WAIT_S."""
    deadline = time.monotonic() + HOLDER_RECORD_WAIT_S
    while True:
        holder = _read_holder(path)
        if holder is not None or time.monotonic() > deadline:
            return holder
        time.sleep(0.05)


def holder(out: str | os.PathLike) -> LockHolder | None:
    """The run holding ``out`` now, or None if nobody holds it."""
    path = Path(out) / LOCK_NAME
    if not os.path.lexists(path):  # a dangling link is refused by _open, not taken for no lock
        return None
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _wait_for_record(path)
    finally:
        os.close(fd)
    return None


def check_free(out: str | os.PathLike, run_id: str) -> None:
    """Raise RunDirectoryBusy if another run holds ``out`` (reads only; ``acquire``
    still decides, since a run may take it in between)."""
    current = holder(out)
    if current is not None and current.run_id != run_id:
        raise RunDirectoryBusy(Path(out), current)
