"""The busy host every speed ratio is also reported on: one process spinning at nice 19."""

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
