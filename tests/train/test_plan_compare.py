"""The plan side of the run report, without a run: the run's layout priced by the
planner, the comparison and its drift flag on hand-made measurements, the split of
pipeline receive waits on a hand-made message log, and the one-line refusal of a model
the planner cannot price. Exact arithmetic on given numbers: float64, 1e-12 relative."""

from __future__ import annotations

import pytest

from plait.cost import LinkModel
from plait.cost.profile import DEFAULT_PROFILE_BACKEND, Profile, save_profile
from plait.cost.transport_model import TransportModel
from plait.names.step_parts import DATA, OTHER, PP_BUBBLE, PP_COMM, PRICED_PARTS, STEP_PARTS
from plait.parallel.pipeline.schedules import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD
from plait.train.config import TrainConfig
from plait.train.plan_compare import _link, compare, comparison_lines, price_run, run_device, step_parts_section
from plait.train.step_breakdown import measured_breakdown

RATE = 2e10  # FLOP/s: a given device, not a measurement
EAGER = (10e-6, 5e9)  # s per kernel, bytes/s


def _config(**overrides) -> dict:
    values = dict(layers=2, hidden=16, heads=2, seq_len=8, global_batch=4, micro_batch=2, dp=1, tp=1, pp=2)
    values.update(overrides)
    return TrainConfig(**values).to_dict()


def _measured(parts_ms: dict, wall_ms: float) -> dict:
    rows = {part: {"mean_ms": parts_ms.get(part, 0.0), "max_ms": parts_ms.get(part, 0.0), "max_rank": 0}
            for part in STEP_PARTS}
    rows["wall"] = {"mean_ms": wall_ms, "max_ms": wall_ms, "max_rank": 0}
    return {"parts_ms": rows, "per_rank_ms": {}, "stage_compute_ms": {}, "steps": {"0": 3}, "receive_split": "given"}


def _plan(tmp_path, **overrides):
    return price_run(_config(**overrides), world_size=2, vocab=32, peak_flops_per_s=RATE, eager=EAGER,
                     cache_dir=tmp_path)  # an empty cache: the given rates, a placeholder link


def test_the_run_layout_is_priced_and_a_drift_names_its_part(tmp_path):
    plan, sources = _plan(tmp_path)
    assert (plan.layout.dp, plan.layout.tp, plan.layout.pp, plan.layout.micro_batch) == (1, 1, 2, 2)
    assert "run's own rates" in sources["device"] and "placeholder" in sources["link"]
    plan_ms = {part: 1e3 * plan.time_s.get(part, 0.0) for part in PRICED_PARTS}
    # measured = the plan exactly: no error, no flag
    exact = compare(plan, _measured(plan_ms, 1e3 * plan.step_time_s), sources)
    assert exact["flag"] is None and exact["step"]["error"] == pytest.approx(0.0, abs=1e-12)
    # + 10 ms of data and + the plan's whole step of bubble: the data part differs most
    gap_ms = 10.0 + 1e3 * plan.step_time_s
    slow = dict(plan_ms, **{DATA: 10.0, PP_BUBBLE: plan_ms[PP_BUBBLE] + 1e3 * plan.step_time_s})
    comparison = compare(plan, _measured(slow, 1e3 * plan.step_time_s + gap_ms), sources)
    flag = comparison["flag"]
    expected_cause = DATA if 10.0 > 1e3 * plan.step_time_s else PP_BUBBLE
    assert flag["part"] == expected_cause
    row = comparison["parts"][expected_cause]
    assert flag["difference_ms"] == pytest.approx(row["measured_ms"] - row["plan_ms"], rel=1e-12)
    assert flag["share_of_gap"] * gap_ms == pytest.approx(flag["difference_ms"], rel=1e-12)
    assert comparison["parts"][DATA]["error"] is None and comparison["parts"][OTHER]["plan_ms"] == 0.0
    # faster than planned by > 25%: the part most below its plan is named
    fast = dict(plan_ms, **{part: 0.0 for part in PRICED_PARTS})
    assert compare(plan, _measured(fast, 0.0), sources)["flag"]["drift"] == pytest.approx(-1.0, rel=1e-12)
    lines = comparison_lines({"measured": _measured(slow, 1e3 * plan.step_time_s + gap_ms), "comparison": comparison})
    assert any(line.startswith("DRIFT:") and expected_cause in line for line in lines)


def test_a_model_the_planner_cannot_price_is_said_in_one_line(tmp_path):
    section = step_parts_section(_config(model="mlp", data="digits"), _measured({}, 1.0),
                                 {"world_size": 2, "vocab": None, "peak_flops_per_s": RATE, "eager": EAGER},
                                 cache_dir=tmp_path)
    assert section["comparison"] is None and "mlp" in section["not_priced"]
    assert comparison_lines(section)[0].startswith("plan vs measured: not priced:")


def _rank(rank: int, pp: int, receives, sends, receive_s: float) -> dict:
    parts = {name: 0.0 for name in ("compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s",
                                    "optimizer_s", "data_s", "other_s")}
    parts.update(receive_s=receive_s, wall_s=receive_s)
    return {"rank": rank, "coords": {"dp": 0, "tp": 0, "pp": pp}, "steps": 2, "host": "h",
            "steady": {"steps": 1, "parts_s": parts, "stage_compute_s": {}}, "messages": [(receives, sends)]}


def test_receive_waits_split_by_the_senders_post_times():
    # rank 1 waits for activation (mb 0, stage 0) from 1.0 to 1.5 s; rank 0 posted it at 1.3 s:
    # 0.3 s of rank 0 still computing (bubble), 0.2 s of transfer. Rank 0 waits for the gradient
    # (mb 0, stage 1) from 2.0 to 2.1 s, posted at 1.9 s: all 0.1 s transfer.
    first = _rank(0, 0, [(RECV_GRAD, 0, 1, 2.0, 2.1)], [(SEND_ACT, 0, 0, 1.3)], receive_s=0.1)
    second = _rank(1, 1, [(RECV_ACT, 0, 0, 1.0, 1.5)], [(SEND_GRAD, 0, 1, 1.9)], receive_s=0.5)
    parts = measured_breakdown([first, second])["per_rank_ms"]
    assert parts["1"][PP_COMM] == pytest.approx(200.0, rel=1e-12) and parts["1"][PP_BUBBLE] == pytest.approx(300.0, rel=1e-12)
    assert parts["0"][PP_COMM] == pytest.approx(100.0, rel=1e-12) and parts["0"][PP_BUBBLE] == pytest.approx(0.0, abs=1e-9)
    # on two hosts there is no common clock: the whole wait is bubble
    second["host"] = "other"
    apart = measured_breakdown([first, second])
    assert apart["per_rank_ms"]["1"][PP_BUBBLE] == pytest.approx(500.0, rel=1e-12) and "hosts" in apart["receive_split"]


def test_assumed_eager_costs_are_a_note_of_the_report(tmp_path):
    config = _config()
    _, measured_sources = _plan(tmp_path)  # the run's eager costs given: nothing assumed
    assert not any("assumes" in note for note in measured_sources["notes"]), measured_sources["notes"]
    plan, sources = price_run(config, world_size=2, vocab=32, peak_flops_per_s=RATE, eager=None,
                              cache_dir=tmp_path)
    assert any("4 µs a kernel" in note and "10 GB/s" in note for note in sources["notes"]), sources["notes"]
    measured = _measured({}, 1.0)
    lines = comparison_lines({"measured": measured, "comparison": compare(plan, measured, sources)})
    assert any(line.startswith("note: the run measured no eager kernel costs") for line in lines), lines


def test_the_run_is_priced_with_the_profiles_transport_model_and_eager_kernels(tmp_path):
    """As plait plan --cluster local: a saved format-2 profile's fitted p2p call cost and
    transport model price the run's link; the run's own device runs eagerly."""
    model = TransportModel(alpha_s=20e-6, beta_cache_s_per_byte=1e-10, beta_dram_s_per_byte=2e-10, cache_bytes=1e6,
                           gamma_s_per_byte=1e-10, base_call_s=5e-6, call_s={"all_reduce": 300e-6, "p2p": 30e-6})
    save_profile(Profile(link=LinkModel(alpha_s=20e-6, beta_s_per_byte=1e-10), call_overhead_s=300e-6,
                         backend=DEFAULT_PROFILE_BACKEND, device="cpu", world_size=2, sizes_nbytes=(1024, 2048),
                         samples=(), transport_model=model), cache_dir=tmp_path)
    prices, source = _link(tmp_path)
    assert prices["transport"] == model and prices["p2p_call_s"] == 30e-6 and prices["call_overhead_s"] == 300e-6
    assert "calibration profile (p=2)" in source
    assert run_device(RATE, EAGER, 2).eager and run_device(RATE, None, 2).eager
