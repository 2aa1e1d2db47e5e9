"""bench/train_vs_ddp.py: the arithmetic of the comparison (single-process), and one
tiny round of both sides end to end (slow; no timing is asserted, only that both
sides ran the same steps and their loss curves agree)."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "train_vs_ddp.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_vs_ddp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(losses, step_s, start_s=100.0):
    return {"losses": losses, "stamps_s": [start_s + step_s * (index + 1) for index in range(len(losses))]}


def test_tokens_per_s_counts_the_steps_after_warmup_over_their_time(bench):
    stamps = [10.0, 10.5, 11.0, 13.0]  # the end of steps 0..3
    assert bench.tokens_per_s(stamps, 1, 100) == pytest.approx(300 / 3.0)
    assert bench.tokens_per_s(stamps, 3, 100) == pytest.approx(100 / 2.0)
    for warmup in (0, 4):
        with pytest.raises(ValueError, match="warmup"):
            bench.tokens_per_s(stamps, warmup, 100)


def test_the_block_figure_takes_the_median_block_and_each_block_holds_whole_steps(bench):
    # steps 0..8 end at these times; warmup 1, blocks of 2 steps: (0.5, 1.0, 4.0, 1.0) seconds
    stamps = [0.0, 0.2, 0.5, 0.8, 1.5, 3.0, 5.5, 6.0, 6.5]
    assert bench.block_tokens_per_s(stamps, 1, 10, 2) == pytest.approx(20 / 1.0)
    assert bench.block_tokens_per_s(stamps, 1, 10, 3) == pytest.approx(30 / statistics.median([0.8, 4.7]))
    with pytest.raises(ValueError, match="block"):
        bench.block_tokens_per_s(stamps, 1, 10, 9)


def test_compare_gives_medians_the_per_round_ratios_and_their_spread(bench):
    losses = [4.0, 3.5, 3.0]
    rounds = [{"plait": _run(losses, 0.1), "plain": _run(losses, 0.1)},      # ratio 1
              {"plait": _run(losses, 0.2), "plain": _run(losses, 0.1)},      # 0.5
              {"plait": _run(losses, 0.1), "plain": _run(losses, 0.125)}]    # 1.25
    summary = bench.compare(rounds, warmup=1, tokens_per_step=10, block=1)
    assert summary["median_tokens_per_s"]["plait"] == pytest.approx(100.0)
    assert summary["median_tokens_per_s"]["plain"] == pytest.approx(100.0)
    assert summary["round_ratios"] == pytest.approx([1.0, 0.5, 1.25])
    assert (summary["round_ratio_min"], summary["median_round_ratio"], summary["round_ratio_max"]) == \
        pytest.approx((0.5, 1.0, 1.25))
    assert summary["ratio_of_medians"] == pytest.approx(1.0)
    assert summary["max_loss_difference"] == 0.0 and summary["losses_agree"]
    assert summary["block_round_ratios"] == pytest.approx([1.0, 0.5, 1.25])


def test_loss_curves_that_differ_beyond_the_tolerance_do_not_agree(bench):
    plait, plain = [4.0, 3.5, 3.0], [4.0, 3.5, 3.0 + 2 * bench.LOSS_TOLERANCE]
    summary = bench.compare([{"plait": _run(plait, 0.1), "plain": _run(plain, 0.1)}], warmup=1, tokens_per_step=10,
                            block=1)
    assert not summary["losses_agree"]
    assert summary["max_loss_difference"] == pytest.approx(2 * bench.LOSS_TOLERANCE)
    with pytest.raises(ValueError, match="3 and 2 steps"):
        bench.compare([{"plait": _run(plait, 0.1), "plain": _run(plain[:2], 0.1)}], warmup=1, tokens_per_step=10,
                      block=1)


@pytest.mark.slow
def test_one_tiny_round_of_both_sides_runs_and_their_losses_agree(bench, tmp_path, capsys):
    out = tmp_path / "bench"
    code = bench.main(["--rounds", "1", "--steps", "4", "--warmup", "1", "--block", "1", "--dp", "2", "--out", str(out),
                       "--transport", "gloo", "--",
                       "--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--global-batch", "4",
                       "--data-max-bytes", "60000", "--timeout-s", "120"])
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0, capsys.readouterr()
    (entry,) = summary["rounds"]
    for side in ("plait", "plain"):
        assert len(entry[side]["losses"]) == len(entry[side]["stamps_s"]) == 4, side
        assert all(math.isfinite(loss) and 2.0 < loss < 6.0 for loss in entry[side]["losses"]), entry[side]
    report = json.loads((out / "round0-plait" / "report.json").read_text())  # a real `plait train` run
    assert report["run"]["config"]["transport"] == "gloo"  # --transport reaches plait train
    assert summary["losses_agree"] and summary["max_loss_difference"] <= bench.LOSS_TOLERANCE
    assert summary["ratio_of_medians"] > 0 and len(summary["round_ratios"]) == 1
    assert "ratio" in (out / "summary.txt").read_text()
