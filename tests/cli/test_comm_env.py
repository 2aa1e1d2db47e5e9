"""A bad PLAIT_COMM_* variable stops plait before any work with one clean line, exit 2.

Real processes: plait.comm reads the variables once, when it is first imported.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import plait

pytestmark = pytest.mark.slow  # real plait processes, about 1.3 s each

SOURCE_DIR = str(Path(plait.__file__).resolve().parents[1])


def run_plait(argv: list[str], **variables: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **variables,
           "PYTHONPATH": os.pathsep.join(filter(None, [SOURCE_DIR, os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "plait", *argv], capture_output=True, text=True, env=env,
                          timeout=100)


def assert_one_clean_line(result: subprocess.CompletedProcess, prefix: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(prefix), lines[0]


@pytest.mark.timeout(120)
def test_zero_timeout_stops_tune():
    # before: accepted, and every collective would have timed out at once
    result = run_plait(["tune"], PLAIT_COMM_TIMEOUT_S="0")
    assert_one_clean_line(result, "plait tune: error: PLAIT_COMM_TIMEOUT_S='0': ")


@pytest.mark.timeout(120)
def test_unparsable_segment_size_stops_train():
    result = run_plait(["train", "--steps", "1"], PLAIT_COMM_SEGMENT_BYTES="abc")
    assert_one_clean_line(result, "plait train: error: PLAIT_COMM_SEGMENT_BYTES='abc': ")


@pytest.mark.timeout(120)
def test_bad_check_spelling_stops_bench_dp_before_its_own_flags():
    # --nprocs x would be the next error; the environment is checked first
    result = run_plait(["bench", "dp", "--nprocs", "x"], PLAIT_COMM_CHECK="maybe")
    assert_one_clean_line(result, "plait bench dp: error: PLAIT_COMM_CHECK='maybe': ")


@pytest.mark.timeout(120)
def test_help_with_a_bad_variable_reports_it():
    result = run_plait(["--help"], PLAIT_COMM_TIMEOUT_S="nan")
    assert_one_clean_line(result, "plait: error: PLAIT_COMM_TIMEOUT_S='nan': ")
