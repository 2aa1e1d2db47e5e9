"""`plait bench` end to end: spawned gloo workers, nccl-tests output, JSON/CSV/PNG,
--check against the oracle, user errors and worker failures."""

import csv
import io
import json
import os
import subprocess
import sys
import time
from contextlib import redirect_stdout

import pytest
import torch.distributed as dist

from plait.bench.collectives import BenchConfig, available_algorithms
from plait.bench.launch import WorkerError, spawn_and_run
from plait.cli.main import main

TINY = ["--min-bytes", "1K", "--max-bytes", "4K", "--iters", "2", "--warmup", "1"]
SIZES = [1024, 2048, 4096]


def parse_blocks(text):
    """{algorithm: [data row fields]} from nccl-tests style output."""
    blocks, current = {}, None
    for line in text.splitlines():
        if line.startswith("# algorithm: "):
            current = line.removeprefix("# algorithm: ").strip()
            blocks[current] = []
        elif line and not line.startswith("#"):
            assert current is not None, f"data row before any block: {line!r}"
            blocks[current].append(line.split())
    return blocks


@pytest.fixture(scope="module")
def all_reduce_run(tmp_path_factory):
    """One checked all_reduce run over torch and every plait algorithm, all outputs on."""
    directory = tmp_path_factory.mktemp("bench")
    paths = {name: str(directory / name) for name in ("rows.json", "rows.csv", "busbw.png")}
    stdout = io.StringIO()
    with redirect_stdout(stdout):
        status = main(["bench", "all_reduce", "--nprocs", "2", *TINY, "--check",
                       "--json", paths["rows.json"], "--csv", paths["rows.csv"],
                       "--plot", paths["busbw.png"]])
    return status, stdout.getvalue(), paths


@pytest.mark.timeout(300)
def test_output_has_one_block_per_algorithm(all_reduce_run):
    status, text, _ = all_reduce_run
    assert status == 0, text
    algorithms = available_algorithms("all_reduce")
    blocks = parse_blocks(text)
    assert list(blocks) == algorithms
    for algorithm, rows in blocks.items():
        assert [int(fields[0]) for fields in rows] == SIZES, algorithm
        for fields in rows:
            assert len(fields) == 9
            size, count, type_name, redop, root = fields[:5]
            assert (int(count), type_name, redop, root) == (int(size) // 4, "float", "sum", "-1")
            time_us, algbw, busbw = map(float, fields[5:8])
            assert time_us > 0
            assert algbw == pytest.approx(int(size) / time_us / 1e3, rel=0.05, abs=2e-3)
            assert busbw == pytest.approx(algbw, abs=2e-3)  # 2(p-1)/p = 1 for p = 2
            assert fields[8] == "0", f"{algorithm} computed wrong values: {fields}"
    assert "# plait bench all_reduce: nprocs 2  backend gloo" in text
    assert "# plait's argument check: inband" in text
    if len(algorithms) > 1:
        assert "# Best plait vs torch, all sizes:" in text


@pytest.mark.timeout(300)
def test_json_csv_and_plot(all_reduce_run):
    status, _, paths = all_reduce_run
    assert status == 0
    algorithms = available_algorithms("all_reduce")
    with open(paths["rows.json"]) as stream:
        rows = json.load(stream)
    assert len(rows) == len(algorithms) * len(SIZES)
    keys = {"collective", "algorithm", "nprocs", "size_bytes", "count", "dtype", "op", "root",
            "time_us", "algbw_gbps", "busbw_gbps", "wrong"}
    assert all(keys <= set(row) for row in rows)
    assert {row["algorithm"] for row in rows} == set(algorithms)
    assert all(row["wrong"] == 0 and row["nprocs"] == 2 and row["dtype"] == "float32"
               and row["op"] == "sum" and row["root"] == -1 and row["time_us"] > 0 for row in rows)
    with open(paths["rows.csv"], newline="") as stream:
        csv_rows = list(csv.DictReader(stream))
    assert [(row["algorithm"], int(row["size_bytes"])) for row in csv_rows] == \
        [(row["algorithm"], row["size_bytes"]) for row in rows]
    assert float(csv_rows[0]["busbw_gbps"]) == pytest.approx(rows[0]["busbw_gbps"])
    with open(paths["busbw.png"], "rb") as stream:
        assert stream.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_json_to_stdout_keeps_table_on_stderr(capsys):
    status = main(["bench", "broadcast", "--nprocs", "2", *TINY, "--algorithms", "torch",
                   "--root", "1", "--json", "-"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    rows = json.loads(captured.out)
    assert [(row["size_bytes"], row["op"], row["root"]) for row in rows] == \
        [(size, "none", 1) for size in SIZES]
    assert rows[0]["wrong"] is None
    assert "# algorithm: torch" in captured.err


# Every collective, torch and every plait algorithm, a world size that is not a power
# of two, a non-zero root and sizes not divisible by p.
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                        "reduce", "gather", "scatter", "all_to_all", "barrier"])
def test_check_every_collective(collective, capsys):
    status = main(["bench", collective, "--nprocs", "3", "--min-bytes", "1K", "--max-bytes", "2K",
                   "--iters", "1", "--warmup", "1", "--root", "2", "--check"])
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    blocks = parse_blocks(captured.out)
    assert list(blocks) == available_algorithms(collective)
    for algorithm, rows in blocks.items():
        assert rows, f"{algorithm}: no rows\n{captured.out}"
        assert all(fields[8] == "0" for fields in rows), (algorithm, rows)


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "allreduse"], "valid: all_reduce, reduce_scatter"),
    (["bench", "all_reduce", "--algorithms", "rign,torch"], "unknown algorithm(s) 'rign'"),
    (["bench", "all_reduce", "--max-bytes", "4X"], "invalid size '4X'"),
    (["bench", "all_reduce", "--op", "xor"], "invalid choice: 'xor'"),
    (["bench", "all_reduce", "--dtype", "float8"], "unknown dtype 'float8'"),
    (["bench", "all_reduce", "--nprocs", "2", "--root", "2"], "--root 2 must be <"),
    (["bench", "all_reduce", "--nprocs", "2", "--min-bytes", "8K", "--max-bytes", "1K"],
     "min_nbytes(8192) <= max_nbytes(1024)"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_user_errors_exit_non_zero_with_the_fix(argv, fragment, capsys):
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 2
    assert fragment in captured.err


def test_unknown_algorithm_lists_valid_ones(capsys):
    assert main(["bench", "all_gather", "--algorithms", "nope"]) == 2
    err = capsys.readouterr().err
    assert ", ".join(available_algorithms("all_gather")) in err


def _failing_worker(rank, world_size, init_method, backend, config, events):
    import traceback

    if rank == 1:
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=world_size)
            raise RuntimeError("boom on rank 1")
        except RuntimeError:
            events.put(("failed", (rank, traceback.format_exc())))
            events.close()
            events.join_thread()
            os._exit(1)
    from plait.bench.launch import _worker

    _worker(rank, world_size, init_method, backend, config, events)


def _crashing_worker(rank, world_size, init_method, backend, config, events):
    if rank == 1:
        os._exit(3)  # dies without a word, like a segfault
    from plait.bench.launch import _worker

    _worker(rank, world_size, init_method, backend, config, events)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target, fragment", [(_failing_worker, "RuntimeError: boom on rank 1"),
                                              (_crashing_worker, "rank 1 died with exit code 3")])
def test_worker_failure_raises_with_traceback_not_hang(target, fragment):
    config = BenchConfig(collective="all_reduce", algorithms=("torch",), max_nbytes=1024,
                         iters=1, warmup=1, timeout_s=60)
    start_s = time.monotonic()
    with pytest.raises(WorkerError, match="worker") as error:
        spawn_and_run(config, 2, "gloo", lambda kind, payload: None, target=target)
    assert fragment in str(error.value)
    # Rank 0 sits in the rendezvous or a collective waiting for rank 1; the parent
    # must stop it well before the 60 s collective timeout.
    assert time.monotonic() - start_s < 40


@pytest.mark.timeout(120)
def test_python_dash_m_plait_entry_point(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    result = subprocess.run([sys.executable, "-m", "plait", "bench", "barrier", "--nprocs", "2",
                             "--iters", "2", "--warmup", "1", "--algorithms", "torch"],
                            capture_output=True, text=True, env=env, timeout=100)
    assert result.returncode == 0, result.stderr
    rows = parse_blocks(result.stdout)["torch"]
    assert len(rows) == 1 and rows[0][:5] == ["0", "0", "none", "none", "-1"]
    help_result = subprocess.run([sys.executable, "-m", "plait", "--help"], capture_output=True,
                                 text=True, env=env, timeout=100)
    assert help_result.returncode == 0 and "bench" in help_result.stdout
    assert not dist.is_initialized()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_inside_torchrun_uses_the_launched_world(tmp_path):
    """Without --nprocs, under torchrun, every rank joins the env:// world; rank 0 reports."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    json_path = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "plait", "bench", "all_gather", *TINY, "--algorithms", "torch,ring", "--check",
         "--json", str(json_path)],
        capture_output=True, text=True, env=env, timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("# plait bench all_gather: nprocs 2") == 1  # rank 0 only
    blocks = parse_blocks(result.stdout)
    assert list(blocks) == ["torch", "ring"]
    assert all(fields[8] == "0" for rows in blocks.values() for fields in rows)
    rows = json.loads(json_path.read_text())
    assert [row["size_bytes"] for row in rows] == SIZES * 2


@pytest.mark.timeout(300)
def test_rounds_repeat_the_sweep_and_report_the_median(capsys):
    status = main(["bench", "all_reduce", "--nprocs", "2", *TINY, "--rounds", "3",
                   "--algorithms", "torch,ring"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "rounds 3" in captured.out
    blocks = parse_blocks(captured.out)
    assert list(blocks) == ["torch", "ring"] and all(len(rows) == 3 for rows in blocks.values())
    progress = [line for line in captured.err.splitlines() if line.startswith("# measuring: round")]
    assert len(progress) == 3 * len(SIZES) and progress[-1].startswith("# measuring: round 3/3")


def test_median_row_picks_the_middle_round():
    from plait.bench.collectives import BenchRow, median_row

    rows = [BenchRow(collective="all_reduce", algorithm="ring", nprocs=2, size_bytes=8, count=2,
                     dtype="float32", op="sum", root=-1, time_us=t) for t in (5.0, 1.0, 3.0)]
    assert median_row(rows).time_us == 3.0
    rows[1].error = "boom"
    assert median_row(rows).error == "boom"


def test_a_transport_suffix_runs_the_algorithm_on_that_transport(tmp_path, capsys):
    rows_path = tmp_path / "rows.json"
    status = main(["bench", "all_reduce", "--nprocs", "2", *TINY, "--check", "--algorithms",
                   "torch,auto,ring@gloo,ring@shm", "--json", str(rows_path)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    rows = json.loads(rows_path.read_text())
    assert {row["algorithm"] for row in rows} == {"torch", "auto", "ring@gloo", "ring@shm"}
    assert all(row["wrong"] == 0 for row in rows)
    assert "% of memcpy" in captured.out and "memcpy (one core" in captured.out


def transports_of_bench_groups(rank, world_size):
    from plait.bench.collectives import _configure_plait

    import plait.comm as comm

    config = BenchConfig(collective="all_reduce", algorithms=("auto", "auto@gloo", "ring@shm"), transport="gloo")
    communicators = _configure_plait(config)
    described = {str(key): communicator.transport.description for key, communicator in communicators.items()}
    for key, communicator in communicators.items():
        if key is not None:
            comm.destroy_process_group(communicator)
    comm.init_communicator(None, comm.CommConfig())  # the pool's world goes back to its defaults
    return described


def test_bench_transport_flag_and_suffixes_build_communicators_of_those_transports():
    from plait.testing import run_distributed

    for described in run_distributed(transports_of_bench_groups, 2):
        assert described["None"] == "gloo" and described["gloo"] == "gloo"
        assert described["shm"].startswith("shm with group ranks [0, 1]")


def test_an_unknown_transport_suffix_is_refused(capsys):
    assert main(["bench", "all_reduce", "--algorithms", "ring@tcp"]) == 2
    assert "ring@gloo" in capsys.readouterr().err
