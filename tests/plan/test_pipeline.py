"""Pipeline schedules priced from the schedules themselves: the replay agrees with the
library's replay and with the closed forms where they exist, extrapolation in m agrees
with full replays, Chimera's rules are the builder's, and the search prices and ranks
chimera and zero_bubble layouts with cached replays."""

from __future__ import annotations

import pytest

from plait.parallel.pipeline.replay import peak_in_flight, replay
from plait.parallel.pipeline.schedules import build
from plait.plan import Layout, plan
from plait.plan import pipeline
from plait.plan.estimate import estimate
from plait.plan.precision import PRECISIONS
from plait.plan.pipeline import RATIO_STEPS, _base, _closed_form, _replay, price_schedule, schedule_problem

from tests.plan.test_estimate import _cluster, _uniform_groups

CASES = [("gpipe", p, m, 1) for p in (2, 3, 4, 5) for m in (1, 2, 3, 5, 8, 13)]
CASES += [("1f1b", p, m, 1) for p in (2, 3, 4, 5, 7) for m in (1, 2, 3, 4, 6, 9, 14)]
CASES += [("interleaved_1f1b", p, m, v) for p in (2, 3, 4) for v in (2, 3, 4) for m in (p, 2 * p, 3 * p, 5 * p)]


@pytest.mark.parametrize("name,p,m,v", CASES)
@pytest.mark.parametrize("forward", [1, 5, 8, 12, 20])
def test_replayed_bubble_is_the_closed_form(name, p, m, v, forward):
    """DESIGN §6: (p-1)/(m+p-1) for GPipe and 1F1B, the idle divided by v for
    interleaved, at any forward:backward ratio; the peaks are the closed form's too."""
    makespan, peaks, per_chunk = _replay(name, p, m, v, (forward, RATIO_STEPS - forward, 0))
    idle = makespan - m
    assert idle / makespan == pytest.approx((p - 1) / v / (m + (p - 1) / v), rel=1e-12)
    closed = _closed_form(name, p, m, v)
    assert closed.idle_units == pytest.approx(idle, rel=1e-12)
    assert closed.peak_units == tuple(x / v for x in peaks)


@pytest.mark.parametrize("name,p,v", [("gpipe", 3, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 3, 2), ("interleaved_1f1b", 2, 4),
                                      ("zero_bubble", 3, 1), ("zero_bubble", 4, 1)])
@pytest.mark.parametrize("units", [(8, 16, 0), (6, 9, 9), (9, 10, 5)])
def test_extrapolation_in_m_is_the_full_replay(name, p, v, units):
    """Beyond m2 the price comes from two replays at m1, m2; it equals replaying at m."""
    if name != "zero_bubble":
        units = (units[0], RATIO_STEPS - units[0], 0)
    m1, m2 = _base(name, p, v)
    for m in range(m2 + 1, m2 + 4 * p + 1):
        if name == "interleaved_1f1b" and m % p:
            continue
        price = price_schedule(name, p, m, v, units)
        assert price.source.startswith("extrapolated")
        makespan, peaks, per_chunk = _replay(name, p, m, v, units)
        assert price.idle_units == pytest.approx(makespan - m, abs=1e-9)
        assert price.peak_units == pytest.approx(tuple(x / v for x in peaks))
        for row, expected in zip(price.peak_per_chunk, per_chunk):
            assert row == pytest.approx(expected)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 7, 1), ("interleaved_1f1b", 4, 8, 2), ("chimera", 4, 8, 1),
                                       ("chimera", 6, 10, 1), ("zero_bubble", 4, 9, 1), ("zero_bubble", 5, 5, 1)])
def test_the_planners_replay_is_the_librarys(name, p, m, v):
    """With the weight gradient half the backward (the library replay's split), the
    planner's replay gives plait.parallel.pipeline.replay's makespan and peak_in_flight."""
    schedule = build(name, p, m, v if v > 1 else None)
    units = (6, 9, 9) if name == "zero_bubble" else (8, 16, 0)
    makespan, peaks, _ = _replay(name, p, m, v, units)
    expected = replay(schedule, forward=units[0] / RATIO_STEPS, backward=(units[1] + units[2]) / RATIO_STEPS)
    assert makespan == pytest.approx(expected.makespan_s, rel=1e-12)
    assert list(peaks) == peak_in_flight(schedule)


def test_chimera_rules_are_the_builders():
    for p in range(1, 10):
        for m in range(1, 13):
            if 2 * m * p > pipeline.MAX_CHIMERA_COMPUTE or p > pipeline.MAX_LIST_SCHEDULED_PP:
                continue
            try:
                build("chimera", p, m)
                refused = None
            except ValueError as error:
                refused = str(error)
            assert schedule_problem("chimera", p, m, 1) == refused


def test_chimera_and_zero_bubble_are_priced_from_their_schedules():
    """Uniform stages, free links: the step is the schedule's replayed makespan; Chimera
    keeps two stages' parameters per rank; zero_bubble's bubble is below 1F1B's."""
    p, m = 4, 8
    groups = _uniform_groups(2 * p, 1.0)  # forward 1, backward 2 (input and weight gradient 1 each)

    def priced(schedule):
        layout = Layout(pp=p, num_microbatches=m, schedule=schedule)
        return estimate(groups, layout, _cluster(p), PRECISIONS["fp32"], model_flops=1.0, hardware_flops=1.0)

    one, chim, zb = priced("1f1b"), priced("chimera"), priced("zero_bubble")
    per_rank_forward = 2.0
    for result, name in ((chim, "chimera"), (zb, "zero_bubble")):
        expected = replay(build(name, p, m), forward=per_rank_forward, backward=2 * per_rank_forward).makespan_s
        assert result.step_time_s == pytest.approx(expected, rel=1e-12)
    assert zb.time_s["pp_bubble"] < one.time_s["pp_bubble"]
    assert zb.time_s["pp_bubble"] == pytest.approx((p - 1) * per_rank_forward)  # ZB-H1: (p-1)·F
    assert chim.time_s["pp_bubble"] < one.time_s["pp_bubble"]


def test_chimera_holds_two_replicas_and_zero_bubble_its_own_in_flight():
    from plait.plan.layers import LayerCost
    from plait.plan.estimate import Unit
    from plait.plan.transformer import TensorParallelComm
    p, m = 4, 8
    groups = [[Unit(LayerCost(name=f"l{i}", params=10, forward_flops=1.0, backward_flops=2.0, activation_bytes=1.0),
                    TensorParallelComm(), False)] for i in range(p)]

    def priced(schedule):
        layout = Layout(pp=p, num_microbatches=m, schedule=schedule)
        return estimate(groups, layout, _cluster(p), PRECISIONS["fp32"], model_flops=1.0, hardware_flops=1.0)

    one, chim, zb = priced("1f1b"), priced("chimera"), priced("zero_bubble")
    assert chim.memory_bytes["parameters"] == 2 * one.memory_bytes["parameters"] == 2 * 10 * 4
    assert chim.memory_bytes["activations"] == max(peak_in_flight(build("chimera", p, m)))
    assert one.memory_bytes["activations"] == p
    assert zb.memory_bytes["activations"] == max(peak_in_flight(build("zero_bubble", p, m))) == 2 * p - 1


def test_the_search_prices_and_ranks_chimera_and_zero_bubble_with_cached_replays():
    kwargs = dict(model="gpt-1.3b", cluster="dgx-a100", gpus=16, global_batch=64, top=10_000)
    result = plan(kwargs.pop("model"), kwargs.pop("cluster"), **kwargs)
    schedules = {p.layout.schedule for p in result.plans}
    assert {"chimera", "zero_bubble", "1f1b"} <= schedules
    assert [p.step_time_s for p in result.plans] == sorted(p.step_time_s for p in result.plans)
    reasons = " ".join(result.eliminated)
    assert "chimera needs an even" in reasons and "chimera/zero_bubble priced up to pp=8" in reasons
    before = pipeline.stats()
    again = plan("gpt-1.3b", "dgx-a100", gpus=16, global_batch=64, top=10_000)
    assert pipeline.stats() == before  # every schedule built and replayed once per process
    assert [p.step_time_s for p in again.plans] == [p.step_time_s for p in result.plans]


def test_a_refused_chimera_layout_names_the_rule():
    from plait.plan import PlanError
    with pytest.raises(PlanError, match="chimera needs an even number of micro-batches"):
        plan("gpt-1.3b", "dgx-a100", gpus=16, global_batch=48, pp=2, dp=8, micro_batch=2, schedule="chimera")
