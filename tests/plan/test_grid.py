"""The search grid and its budget: counted before pricing, priced in full when it fits
(the same plans and reasons as without a budget), thinned in a fixed order when it
does not, and what was cut said."""

from __future__ import annotations

import math

import pytest

from plait.plan import PlanError, explain, plan
from plait.plan.grid import ladder

CASE = dict(model="gpt-1.3b", cluster="dgx-a100", gpus=16, global_batch=128, top=10_000)


def _plan(**overrides):
    kwargs = {**CASE, **overrides}
    return plan(kwargs.pop("model"), kwargs.pop("cluster"), **kwargs)


def _reasons(result) -> list[str]:
    """The explanation without the search time."""
    lines = explain(result)
    return lines[:-1] + [lines[-1].split(" in ")[0] + lines[-1].split(" s:", 1)[1]]


def test_ladders_keep_the_ends_and_every_value_r_times_the_last():
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    assert ladder(sizes, 2) == [1, 2, 4, 8, 16, 32]
    assert ladder(sizes, 4) == [1, 4, 16, 32]
    assert ladder(sizes, 16) == [1, 16, 32]
    assert ladder(sizes, math.inf) == [1, 32]
    assert ladder([24, 3, 3], 2) == [3, 24] and ladder([5], 4) == [5] and ladder(sizes, 1) == sizes


def test_a_budget_the_grid_fits_in_changes_nothing():
    """The grid is counted exactly: with max_layouts = the layouts a full search prices,
    the plans and the explanation are the full search's; one fewer cuts it."""
    full = _plan()
    assert full.pruning is not None and not full.pruning.pruned and full.pruning.total == full.priced
    exact = _plan(max_layouts=full.priced)
    assert exact.as_json() == full.as_json()
    assert _reasons(exact) == _reasons(full)
    assert (exact.considered, exact.feasible, exact.eliminated) == (full.considered, full.feasible, full.eliminated)
    short = _plan(max_layouts=full.priced - 1)
    assert short.pruning.pruned and short.priced <= full.priced - 1
    assert short.pruning.not_priced == full.priced - short.priced


def test_the_budget_thins_the_grid_deterministically_and_says_what_it_cut():
    full = _plan()
    first, again = _plan(max_layouts=400), _plan(max_layouts=400)
    assert first.as_json() == again.as_json() and _reasons(first) == _reasons(again)
    pruning = first.pruning
    assert pruning.pruned and first.priced <= 400 < full.priced
    assert pruning.total == full.priced and pruning.not_priced == full.priced - first.priced
    assert pruning.steps and pruning.steps[0].startswith("micro-batch sizes of each (tp, pp) thinned to a x")
    last = explain(first)[-1]
    assert "budget max_layouts=400 cut the search: micro-batch sizes" in last
    assert f"{pruning.not_priced:,} of {full.priced:,} layouts not priced" in last
    # what is priced under the budget is priced as in the full search, and ranked alike
    everything = {p.layout: p.step_time_s for p in full.plans}
    assert all(everything[p.layout] == p.step_time_s for p in first.plans)
    assert [p.step_time_s for p in first.plans] == sorted(p.step_time_s for p in first.plans)
    assert first.best.step_time_s <= 1.1 * full.best.step_time_s  # the ladders kept a near-best layout


def test_beyond_the_coarsest_grid_the_budget_stops_in_search_order():
    result = _plan(max_layouts=3)
    assert result.priced == 3
    assert result.pruning.stop_after == 3 and "then stopped after 3 in search order" in result.pruning.text()
    assert "tp degrees thinned to the smallest and largest (kept 1, 16)" in result.pruning.text()


def test_when_no_priced_layout_fits_the_error_names_the_budget_not_a_bigger_cluster():
    with pytest.raises(PlanError) as error:
        plan("gpt-175b", "dgx-a100", gpus=1024, global_batch=1536, max_layouts=1)
    text = str(error.value)
    assert text.startswith("no priced layout of gpt-175b") and "GiB more than the 72.0 GiB available" in text
    assert "budget max_layouts=1 cut the search" in text and "14,021 of 14,022 layouts not priced" in text
    assert "would fit it" not in text
