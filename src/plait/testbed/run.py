"""`plait testbed run -- CMD...`: one torchrun agent per testbed host, inside the
host's namespace, so a job really is multi-node. The agents meet at a c10d
rendezvous on host 0's address (host 0's agent told it hosts the store: its address
is not its hostname's, so torchrun could not tell, and every agent given its
address as its own, which torchrun hands the ranks as MASTER_ADDR); each starts that host's ranks (its share of the
world, which may differ between hosts: partial-3+5). Gloo is told to use the host's
``eth0`` (``GLOO_SOCKET_IFNAME``), so ranks on different hosts talk over the shaped
links and ranks on one host through the kernel's local delivery (loopback speed).
Every rank sees ``PLAIT_TESTBED_HOST`` (its host's index). When the command ends, is
interrupted or fails on one host, every agent (and its ranks) is stopped.

What the ranks will start is checked first (``check_command``), before any namespace
is touched: a script that does not exist is one line, not every rank's traceback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from plait.testbed.netns import Testbed

RENDEZVOUS_PORT = 29400


MODULE_OPTIONS = ("-m", "--module")  # torchrun's: the first word is a module, run as python -m
NO_PYTHON_OPTIONS = ("--no-python", "--no_python")  # torchrun's: the first word is a program, not a script


def check_command(command: list[str]) -> None:
    """Raise ValueError unless what torchrun will start on every rank exists: a Python
    script (a file, or a directory with __main__.py), ``-m MODULE`` importable from
    here (found as ``python -m`` finds it, from the current directory), or with
    ``--no-python`` a program on PATH. Another torchrun option first: left to torchrun."""
    if not command:
        raise ValueError("give the command to run after --, e.g. plait testbed run -- train.py")
    module = no_python = False
    words = list(command)
    while words and words[0] in MODULE_OPTIONS + NO_PYTHON_OPTIONS:
        module |= words[0] in MODULE_OPTIONS
        no_python |= words[0] in NO_PYTHON_OPTIONS
        words.pop(0)
    if not words:
        raise ValueError(f"{' '.join(command)}: give the {'module' if module else 'program'} after it")
    target = words[0]
    if target.startswith("-"):
        return  # one of torchrun's own options: torchrun checks it
    if no_python:
        if shutil.which(target) is None:
            raise ValueError(f"program {target!r} is not on PATH nor an executable file: --no-python runs it as "
                             "is on every rank")
        return
    if module:
        found = subprocess.run([sys.executable, "-c", "import importlib.util, sys\n"
                                "sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)", target],
                               capture_output=True, text=True, timeout=60)
        if found.returncode:
            reason = found.stderr.strip().splitlines()[-1] if found.stderr.strip() else "not found"
            raise ValueError(f"module {target!r} cannot be found from {os.getcwd()} ({reason}): -m runs "
                             "`python -m MODULE` on every rank; give an importable module or a script path")
        return
    script = Path(target)
    if script.is_dir():
        if not (script / "__main__.py").is_file():
            raise ValueError(f"{target!r} is a directory without __main__.py: give the Python script to run on "
                             "every rank (or -m MODULE)")
    elif not script.exists():
        raise ValueError(f"script {target!r} does not exist (looked in {os.getcwd()}): give the path of the Python "
                         "script to run on every rank, or -m MODULE")
    elif not os.access(script, os.R_OK):
        raise ValueError(f"script {target!r} is not readable: every rank runs it with python")


def agent_commands(testbed: Testbed, command: list[str], port: int = RENDEZVOUS_PORT) -> list[list[str]]:
    """Each host's torchrun agent, run inside its namespace."""
    endpoint = f"{testbed.hosts[0].address}:{port}"
    return [testbed.command_in(host.index, [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(testbed.hosts)),
        "--nproc-per-node", str(host.ranks), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", f"{testbed.prefix}-run", "--rdzv-conf", f"is_host={int(host.index == 0)}",
        "--local-addr", host.address,
        "--max-restarts", "0", *command]) for host in testbed.hosts]


def run_on_testbed(testbed: Testbed, command: list[str], *, timeout_s: float | None = None,
                   port: int = RENDEZVOUS_PORT, output=None) -> int:
    """Run ``command`` (a program and its arguments: python scripts as torchrun takes
    them) on every rank of ``testbed``; the first failing agent's exit status, else 0.
    Past ``timeout_s`` every agent is stopped and 124 returned. ``output``: a file the
    agents' and ranks' stdout and stderr go to (None: this process's)."""
    check_command(command)
    agents = []
    try:
        for host, argv in zip(testbed.hosts, agent_commands(testbed, command, port)):
            environment = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "PLAIT_TESTBED_HOST": str(host.index)}
            agents.append(subprocess.Popen(argv, env=environment, start_new_session=True, stdout=output,
                                           stderr=None if output is None else subprocess.STDOUT))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            codes = [agent.poll() for agent in agents]
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                return failed[0]
            if all(code == 0 for code in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                return 124
            time.sleep(0.1)
    finally:
        for agent in agents:  # each agent leads its own session: it and its ranks go together
            if agent.poll() is None:
                try:
                    os.killpg(agent.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for agent in agents:
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
