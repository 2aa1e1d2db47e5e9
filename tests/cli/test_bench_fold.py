"""`plait bench fold`: a --quick run end to end (the table, the JSON, the PNG), the plateau
rule, and bad flags named. Timings are printed by the run, never asserted."""

import json

import pytest

from plait.bench.fold import plateau_batch, predicted_speedup
from plait.graph.fold import ModelCost
from plait.cli.main import main


def test_quick_run_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "fold"
    assert main(["bench", "fold", "--quick", "--batches", "1,4", "--out", str(out),
                 "--json", str(tmp_path / "fold.json")]) == 0
    text = capsys.readouterr().out
    assert "plateau batch of the unfolded model" in text and "machine balance" in text
    result = json.loads((tmp_path / "fold.json").read_text())
    assert [row["model"] for row in result["models"]] == ["unfolded", "f=2"]
    folded = result["models"][1]
    assert set(folded["throughput"]) == {"1", "4"} and folded["padded_batches"] == [1]
    assert all(cell["min"] <= cell["median"] <= cell["max"] for cell in folded["throughput"].values())
    # one round (--quick): the speedup is the ratio of that round's two rates
    unfolded = result["models"][0]
    for batch in ("1", "4"):
        ratio = folded["samples"][batch][0] / unfolded["samples"][batch][0]
        assert folded["speedup"][batch]["median"] == pytest.approx(ratio, rel=1e-12)
    assert 1.0 < folded["flops_vs_unfolded"] <= 1.035  # the paper's +3.5 % for f = 2
    assert 0.0 <= folded["accuracy"] <= 1.0
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "summary.json").read_text())["plateau_batch"] == result["plateau_batch"]
    assert (out / "report.txt").read_text().startswith("# images/s")


def test_plateau_is_the_smallest_batch_within_ten_percent_of_the_best():
    cells = {1: 100.0, 2: 500.0, 4: 905.0, 8: 1000.0, 16: 950.0}
    assert plateau_batch({b: {"median": v} for b, v in cells.items()}) == 4
    cells[4] = 899.0
    assert plateau_batch({b: {"median": v} for b, v in cells.items()}) == 8


@pytest.mark.parametrize("argv,message", [
    (["--factors", "0"], "--factors: fold factor f=0 must be a positive integer"),
    (["--factors", "2,x"], "invalid --factors '2,x': give integers separated by commas"),
    (["--batches", "0,8"], "--batches 0: batch sizes must be >= 1 images"),
    (["--rounds", "0"], "--rounds 0 must be >= 1"),
    (["--train-images", "50"], "--train-images 50 must be >= 96"),
])
def test_bad_flags_are_named(capsys, argv, message):
    assert main(["bench", "fold", *argv]) == 2
    assert message in capsys.readouterr().err


def test_out_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "fold", "--quick", "--out", str(blocker)]) == 2
    assert "--out" in capsys.readouterr().err


def test_predicted_speedup_two_term_model():
    # half the time in conv/linear (FLOPs unchanged), half in elementwise layers whose bytes
    # halve: 1 / (0.5 · 1 + 0.5 · 0.5) = 4/3
    base = ModelCost(images_per_input=1, flops_per_image=100.0, activation_bytes_per_image=0.0, weight_bytes=0.0,
                     elementwise_bytes_per_image=80.0)
    folded = ModelCost(images_per_input=4, flops_per_image=100.0, activation_bytes_per_image=0.0, weight_bytes=0.0,
                       elementwise_bytes_per_image=40.0)
    split = {"weighted_s_per_image": 2e-5, "elementwise_s_per_image": 2e-5}
    assert predicted_speedup(split, base, folded) == pytest.approx(4 / 3, rel=1e-12)
