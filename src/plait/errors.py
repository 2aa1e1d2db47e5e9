"""plait's user-error base class and the errors several layers raise alike; torch-free,
importable from every layer (it imports nothing of plait's).

A ``PlaitError`` is a user error: its message says what is wrong and how to fix it,
so the ``plait`` command prints it as one line (``plait <cmd>: error: ...``, exit 2)
and a rank of ``plait train`` reports it without a traceback, as it does a
ValueError. An error that is not one (a bug, an internal invariant) keeps its
traceback. Subclasses also derive from the builtin they refine (DiskFull is an
OSError with errno ENOSPC), so ``except OSError`` still catches them.

Which of plait's error classes are user errors (a PlaitError, a ValueError or an
OSError) and which keep a traceback:

    user        LossScaleError (the run diverged: lower the learning rate), TestbedError
                (a testbed command failed: what it printed), DiskFull (a path, bytes needed
                and free), CheckpointNotWritten (an OSError), every ValueError subclass
                (PlanError, GraphError, ScheduleError, MismatchError, RunDirectoryBusy,
                UnsafeManifest, CorpusTooSmall, NoRouteError)
    traceback   CommError / CommTimeoutError and PipelineError (a rank waited for a peer
                that failed, or a hang: the root cause is reported first, from the rank
                that failed; a hang is a bug whose stack is the clue), WorkerError (it
                carries the failed benchmark worker's traceback), the test harness's
                RankError, DistributedTimeout, WorkerCrashed
    own line    ParentGone (the launcher died first: printed where it is caught)
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

OUT_FIX = "free some space or give --out a filesystem with room"


class PlaitError(Exception):
    """A user error: one line saying what is wrong and the fix (see the module docstring)."""


class DiskFull(PlaitError, OSError):
    """A file does not fit on its filesystem: names the path, the bytes it needs (when
    known) and the bytes free there. ``fix``: what to do, for the message."""

    def __init__(self, path, nbytes: int, fix: str = OUT_FIX):
        path = Path(path)
        try:
            free = f"{shutil.disk_usage(path.parent).free:,} bytes are free there"
        except OSError as error:  # the directory itself is gone
            free = f"the free space cannot be read ({error.strerror})"
        need = f"it needs about {nbytes:,} bytes" if nbytes else "it needs more room"
        super().__init__(errno.ENOSPC, f"no space left on device writing {path}: {need} and {free}; {fix}")
        self.path, self.nbytes = path, nbytes

    def __reduce__(self):  # picklable across processes (an OSError pickles its (errno, strerror) args)
        return (_disk_full_from_message, (str(self.strerror), str(self.path), self.nbytes))

    def __str__(self) -> str:
        return str(self.strerror)


def _disk_full_from_message(message: str, path: str, nbytes: int) -> DiskFull:
    error = DiskFull.__new__(DiskFull)
    OSError.__init__(error, errno.ENOSPC, message)
    error.path, error.nbytes = Path(path), nbytes
    return error


def is_disk_full(error: BaseException | None) -> bool:
    """ENOSPC or EDQUOT anywhere in the exception chain (a writer may raise its own
    error while closing, with the OSError as its context)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


__all__ = ["DiskFull", "OUT_FIX", "PlaitError", "is_disk_full"]
