"""The busy host every speed ratio is also reported on: one process spinning at nice 19
(``busy_loop``), or several (``busy_loops``: the per-call benchmark's two)."""

from __future__ import annotations

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def busy_loop(enabled: bool):
    """A process spinning at nice 19 for the block, if ``enabled`` (yields its pid, or
    None); ended by its pid whatever the block raises."""
    if not enabled:
        yield None
        return
    spinner = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield spinner.pid
    finally:
        spinner.kill()
        spinner.wait(timeout=10)


@contextlib.contextmanager
def busy_loops(count: int):
    """``count`` processes spinning at nice 19 for the block (yields their pids), all
    ended whatever the block raises."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(busy_loop(True)) for _ in range(count)]
