"""`plait ... | head -1`: a reader that closes the pipe early ends plait quietly with
status 141 (128 + SIGPIPE, what a shell reports for a process killed by SIGPIPE).

Real processes and real pipes: the failure this guards against (a BrokenPipeError
traceback, or "Exception ignored" from the interpreter's last flush) only happens there.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import plait

pytestmark = pytest.mark.slow  # real plait processes, about 1.3 s each

EXIT_BROKEN_PIPE = 141
SOURCE_DIR = str(Path(plait.__file__).resolve().parents[1])

# about 130 KB of output: more than a pipe holds (64 KiB), so plait is still writing
# when the reader goes away, whatever the timing
LONG_OUTPUT = ["schedule", "all_reduce", "ring", "--nprocs", "64", "--numel", "640", "--max-steps", "1000"]
SHORT_OUTPUTS = {
    "help": ["--help"],
    "bench help": ["bench", "dp", "--help"],
    "tune": ["tune", "--collective", "all"],
    "cost": ["cost", "table", "--p", "8"],
    "schedule": ["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"],
}


def plait_env(buffered: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [SOURCE_DIR, os.environ.get("PYTHONPATH")]))}
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"  # every print goes straight to the pipe
    return env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_reader_closing_after_one_line(buffered):
    """As `plait schedule ... | head -1`: read one line, close, plait is still writing."""
    process = subprocess.Popen([sys.executable, "-m", "plait", *LONG_OUTPUT], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=plait_env(buffered))
    first_line = process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read().decode()
    status = process.wait(timeout=100)
    assert first_line.startswith(b"ring all_reduce: p=64")
    assert stderr == ""  # no traceback, no "Exception ignored in: <_io.TextIOWrapper ...>"
    assert status == EXIT_BROKEN_PIPE


# Unbuffered, argparse writes --help itself and ignores the failed write: nothing is
# left to fail and plait exits 0 quietly, as it always did; those two are not cases here.
CASES = [(name, buffered) for name in SHORT_OUTPUTS for buffered in (True, False)
         if buffered or not name.endswith("help")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, buffered", CASES,
                         ids=[f"{name}-{'buffered' if buffered else 'unbuffered'}" for name, buffered in CASES])
def test_reader_already_gone(name, buffered):
    """Short outputs fit in the pipe, so the reader closes its end before plait starts:
    the first write (or the last flush) meets the closed pipe every time."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "plait", *SHORT_OUTPUTS[name]], stdout=write_end,
                                stderr=subprocess.PIPE, env=plait_env(buffered), timeout=100)
    finally:
        os.close(write_end)
    assert result.stderr.decode() == ""
    assert result.returncode == EXIT_BROKEN_PIPE


def test_a_broken_pipe_elsewhere_is_still_an_error(monkeypatch):
    """Only a closed stdout/stderr is quiet: a BrokenPipeError from another pipe (a
    worker's, say) while the output is fine keeps its traceback. (A guard on the fix:
    the old code raised here too.)"""
    from plait.cli.main import main

    def lose_a_worker(args):
        raise BrokenPipeError("the pipe to a worker")

    monkeypatch.setattr("plait.cli.tune.run", lose_a_worker)
    with pytest.raises(BrokenPipeError, match="to a worker"):
        main(["tune"])
