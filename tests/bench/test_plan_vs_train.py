"""bench/plan_vs_train_stats.py: the arithmetic of bench/plan_vs_train.py (single-process,
milliseconds): the grid plait train accepts, the alternated order, Spearman (scipy's
spearmanr as the oracle), the ratios, and reading a report's measured parts."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
from scipy.stats import spearmanr

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "plan_vs_train_stats.py"
SIX = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]


@pytest.fixture(scope="module")
def stats():
    spec = importlib.util.spec_from_file_location("plan_vs_train_stats", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_grid_holds_zero_only_with_dp_and_stage_3_only_without_a_pipeline(stats):
    modes, stages = ["none", "selective", "full"], [0, 1, 2, 3]
    cross = stats.build_grid(SIX, modes, stages, "cross")
    # per mode: dp4 4 stages, dp2xtp2 4, dp2xpp2 3 (no stage 3), tp4, pp4, tp2xpp2 stage 0 only
    assert len(cross) == 3 * (4 + 4 + 3 + 1 + 1 + 1)
    assert all(c.zero == 0 or c.dp > 1 for c in cross) and all(c.zero < 3 or c.pp == 1 for c in cross)
    assert {c.label for c in cross if c.layout == "dp2xpp2" and c.recompute == "full"} == \
        {"dp2xpp2 z0 full", "dp2xpp2 z1 full", "dp2xpp2 z2 full"}
    star = stats.build_grid(SIX, modes, stages, "star")
    # the stages at recompute none (14) + selective and full at stage 0 (6 layouts x 2)
    assert len(star) == 14 + 12
    assert all(c.recompute == "none" or c.zero == 0 for c in star)
    assert len({c.slug for c in cross}) == len(cross)
    offloaded = stats.build_grid(SIX, modes, stages, "cross", offload=True)
    assert len(offloaded) == len(cross) + 3 * (3 + 3 + 2)  # each stage > 0 once more, offloaded
    assert all(stats.Config.from_label(c.label) == c for c in offloaded)


def test_repeats_alternate_over_the_whole_grid(stats):
    assert stats.run_order(3, 2) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_spearman_agrees_with_scipy_with_and_without_ties(stats):
    cases = [([1, 2, 3, 4], [10, 20, 30, 40]), ([1, 2, 3, 4], [4, 3, 2, 1]),
             ([1, 2, 2, 3], [1, 3, 2, 4]), ([0.3, 0.1, 0.2, 0.2, 0.9], [5, 1, 1, 2, 3])]
    for xs, ys in cases:
        assert stats.spearman(xs, ys) == pytest.approx(spearmanr(xs, ys).statistic, rel=1e-12)
    assert stats.ranks_of([3.0, 1.0, 3.0]) == [2.5, 1.0, 2.5]
    assert stats.spearman([1.0], [2.0]) is None and stats.spearman([1, 1], [1, 2]) is None


def test_compare_gives_ratios_ranks_geomean_and_the_errors_within_15_percent(stats):
    rows = [{"predicted_s": 0.1, "measured_s": 0.11}, {"predicted_s": 0.2, "measured_s": 0.4},
            {"predicted_s": 0.4, "measured_s": 0.3}]
    out = stats.compare(rows, {"a": [0, 1], "b": [1, 2], "alone": [2]})
    assert [row["ratio"] for row in rows] == pytest.approx([1.1, 2.0, 0.75], rel=1e-12)
    assert [row["measured_rank"] for row in rows] == [1, 3, 2]
    assert out["geomean_ratio"] == pytest.approx((1.1 * 2.0 * 0.75) ** (1 / 3), rel=1e-12)
    assert out["max_abs_error"] == pytest.approx(1.0) and out["within_15pct"] == 1 and out["count"] == 3
    assert out["spearman"] == pytest.approx(0.5) and out["spearman_per_group"] == {"a": 1.0, "b": -1.0}


def test_summary_over_repeats_is_the_median_and_the_relative_spread(stats):
    out = stats.summarize([0.3, 0.1, 0.2])
    assert (out["median"], out["min"], out["max"], out["n"]) == (0.2, 0.1, 0.3, 3)
    assert out["spread"] == pytest.approx(1.0)
    assert stats.median_parts([{"compute": 1.0, "data": 4.0}, {"compute": 3.0}, {"compute": 2.0, "data": 2.0}]) == \
        {"compute": 2.0, "data": 3.0}


def test_measured_parts_read_the_fine_breakdown_then_the_ranks_then_the_coarse_split(stats):
    fine = {"time_totals": {}, "step_parts": {"parts_ms": {"compute": {"mean_ms": 5.0, "max_ms": 6.0},
                                                           "dp_comm": {"mean_ms": 1.0}, "wall": {"mean_ms": 7.0}}}}
    out = stats.measured_parts(fine)
    assert out["source"] == "fine" and out["parts_ms"] == {"compute": 5.0, "dp_comm": 1.0} and out["wall_ms"] == 7.0
    rank = {"parts_s": {"wall_s": 9.0, "compute_s": 9.0},
            "steady": {"steps": 2, "parts_s": {"wall_s": 0.5, "compute_s": 0.3, "receive_s": 0.1}}}
    other = {"parts_s": {}, "steady": {"steps": 4, "parts_s": {"wall_s": 0.4, "compute_s": 0.2, "receive_s": 0.0}}}
    out = stats.measured_parts({"ranks": [rank, other]})
    assert out["source"] == "fine_ranks"
    assert out["parts_ms"]["compute"] == pytest.approx((150 + 50) / 2) and out["parts_ms"]["receive"] == 25.0
    assert out["wall_ms"] == pytest.approx((250 + 100) / 2) and out["parts_ms"]["tp_comm"] == 0.0
    coarse = {"run": {"steps": 5}, "ranks": [{"wall_s": 1.0}],
              "time_totals": {"ranks": 2, "wall_s": 2.0, "compute_s": 1.0, "comm_s": 0.5, "bubble_s": 0.3,
                              "other_s": 0.2}}
    out = stats.measured_parts(coarse)
    assert out["source"] == "coarse" and out["wall_ms"] == pytest.approx(200.0)
    assert out["parts_ms"] == pytest.approx({"compute": 100.0, "comm": 50.0, "bubble": 30.0, "other": 20.0})
    assert stats.coarse_plan({"compute": 0.01, "tp_comm": 0.002, "dp_comm": 0.001, "pp_bubble": 0.003,
                              "optimizer": 0.0005}) == pytest.approx(
        {"compute": 10.0, "comm": 3.0, "bubble": 3.0, "other": 0.5})
    assert math.isclose(sum(stats.coarse_plan({"pp_comm": 0.004}).values()), 4.0)
