"""Tie a process's life to its parent's, so no part of a run outlives the rest.

``plait train``'s process tree is launcher -> torchrun agent -> ranks. torchrun starts
every rank in a session of its own, so a signal to the launcher's or the agent's
process group never reaches the ranks, and a parent killed by SIGKILL cannot pass
anything on. Linux's ``PR_SET_PDEATHSIG`` closes that gap: the kernel sends the
child a chosen signal the moment its parent dies. The agent asks for SIGTERM (torchrun
then stops its ranks as on any SIGTERM), each rank for SIGKILL (a rank whose agent is
gone has nobody to report to).

The request is made by the child itself, after it has started: if the parent died
before that, the child has already been re-parented (to init or a subreaper), so
the parent is checked once more after the request.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class ParentGone(RuntimeError):
    """The process that started this one has already exited."""


def supported() -> bool:
    """PR_SET_PDEATHSIG exists on Linux only."""
    return sys.platform.startswith("linux")


def tie_to_parent(death_signal: int, expected_parent_pid: int | None = None) -> bool:
    """Ask the kernel to send ``death_signal`` to this process when its parent dies.

    ``expected_parent_pid``: the pid the parent had (default: the parent now); if the
    parent is already another process, raise ParentGone. Returns False where the
    platform has no such request (nothing is tied), True otherwise."""
    parent = os.getppid() if expected_parent_pid is None else expected_parent_pid
    if not supported():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG, {signal.Signals(death_signal).name}) failed: "
                             f"{os.strerror(error)}")
    if os.getppid() != parent or parent == 1:
        raise ParentGone(f"process {os.getpid()}: its parent (pid {parent}) has already exited")
    return True
