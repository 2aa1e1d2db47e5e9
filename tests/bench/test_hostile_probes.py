"""bench/hostile_probes.py works: two of its cheapest probes, through its own main(), judge
this checkout's plait "ok" (on the code before issue 31 both are "BAD": PLAIT_COMM_TIMEOUTS
was silently ignored, a 5,000-character path was an OSError traceback)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "hostile_probes.py"


def load_script():
    spec = importlib.util.spec_from_file_location("hostile_probes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_one_line_error_is_told_from_a_traceback():
    probes = load_script()
    one_line = probes.Run([], 2, "", "plait cost: error: unknown environment variable PLAIT_X\n", 1.0)
    traced = probes.Run([], 1, "", "Traceback (most recent call last):\n  ...\nOSError: [Errno 36]\n", 1.0)
    assert one_line.one_line_error("cost") and not one_line.one_line_error("train")
    assert not traced.one_line_error("cost")


@pytest.mark.slow
def test_two_cheap_probes_judge_this_checkout_ok(tmp_path, capsys):
    probes = load_script()
    names = ["unknown-env-cost-table", "+info-5000-char-path"]
    assert probes.main(["--only", ",".join(names), "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [row["probe"] for row in rows] == names
    assert all(row["outcome"] == "ok" for row in rows), rows
    assert "2 probes: 2 ok, 0 bad" in capsys.readouterr().out
