"""`plait bench pp` end to end on a spawned world of 2 ranks (a tiny MLP): one row
per schedule, the replay and formula bubbles, the measured peak activation bytes (live saved storages)
equal to the schedule's prediction; user errors."""

import io
import json
from contextlib import redirect_stdout, redirect_stderr

import pytest

from plait.bench.pp import PpBenchConfig, formula_bubble
from plait.cli.main import main

TINY = ["--stages", "2", "--layers", "4", "--width", "32", "--batch", "8", "--microbatches", "4", "--steps", "1",
        "--warmup", "0"]


def test_bench_pp_rows(tmp_path):
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["bench", "pp", *TINY, "--json", str(tmp_path / "pp.json"),
                       "--timeline-out", str(tmp_path / "timelines")])
    assert status == 0, out.getvalue()
    rows = {row["schedule"]: row for row in json.loads((tmp_path / "pp.json").read_text())["rows"]}
    assert sorted(rows) == ["1f1b", "chimera", "gpipe", "interleaved_1f1b", "zero_bubble"]
    for name, row in rows.items():
        assert row["bubble_unit_replay"] == pytest.approx(row["bubble_formula"], abs=1e-12)  # p = 2, m = 4
        assert row["measured_bytes"] == row["predicted_bytes"]  # live saved storages freed where the schedule says
        assert 0.0 <= row["bubble_measured"] < 1.0
        assert (tmp_path / "timelines" / f"{name}-p2.json").exists()
    assert rows["gpipe"]["in_flight"] == [4, 4] and rows["1f1b"]["in_flight"] == [2, 1]
    assert rows["1f1b"]["in_flight_formula"] == [2, 1]
    assert formula_bubble("1f1b", 2, 4, 1) == 1 / 5


def test_bench_pp_user_errors():
    with pytest.raises(ValueError, match=r"--stages 4: interleaved_1f1b needs microbatches \(m=6\)"):
        PpBenchConfig(stages=(4,), microbatches=6)
    with pytest.raises(ValueError, match=r"layers=4 cannot fill 4 stages x 2 virtual chunks: use --layers >= 8"):
        PpBenchConfig(stages=(4,), layers=4)
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["bench", "pp", "--schedules", "zb"]) == 2
    assert "schedules ['zb']: choose from" in err.getvalue()
