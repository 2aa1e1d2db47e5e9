"""Running one plait command for bench/plan_vs_train.py and bench/report_vs_profiler.py:
in its own session, its output captured, and on a timeout or ANY exception while it
runs (Ctrl-C, SIGTERM turned into SystemExit) ended together with every process it
started, by pid."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def tail(text: str, chars: int = 2000) -> str:
    return text[-chars:].rstrip()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc): torchrun's workers run in sessions
    of their own, so killing the launcher's process group does not reach them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def end_tree(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the command's process group (torchrun then stops its workers), up to
    ``grace_s``; then SIGKILL, by pid, to every process it had started that is still alive
    (the same command line, so a reused pid is left alone)."""
    started = {pid: _cmdline(pid) for pid in descendants(process.pid)}
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid, cmdline in started.items():
        if cmdline is not None and _cmdline(pid) == cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if process.poll() is None:
        process.kill()


def run_command(command: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``command`` in its own session; past ``timeout_s`` end it (``end_tree``) and raise
    RuntimeError with the output's tail; on any other exception end it and re-raise."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_tree(process)
        stdout, stderr = process.communicate()
        raise RuntimeError(f"{' '.join(command[1:4])} timed out after {timeout_s:.0f} s:\n"
                           f"{tail(stderr or stdout)}") from None
    except BaseException:
        end_tree(process, grace_s=5.0)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
