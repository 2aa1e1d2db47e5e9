"""Every command is bounded before it works (issue 31): sizes past what `plait bench`,
`plait simulate` and `plait schedule` can do here are refused within seconds, in one
line naming the limit, exit 2, before a worker starts or a header is printed.

Each command runs in a fresh interpreter; the time is measured from after its imports
(start-up on a loaded 2-core machine alone can take 5-10 s) to its answer. Before the
limits these commands ran for minutes (or started workers), so the subprocess's own
timeout is the failure."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import plait

pytestmark = pytest.mark.slow  # real plait processes

SOURCE_DIR = str(Path(plait.__file__).resolve().parents[1])
ANSWER_S = 10.0  # the bound on a refusal, after start-up
PROCESS_TIMEOUT_S = 40.0  # start-up + ANSWER_S, with room for a loaded machine
RUNTIME_BYTES = 288 << 20  # a worker's runtime, plait.bench.limits.WORKER_BASE_BYTES (measured 267 MiB)
RANKS_PER_CORE = 4  # plait.bench.limits.MAX_RANKS_PER_CORE

_TIMED_MAIN = """
import importlib, sys, time
import plait.cli.main as cli
importlib.import_module("plait.cli." + sys.argv[1])
started = time.perf_counter()
status = cli.main(sys.argv[3:])
with open(sys.argv[2], "w") as handle:
    handle.write(repr(time.perf_counter() - started))
sys.exit(status)
"""


def run_timed(tmp_path: Path, module: str, argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """(the finished `plait ARGV`, seconds from after its imports to its answer)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [SOURCE_DIR, os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    timing = tmp_path / "answer_s"
    try:
        result = subprocess.run([sys.executable, "-c", _TIMED_MAIN, module, str(timing), *argv], capture_output=True,
                                text=True, env=env, timeout=PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"plait {' '.join(argv)} gave no answer within {PROCESS_TIMEOUT_S:.0f} s")
    return result, float(timing.read_text()) if timing.exists() else math.inf


def assert_refused(result: subprocess.CompletedProcess, answer_s: float, command: str, *words: str) -> str:
    """Exit 2, nothing on stdout, one line `plait COMMAND: error: ...` holding every word, in time."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"plait {command}: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert answer_s < ANSWER_S, answer_s
    return lines[0]


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no MemAvailable in /proc/meminfo")


# ----- plait simulate ------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [
    ["--topology", "dgx-a100", "--nodes", "100000"],  # the finding: 800,000 devices
    ["--topology", "fat-tree", "--nodes", "100000"],
    ["--topology", "ring", "--devices-per-node", "100000"],
])
def test_simulate_huge_preset_refused(tmp_path, argv):
    result, answer_s = run_timed(tmp_path, "simulate", ["simulate", *argv])
    assert_refused(result, answer_s, "simulate", "devices", "16,384", "--nodes")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [
    ["--topology", "dgx-a100", "--nodes", "64"],  # 512 ranks, 3 algorithms: 3 x 4 p (p + 1) transfers
    ["--topology", "local", "--devices-per-node", "300", "--sizes", "1:1GB"],  # 31 sizes
])
def test_simulate_too_many_transfers_refused(tmp_path, argv):
    result, answer_s = run_timed(tmp_path, "simulate", ["simulate", *argv])
    line = assert_refused(result, answer_s, "simulate", "transfers", "--max-transfers")
    if argv[1] == "dgx-a100":  # the estimate, from the same inputs: p = 512, none of the three pipelines
        assert f"{3 * 4 * 512 * (512 + 1):,} transfers" in line


# ----- plait schedule ------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, words", [
    (["all_reduce", "ring", "-n", "100000", "--numel", "10"], [f"{4 * 100000 * 100001:,} transfers", "--max-transfers"]),
    (["all_to_all", "direct", "-n", "100000"], ["transfers", "--max-transfers"]),
    # a chain pipelines in segments (the binomial tree ignores them, and answers at once)
    (["broadcast", "ring", "-n", "8", "--segments", "1000000000"], ["transfers", "--segments"]),
    (["--schedule", "1f1b", "--stages", "10000", "--microbatches", "100000"],
     ["1,000,000,000 forwards", "limit", "(p-1)/(m+p-1) = 0.0909"]),
    (["--schedule", "zero_bubble", "--stages", "16", "--microbatches", "128"], ["m x p = 2,048", "limit"]),
    (["--schedule", "interleaved_1f1b", "--stages", "64", "--microbatches", "1024", "--virtual", "8"], ["524,288 forwards", "limit"]),
    (["--schedule", "1f1b", "--stages", "4096", "--microbatches", "1"], ["cells", "limit"]),
])
def test_schedule_too_large_refused(tmp_path, argv, words):
    result, answer_s = run_timed(tmp_path, "schedule", ["schedule", *argv])
    assert_refused(result, answer_s, "schedule", *words)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module, argv", [
    # algorithms that ignore --segments still answer for any value of it
    ("schedule", ["schedule", "broadcast", "tree", "-n", "8", "--segments", "1000000000"]),
    ("simulate", ["simulate", "--topology", "dgx-a100", "--nodes", "1", "--segments", "1000000000"]),
])
def test_segments_ignored_by_the_algorithm_are_not_counted(tmp_path, module, argv):
    result, answer_s = run_timed(tmp_path, module, argv)
    assert result.returncode == 0, result.stderr[-2000:]
    assert answer_s < ANSWER_S


# ----- plait bench ---------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_bench_bad_topology_refused_before_the_header(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"bad": 1}')
    result, answer_s = run_timed(tmp_path, "bench", ["bench", "all_reduce", "-n", "2", "-b", "1K", "-e", "1K",
                                                     "-a", "ring", "--topology", str(bad)])
    assert_refused(result, answer_s, "bench", str(bad), "malformed topology")


@pytest.mark.timeout(60)
def test_bench_topology_of_other_ranks_refused(tmp_path):
    from plait.cost.presets import preset
    from plait.cost.topology_io import save_topology

    path = tmp_path / "three.json"
    save_topology(preset("local", devices_per_node=3), str(path))
    result, answer_s = run_timed(tmp_path, "bench", ["bench", "all_reduce", "-n", "2", "-b", "1K", "-e", "1K",
                                                     "-a", "auto", "--topology", str(path)])
    assert_refused(result, answer_s, "bench", "places 3 ranks", "2 processes", "--nprocs 3")


@pytest.mark.timeout(60)
def test_bench_more_ranks_than_memory_holds_refused(tmp_path):
    # the finding was --nprocs 1000; any count whose runtimes alone exceed MemAvailable
    nprocs = max(1000, available_bytes() // RUNTIME_BYTES + 1)
    result, answer_s = run_timed(tmp_path, "bench", ["bench", "all_reduce", "--nprocs", str(nprocs), "-b", "1K",
                                                     "-e", "1K", "--allow-oversubscribe"])
    assert_refused(result, answer_s, "bench", f"{nprocs} local processes", "MemAvailable", "288 MiB of runtime")


@pytest.mark.timeout(120)
def test_bench_more_ranks_than_cores_refused(tmp_path):
    cores = len(os.sched_getaffinity(0))
    nprocs = RANKS_PER_CORE * cores + 1
    result, answer_s = run_timed(tmp_path, "bench", ["bench", "all_reduce", "--nprocs", str(nprocs), "-b", "1K",
                                                     "-e", "1K", "-a", "torch", "--iters", "1", "--warmup", "0"])
    if nprocs * (RUNTIME_BYTES + 2 * 1024) > available_bytes():  # a machine short of memory says that first
        assert_refused(result, answer_s, "bench", "MemAvailable")
    else:
        assert_refused(result, answer_s, "bench", f"--nprocs {nprocs}", f"on the {cores} core(s)",
                       "--allow-oversubscribe")


@pytest.mark.timeout(60)
def test_bench_size_past_all_memory_refused(tmp_path):
    # the finding: --min-bytes 100G, 4 workers of 100 GiB buffers each
    result, answer_s = run_timed(tmp_path, "bench", ["bench", "all_reduce", "--min-bytes", "100G", "--max-bytes",
                                                     "100G"])
    assert_refused(result, answer_s, "bench", f"{100 << 30} B", "MemAvailable", "--max-bytes")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_bench_size_between_a_quarter_of_memory_and_all_of_it_refused(tmp_path, collective):
    # two workers, buffers of 30 % of MemAvailable: each buffer would be allocated, but two
    # ranks' buffers and receive scratch (2 x 2 x 30 % for all_reduce) are more than there is
    nbytes = int(0.3 * available_bytes()) // 1024 * 1024
    result, answer_s = run_timed(tmp_path, "bench", ["bench", collective, "-n", "2", "-b", str(nbytes),
                                                     "-e", str(nbytes), "-a", "torch"])
    assert_refused(result, answer_s, "bench", f"{nbytes} B", "MemAvailable")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module, argv, flag", [
    ("bench_dp", ["bench", "dp", "--nprocs"], "--nprocs"),
    ("bench_zero", ["bench", "zero", "--nprocs"], "--nprocs"),
    ("bench_pp", ["bench", "pp", "--stages"], "--stages"),
    ("calibrate", ["calibrate", "--nprocs"], "--nprocs"),
])
def test_sibling_spawners_refuse_more_ranks_than_memory_holds(tmp_path, module, argv, flag):
    nprocs = max(1000, available_bytes() // RUNTIME_BYTES + 1)
    result, answer_s = run_timed(tmp_path, module, [*argv, str(nprocs), "--allow-oversubscribe"])
    command = " ".join(argv[:-1])
    assert_refused(result, answer_s, command, f"{nprocs} local processes", "MemAvailable", f"smaller {flag}"
                   if flag != "--nprocs" else "--nprocs")


@pytest.mark.timeout(60)
def test_bench_pp_stages_refused_before_the_schedules_are_built(tmp_path):
    # before: PpBenchConfig built every schedule at p = 1000 (zero_bubble's list scheduler: hours)
    nprocs = max(1000, available_bytes() // RUNTIME_BYTES + 1)
    result, answer_s = run_timed(tmp_path, "bench_pp", ["bench", "pp", "--stages", f"2,{nprocs}"])
    assert_refused(result, answer_s, "bench pp", f"{nprocs} local processes", "--stages")


@pytest.mark.timeout(60)
def test_calibrate_size_past_memory_refused(tmp_path):
    # each rank holds max(2, p) x the largest size and a receive buffer: the sizes double from
    # 1 KiB up to 60 % of MemAvailable, so the largest is 30-60 % of it and 2 ranks need 3 x that each
    limit = int(0.6 * available_bytes())
    largest = 1024 << (limit // 1024).bit_length() - 1
    result, answer_s = run_timed(tmp_path, "calibrate", ["calibrate", "-n", "2", "-b", "1K", "-e", str(limit)])
    assert_refused(result, answer_s, "calibrate", f"{largest} B", "MemAvailable", "--max-bytes")
