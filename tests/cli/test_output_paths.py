"""Output files (--json/--csv/--plot/--out/--output/--save-topology/--timeline-out) are
checked before any work: missing directories are made, unusable paths refused (exit 2)."""

import json
import os
import sys

import pytest

from plait.cli.main import main


def refuse_work(*args, **kwargs):
    raise AssertionError("the work started before the output paths were checked")


def no_rows(*args, **kwargs):
    return []


# (command line before the output flag, where its work starts): the name the CLI module
# calls, patched there. Patching the definition (plait.parallel.pipeline.schedules.build)
# leaked: plait.cli.schedule is imported on its first run, and when that run was under the
# patch, its `from ... import build` bound the patched function for every later test.
COMMANDS = {
    "bench": (["bench", "all_reduce", "--nprocs", "2"], "plait.cli.bench.spawn_and_run"),
    "bench dp": (["bench", "dp", "--nprocs", "2", "--compression", "none"], "plait.cli.bench_dp.spawn_and_run"),
    "bench tp": (["bench", "tp", "--tp", "1"], "plait.cli.bench_tp.run_in_fresh_worlds"),
    "bench pp": (["bench", "pp", "--stages", "2"], "plait.cli.bench_pp.run_in_fresh_worlds"),
    "calibrate": (["calibrate", "--nprocs", "2"], "plait.cli.calibrate.spawn_and_run"),
    "simulate": (["simulate", "--topology", "ring", "--nodes", "1", "--devices-per-node", "4", "--nbytes", "1MB",
                  "--algorithm", "ring"], "plait.cli.simulate.simulate_one"),
    "schedule": (["schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2"],
                 "plait.cli.schedule.build"),
}
FILE_FLAGS = [("bench", "--json"), ("bench", "--csv"), ("bench", "--plot"), ("bench dp", "--json"),
              ("bench dp", "--plot"), ("bench tp", "--json"), ("bench pp", "--json"), ("calibrate", "--output"),
              ("simulate", "--plot"), ("simulate", "--save-topology"), ("schedule", "--out")]
SUFFIX = {"--plot": ".png", "--out": ".png", "--csv": ".csv"}


@pytest.fixture(autouse=True)
def clean_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def refused(capsys, argv) -> str:
    """Runs plait; it must exit 2 with one error line and print nothing else."""
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1, captured.err
    return captured.err


@pytest.mark.parametrize("command, flag", FILE_FLAGS, ids=[f"{c} {f}" for c, f in FILE_FLAGS])
def test_existing_directory_is_refused_before_the_work(command, flag, tmp_path, monkeypatch, capsys):
    argv, work = COMMANDS[command]
    monkeypatch.setattr(work, refuse_work)
    directory = tmp_path / f"taken{SUFFIX.get(flag, '.json')}"
    directory.mkdir()
    error = refused(capsys, [*argv, flag, str(directory)])
    assert error.startswith(f"plait {command}: error: {flag} {directory}: ")
    assert "is a directory" in error


@pytest.mark.parametrize("command, flag", [("bench", "--json"), ("simulate", "--plot"), ("bench pp", "--json")])
def test_parent_that_is_a_file_is_refused(command, flag, tmp_path, monkeypatch, capsys):
    argv, work = COMMANDS[command]
    monkeypatch.setattr(work, refuse_work)
    blocker = tmp_path / "results"
    blocker.write_text("a file, not a directory\n")
    target = blocker / "run" / f"out{SUFFIX.get(flag, '.json')}"
    error = refused(capsys, [*argv, flag, str(target)])
    assert f"{flag} {target}: " in error and f"{blocker} is a file" in error
    assert blocker.read_text() == "a file, not a directory\n"


def test_timeline_directory_that_is_a_file_is_refused(tmp_path, monkeypatch, capsys):
    argv, work = COMMANDS["bench pp"]
    monkeypatch.setattr(work, refuse_work)
    blocker = tmp_path / "timelines"
    blocker.write_text("")
    error = refused(capsys, [*argv, "--timeline-out", str(blocker)])
    assert f"--timeline-out {blocker}: " in error and "is a file" in error


@pytest.mark.skipif(not os.path.isdir("/proc") or sys.platform != "linux", reason="needs Linux /proc")
def test_directory_where_no_file_can_be_made_is_refused(monkeypatch, capsys):
    # /proc takes no new files, even from root (for whom permission bits do not count)
    argv, work = COMMANDS["simulate"]
    monkeypatch.setattr(work, refuse_work)
    error = refused(capsys, [*argv, "--save-topology", "/proc/plait-topology.json"])
    assert "--save-topology /proc/plait-topology.json: " in error and "cannot" in error


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes through permission bits")
def test_read_only_directory_is_refused(tmp_path, monkeypatch, capsys):
    argv, work = COMMANDS["bench"]
    monkeypatch.setattr(work, refuse_work)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        error = refused(capsys, [*argv, "--csv", str(locked / "rows.csv")])
    finally:
        locked.chmod(0o700)
    assert "--csv" in error and "cannot" in error


def test_missing_directories_are_made_for_bench_outputs(tmp_path, monkeypatch, capsys):
    """The crash this prevents came after the benchmark: now the files are written."""
    monkeypatch.setattr("plait.cli.bench.spawn_and_run", no_rows)
    json_path, csv_path = tmp_path / "a" / "b" / "rows.json", tmp_path / "c" / "rows.csv"
    assert main(["bench", "all_reduce", "--nprocs", "2", "--json", str(json_path), "--csv", str(csv_path)]) == 0
    assert json.loads(json_path.read_text()) == []
    assert csv_path.read_text().startswith("collective,")
    monkeypatch.setattr("plait.cli.bench_tp.run_in_fresh_worlds", no_rows)
    tp_path = tmp_path / "tp" / "deep" / "tp.json"
    assert main(["bench", "tp", "--tp", "1", "--json", str(tp_path)]) == 0
    assert json.loads(tp_path.read_text())["rows"] == []
    capsys.readouterr()
    assert main(["bench", "tp", "--tp", "1", "--json", "-"]) == 0  # "-" is still standard output
    assert json.loads(capsys.readouterr().out)["rows"] == []
    monkeypatch.setattr("plait.cli.bench_pp.run_in_fresh_worlds", no_rows)
    pp_path, timelines = tmp_path / "pp" / "pp.json", tmp_path / "pp" / "timelines"
    assert main(["bench", "pp", "--stages", "2", "--json", str(pp_path), "--timeline-out", str(timelines)]) == 0
    assert json.loads(pp_path.read_text())["rows"] == [] and timelines.is_dir()


def test_missing_directories_are_made_for_simulate_and_schedule(tmp_path, capsys):
    topology, plot = tmp_path / "t" / "u" / "ring.json", tmp_path / "p" / "links.png"
    argv, _ = COMMANDS["simulate"]
    assert main([*argv, "--save-topology", str(topology), "--plot", str(plot)]) == 0
    assert json.loads(topology.read_text()) and plot.stat().st_size > 0
    gantt = tmp_path / "g" / "h" / "gantt.png"
    argv, _ = COMMANDS["schedule"]
    assert main([*argv, "--out", str(gantt)]) == 0
    assert gantt.stat().st_size > 0


def test_bench_dp_plot_without_compression_is_refused_before_the_work(tmp_path, monkeypatch, capsys):
    """--plot draws the compression runs' loss curves; without them it used to fail at the end."""
    monkeypatch.setattr("plait.cli.bench_dp.spawn_and_run", refuse_work)
    error = refused(capsys, ["bench", "dp", "--nprocs", "2", "--plot", str(tmp_path / "loss.png")])
    assert "--plot draws the loss curves of the compression runs: add --compression" in error


def test_calibrate_checks_its_default_profile_path_too(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("plait.cli.calibrate.spawn_and_run", refuse_work)
    cache = tmp_path / "cache-is-a-file"
    cache.write_text("")
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(cache))
    error = refused(capsys, ["calibrate", "--nprocs", "2"])
    assert f"--output (default) {cache / 'profile-gloo+shm.json'}: {cache} is a file, not a directory" in error
