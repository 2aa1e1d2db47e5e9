"""bench/report_vs_profiler.py: how a rank's torch.profiler trace is attributed (single
process, a hand-made trace whose parts are known) and how the report's parts are grouped
beside it; both sides must add up to the profiled window."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "report_vs_profiler.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_report_vs_profiler", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _span(name, start_us, end_us, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": start_us, "dur": end_us - start_us}


def test_interval_arithmetic(bench):
    a = bench.union([(5, 8), (0, 2), (1, 3), (7, 9)])
    assert a == [(0, 3), (5, 9)]
    assert bench.intersect(a, [(2, 6), (8, 20)]) == [(2, 3), (5, 6), (8, 9)]
    assert bench.subtract(a, [(1, 2), (4, 6), (8, 9)]) == [(0, 1), (2, 3), (6, 8)]
    assert bench.subtract([(0, 10)], [(0, 10)]) == [] and bench.length(a) == 7


def test_a_trace_is_split_into_compute_optimizer_communication_and_idle(bench):
    events = [
        _span("PyTorch Profiler (0)", 0, 100, cat="Trace", tid="PyTorch Profiler"),
        _span("aten::mm", 10, 30), _span("aten::add", 12, 14),  # nested: counted once
        _span("c10d::send", 30, 32),
        _span("gloo:recv", 32, 50, cat="user_annotation"),  # the thread waits 32-50 with a receive in flight
        _span("Optimizer.step#AdamW.step", 50, 60, cat="user_annotation"), _span("aten::add_", 52, 55),
        _span("gloo:send", 60, 70, cat="user_annotation"),  # 60-70: only a send in flight; 70-80 idle
        _span("aten::mm", 80, 85), _span("Optimizer.step#AdamW.step", 85, 90, cat="user_annotation"),
        _span("aten::mm", 95, 99),  # after the last optimizer step: outside the window
        _span("aten::mm", 40, 45, tid=2),  # another thread
    ]
    parts = bench.attribute(events, main_tid=1)
    expected_us = {"window_s": 90, "optimizer_s": 15, "compute_ops_s": 25, "c10d_s": 2, "wait_receive_s": 18,
                   "wait_send_only_s": 10, "idle_s": 20, "other_threads_ops_s": 5}
    assert {key: parts[key] for key in expected_us} == pytest.approx(
        {key: value * 1e-6 for key, value in expected_us.items()}, rel=1e-9)
    assert parts["optimizer_steps"] == 2
    assert parts["comm_op_counts"] == {"c10d::send": 1, "gloo:recv": 1, "gloo:send": 1}
    groups = bench.profiler_groups(parts)
    assert sum(groups[name] for name in ("compute", "optimizer", "communication", "rest")) == \
        pytest.approx(groups["window"], rel=1e-12)
    with pytest.raises(ValueError, match="Optimizer.step"):
        bench.attribute(events[:5], main_tid=1)


def test_the_report_side_covers_the_profiled_steps_and_the_same_window(bench):
    before = {"wall_s": 1.0, "compute_s": 0.5, "tp_comm_s": 0.0, "pp_comm_s": 0.1, "receive_s": 0.1,
              "pp_bubble_s": 0.1, "dp_comm_s": 0.1, "optimizer_s": 0.05, "data_s": 0.02, "other_s": 0.03}
    after = {key: 3 * value for key, value in before.items()}
    out = bench.report_groups(before, after, window_s=2.5)
    groups = out["groups"]
    assert out["fine"] and groups["compute"] == pytest.approx(1.0) and groups["optimizer"] == pytest.approx(0.1)
    assert groups["communication"] == pytest.approx(0.8) and groups["between_steps"] == pytest.approx(0.5)
    assert sum(groups[name] for name in ("compute", "optimizer", "communication", "rest")) == pytest.approx(2.5)
