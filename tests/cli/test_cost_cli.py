"""`plait cost table` and `plait tune --show`: outputs parse and carry the model's numbers."""

from __future__ import annotations

import json

import pytest

from plait.cli.main import main
from plait.cost import LinkModel
from plait.cost.alpha_beta import predict_time_s


def _json_out(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cost_table_json_rows(capsys):
    rows = _json_out(capsys, ["cost", "table", "--p", "8", "--nbytes", "100MB", "--alpha", "5us",
                              "--bandwidth", "100Gb/s", "--json"])
    by_name = {row["algorithm"]: row for row in rows}
    assert set(by_name) >= {"star", "ring", "tree", "recursive_doubling", "halving_doubling", "direct"}
    for row in rows:
        assert set(row) == {"algorithm", "rounds", "bytes_per_worker", "total_bytes", "links_per_worker", "time_s"}
    n, p = 100 << 20, 8
    ring = by_name["ring"]
    assert ring["rounds"] == 2 * (p - 1) and ring["links_per_worker"] == 2
    assert ring["bytes_per_worker"] == 2 * (p - 1) * n // p and ring["total_bytes"] == 2 * (p - 1) * n
    star = by_name["star"]
    assert star["rounds"] == 2 and star["links_per_worker"] == p - 1 and star["bytes_per_worker"] == (p - 1) * n
    link = LinkModel(5e-6, 1 / 12.5e9)
    for name, row in by_name.items():
        assert row["time_s"] == pytest.approx(predict_time_s("all_reduce", name, n, p, link), rel=1e-12)


def test_cost_table_text(capsys):
    assert main(["cost", "table", "--p", "5", "--nbytes", "1MB", "--alpha", "1ms", "--bandwidth", "1GB/s"]) == 0
    out = capsys.readouterr().out
    assert "halving_doubling" in out and "vs best" in out and "1.00x" in out


@pytest.mark.parametrize("argv,message", [
    (["--bandwidth", "fast"], "invalid bandwidth 'fast'"),
    (["--alpha", "soon"], "invalid time 'soon'"),
    (["--nbytes", "-3"], "invalid size"),
])
def test_cost_table_bad_flags(capsys, argv, message):
    assert main(["cost", "table"] + argv) == 2
    assert message in capsys.readouterr().err


def test_cost_table_refuses_huge_worlds(capsys):
    assert main(["cost", "table", "--p", "5000", "--alpha", "1us", "--bandwidth", "1GB/s"]) == 2
    assert "plait simulate" in capsys.readouterr().err


def test_tune_show_json_covers_the_range(capsys):
    rows = _json_out(capsys, ["tune", "--show", "--p", "8", "--alpha", "1ms", "--bandwidth", "10GB/s",
                              "--max-bytes", "1GB", "--json"])
    assert rows[0]["min_bytes"] == 1 and rows[-1]["max_bytes"] == 1 << 30
    assert all(a["max_bytes"] + 1 == b["min_bytes"] for a, b in zip(rows, rows[1:]))
    assert rows[0]["algorithm"] == "direct" and rows[-1]["algorithm"] == "halving_doubling"


def test_tune_show_without_profile_prints_the_table(capsys):
    assert main(["tune", "--show", "--p", "4"]) == 0
    out = capsys.readouterr().out
    assert "default table" in out and "star" in out and "ring" in out


def test_tune_show_override(capsys, monkeypatch):
    monkeypatch.setenv("PLAIT_ALGORITHMS", "all_reduce=tree")  # the CLI passes it down
    rows = _json_out(capsys, ["tune", "--p", "4", "--alpha", "1ms", "--bandwidth", "1GB/s", "--json"])
    assert [row["algorithm"] for row in rows] == ["tree"]
