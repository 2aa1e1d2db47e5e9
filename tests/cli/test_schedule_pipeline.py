"""`plait schedule --schedule NAME`: pipeline Gantt charts (ASCII and PNG), bubble and
in-flight activations against their formulas, recorded timelines, and errors; the
collective form `plait schedule <collective> <algorithm>` keeps working."""

import json

import pytest

from plait.cli.main import main
from plait.parallel.pipeline import Interval, Timeline, build, peak_in_flight, replay
from plait.parallel.pipeline.draw import (
    ascii_gantt,
    plot_gantt,
    theory,
    timeline_from_json,
    timeline_peak_in_flight,
    timeline_to_json,
    with_chunk_labels,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["schedule", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def gantt_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("rank ") and " |" in line]


def test_1f1b_bubble_and_formula(capsys):
    code, out, _ = run(capsys, "--schedule", "1f1b", "--stages", "4", "--microbatches", "8")
    assert code == 0
    assert "bubble 0.2727 (mean over ranks), formula (p-1)/(m+p-1) = 0.2727" in out
    assert len(gantt_rows(out)) == 4
    # per-rank table: rank, busy, idle, bubble, formula, in-flight, formula (min(p-r, m))
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert [row[3:] for row in table] == [["0.2727", "0.2727", str(4 - r), str(4 - r)] for r in range(4)]
    assert "rank 0: F0 F1 F2 F3 B0 F4 B1" in out  # compute order


def test_ascii_rows_one_per_rank_and_cells():
    for name, p, m, v in (("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 2, 4, 3), ("chimera", 4, 8, 1)):
        schedule = build(name, p, m, v)
        rows = ascii_gantt(replay(schedule))
        assert len(rows) == p
        assert len({len(row) for row in rows}) == 1  # aligned columns
    rows = ascii_gantt(replay(build("1f1b", 4, 8)))
    assert rows[3] == "rank 3 | . . . 0[00] 1[11] 2[22] 3[33] 4[44] 5[55] 6[66] 7[77] . . . . . .|"
    assert len(ascii_gantt(replay(build("1f1b", 4, 8)), width=20)[0]) == len("rank 0 ||") + 20 * 2


def test_png_written(tmp_path, capsys):
    path = tmp_path / "charts" / "schedule.png"
    code, out, _ = run(capsys, "--schedule", "interleaved_1f1b", "--stages", "4", "--microbatches", "8",
                       "--virtual", "2", "--out", str(path))
    assert code == 0 and f"wrote {path}" in out
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC
    assert "formula ((p-1)/v)/(m+(p-1)/v) = 0.1579" in out


def test_interleaved_needs_multiple(capsys):
    code, _, err = run(capsys, "--schedule", "interleaved_1f1b", "--stages", "4", "--microbatches", "6",
                       "--virtual", "2")
    assert code == 2
    assert err.startswith("plait schedule: error:") and "multiple" in err and "m = 8" in err


def test_chimera_odd_microbatches(capsys):
    code, _, err = run(capsys, "--schedule", "chimera", "--stages", "4", "--microbatches", "7")
    assert code == 2 and "even number of microbatches" in err


@pytest.mark.parametrize("argv, message", [
    (["all_reduce", "ring", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"], "not both"),
    ([], "give a collective and an algorithm"),
    (["all_reduce"], "give a collective and an algorithm"),
    (["all_reduce", "ring", "--stages", "4"], "--stages applies to pipeline schedules only"),
    (["--schedule", "1f1b", "--stages", "4"], "needs --stages P and --microbatches M"),
    (["--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--virtual", "2"], "interleaved_1f1b only"),
    (["--schedule", "zigzag", "--stages", "4", "--microbatches", "8"], "unknown pipeline schedule 'zigzag'"),
    (["--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--out", "chart.svg"], "ending in .png"),
    (["--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--width", "0"], "--width 0"),
])
def test_usage_errors(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and out == ""


def test_collective_schedule_unchanged(capsys):
    code, out, _ = run(capsys, "all_reduce", "ring")
    assert code == 0
    assert "cost: Ring all-reduce" in out and "rounds 6;" in out


def test_timeline_json_round_trip():
    schedule = build("interleaved_1f1b", 4, 8, 2)
    timeline = with_chunk_labels(replay(schedule), schedule)
    document = json.loads(json.dumps(timeline_to_json(timeline, {"schedule": "interleaved_1f1b", "microbatches": 8,
                                                                  "virtual": 2})))
    assert timeline_from_json(document) == timeline
    assert document["meta"]["virtual"] == 2
    assert timeline_peak_in_flight(timeline) == peak_in_flight(schedule) == theory("interleaved_1f1b", 4, 8, 2)[
        "peak_in_flight"]
    with pytest.raises(ValueError, match="format"):
        timeline_from_json({"ranks": 4})
    bad = dict(document, intervals=[dict(document["intervals"][0], rank=9)])
    with pytest.raises(ValueError, match="rank 9"):
        timeline_from_json(bad)


def measured_1f1b(jitter_s: float = 1e-4) -> Timeline:
    """The 1F1B replay scaled to 10 ms forwards, 20 ms backwards, each shifted a little."""
    base = replay(build("1f1b", 4, 8))
    return Timeline(ranks=4, source="measured", intervals=tuple(
        Interval(i.rank, i.label, i.kind, i.microbatch, i.start_s * 0.01 + jitter_s * (n % 3),
                 i.end_s * 0.01 + jitter_s * (n % 3)) for n, i in enumerate(base.intervals)))


def test_recorded_timeline_cli(tmp_path, capsys):
    timeline = measured_1f1b()
    run_json = tmp_path / "run.json"
    run_json.write_text(json.dumps(timeline_to_json(timeline, {"schedule": "1f1b", "microbatches": 8})))
    png = tmp_path / "run.png"
    code, out, _ = run(capsys, "--timeline", str(run_json), "--out", str(png), "--width", "66")
    assert code == 0
    assert "source 'measured'" in out and "busy and idle in ms" in out
    assert len(gantt_rows(out)) == 4
    assert f"bubble {timeline.bubble_fraction():.4f} (mean over ranks), formula (p-1)/(m+p-1) = 0.2727" in out
    assert png.read_bytes()[:8] == PNG_MAGIC
    code, _, err = run(capsys, "--timeline", str(run_json), "--stages", "3")
    assert code == 2 and "does not match the 4 ranks" in err


def test_quantised_real_run_keeps_bubbles():
    rows = ascii_gantt(measured_1f1b(jitter_s=0.0), width=33)
    assert rows == ascii_gantt(replay(build("1f1b", 4, 8)))  # 33 columns = the unit grid


def test_theory_values():
    assert theory("gpipe", 4, 8)["peak_in_flight"] == [8] * 4
    assert theory("1f1b", 4, 8)["peak_in_flight_max"] == 4
    assert theory("chimera", 4, 8)["bubble_fraction"] == pytest.approx(2 / 18)
    assert theory("chimera", 4, 4)["peak_in_flight"] == [3, 4, 4, 3] == peak_in_flight(build("chimera", 4, 4))
    assert theory("chimera", 4, 8)["peak_in_flight"] is None
    assert theory("interleaved_1f1b", 4, 8, 2)["bubble_fraction"] == pytest.approx(1.5 / 9.5)
    with pytest.raises(ValueError, match="m must be an int >= 1, got 0"):
        theory("1f1b", 4, 0)


def test_plot_gantt_rejects_other_formats(tmp_path):
    with pytest.raises(ValueError, match=r"\.png"):
        plot_gantt(replay(build("gpipe", 2, 2)), tmp_path / "x.pdf", "gpipe")
