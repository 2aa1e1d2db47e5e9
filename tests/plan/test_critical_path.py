"""The critical-path scheduler and the overlap model against schedules worked by hand.

Every expected number below is computed on paper in the test's docstring or comment;
tolerances are float64 rounding of sums of a few terms (1e-12)."""

from __future__ import annotations

import random

import pytest

from plait.names.step_parts import COMPUTE, DP_COMM, PP_BUBBLE, PP_COMM, TP_COMM
from plait.plan.critical_path import Task, schedule
from plait.plan.overlap import bucketed_exposed_s, reduce_tail_s, zero3_exposed_s, zero_tasks

EXACT = 1e-12


def _backward_with_reductions(reduce_s: float, parts=(DP_COMM, DP_COMM, DP_COMM)) -> list[Task]:
    """3 layers' backward of 2 s each on the compute stream; each layer's reduction
    (``reduce_s``) issued on the comm stream when its backward ends; the step waits for all."""
    tasks = []
    for layer in range(3):
        tasks.append(Task(COMPUTE, 2.0, COMPUTE, (len(tasks) - 2,) if layer else (), f"B{layer}"))
        tasks.append(Task("comm", reduce_s, parts[layer], (len(tasks) - 1,), f"R{layer}"))
    tasks.append(Task(COMPUTE, 0.0, COMPUTE, (1, 3, 5), "wait"))
    return tasks


def test_reductions_shorter_than_a_layer_hide_all_but_the_last():
    """r = 1 s < 2 s per layer: R0 [2,3], R1 [4,5], R2 [6,7]; the backward ends at 6,
    so 1 s (R2) is exposed and 2 s hidden; makespan 7 = 6 compute + 1."""
    timeline = schedule(_backward_with_reductions(1.0))
    assert timeline.makespan_s == pytest.approx(7.0, abs=EXACT)
    assert timeline.exposed_s == pytest.approx({COMPUTE: 6.0, DP_COMM: 1.0}, abs=EXACT)
    assert timeline.hidden_s == pytest.approx({DP_COMM: 2.0}, abs=EXACT)
    assert timeline.start_s[5] == pytest.approx(6.0, abs=EXACT)


def test_reductions_longer_than_the_rest_of_the_backward_queue_up():
    """r = 3 s > 2 s: R0 [2,5], R1 [5,8] (waits for R0), R2 [8,11]; backward ends at
    6, the step at 11: 5 s exposed (all of R2 and R1's [6,8]), 9 - 5 = 4 s hidden.
    With R1 counted as another part, the walk back along the comm stream charges
    [8,11] to R2's part and [6,8] to R1's."""
    timeline = schedule(_backward_with_reductions(3.0))
    assert timeline.makespan_s == pytest.approx(11.0, abs=EXACT)
    assert timeline.exposed_s == pytest.approx({COMPUTE: 6.0, DP_COMM: 5.0}, abs=EXACT)
    assert timeline.hidden_s == pytest.approx({DP_COMM: 4.0}, abs=EXACT)
    marked = schedule(_backward_with_reductions(3.0, parts=(DP_COMM, TP_COMM, DP_COMM)))
    assert marked.exposed_s == pytest.approx({COMPUTE: 6.0, TP_COMM: 2.0, DP_COMM: 3.0}, abs=EXACT)
    assert marked.hidden_s == pytest.approx({DP_COMM: 3.0, TP_COMM: 1.0}, abs=EXACT)
    # the closed form for uniform units says the same: tail = max(r, U r - (U-1) b_u) = 9 - 4 = 5
    assert reduce_tail_s(3, 6.0, 3.0) == pytest.approx(5.0, abs=EXACT)
    assert reduce_tail_s(3, 6.0, 1.0) == pytest.approx(1.0, abs=EXACT)


def test_zero3_prefetch_exposes_only_what_a_gather_does_not_hide():
    """ZeRO 3, one micro-batch, 3 units, forward 2 s and backward 2 s per unit, a
    gather of 3 s before each unit's forward and before its backward (but the last
    unit's: it stays gathered from its forward), reductions of 1 s. Forward: G0 [0,3]
    F0 [3,5]; G1 issued at 3 [3,6] F1 [6,8]; G2 [6,9] F2 [9,11]: 5 s exposed. Backward:
    B2 [11,13] at once; G'1 issued at 11 [11,14]; R2 issued at 13 runs [14,15]; B1
    [14,16]; G'0 issued at 14 waits for R2: [15,18]; R1 [18,19]; B0 [18,20]; R0 [20,21]:
    3 s exposed in the backward and 1 s after it: 9 in all."""
    tasks = zero_tasks(1, 3, 6.0, 6.0, gather_s=3.0, backward_gather_s=3.0, reduce_s=1.0)
    timeline = schedule(tasks)
    assert timeline.makespan_s == pytest.approx(21.0, abs=EXACT)
    assert timeline.exposed_s[DP_COMM] == pytest.approx(9.0, abs=EXACT)
    assert timeline.hidden_s[DP_COMM] == pytest.approx(3 * (3 + 1) + 2 * 3 - 9.0, abs=EXACT)
    assert zero3_exposed_s(1, 3, 6.0, 6.0, 3.0, 3.0, 1.0) == pytest.approx(9.0, abs=EXACT)
    # a gather shorter than a unit's compute hides entirely after the first one
    assert zero3_exposed_s(1, 3, 6.0, 6.0, 1.0, 1.0, 0.5) == pytest.approx(1.0 + 0.5, abs=EXACT)


def test_pipeline_receive_is_exposed_only_when_the_data_is_not_there():
    """Rank 0 computes F (2 s) and isends its activation (transfer d); rank 1 first
    computes 3 s of other work, then F needs the activation. d = 0.5: it arrived at
    2.5 < 3, nothing exposed, 0.5 hidden. d = 2 with 1 s of other work: rank 1 idles
    [1, 4): [2, 4) waiting for the transfer (pp_comm), [1, 2) for rank 0's compute
    (the bubble)."""
    def tasks(other_s: float, transfer_s: float) -> list[Task]:
        return [Task("rank0", 2.0, PP_BUBBLE, (), "F on rank 0"),
                Task("link", transfer_s, PP_COMM, (0,), "activation"),
                Task("rank1", other_s, COMPUTE, (), "earlier work"),
                Task("rank1", 2.0, COMPUTE, (1,), "F on rank 1")]

    hidden = schedule(tasks(3.0, 0.5), critical="rank1")
    assert hidden.exposed_s == pytest.approx({COMPUTE: 5.0}, abs=EXACT)
    assert hidden.hidden_s == pytest.approx({PP_BUBBLE: 2.0, PP_COMM: 0.5}, abs=EXACT)
    exposed = schedule(tasks(1.0, 2.0), critical="rank1")
    assert exposed.makespan_s == pytest.approx(6.0, abs=EXACT)
    assert exposed.exposed_s == pytest.approx({COMPUTE: 3.0, PP_COMM: 2.0, PP_BUBBLE: 1.0}, abs=EXACT)
    assert exposed.hidden_s == pytest.approx({PP_BUBBLE: 1.0, PP_COMM: 0.0}, abs=EXACT)


def test_data_parallel_all_reduces_only_in_the_last_backward():
    """DataParallel under accumulation (2 micro-batches, 3 buckets): the first
    backward reduces nothing; the last one's tail alone is exposed."""
    timeline = schedule(zero_tasks(2, 3, 3.0, 6.0, reduce_s=3.0, overlap_next_forward=False))
    assert timeline.exposed_s[DP_COMM] == pytest.approx(5.0, abs=EXACT)  # as the 3-layer case above
    assert bucketed_exposed_s(1, 3, 3.0, 6.0, 3.0) == pytest.approx(5.0, abs=EXACT)


def test_closed_forms_equal_the_scheduled_step():
    """The estimate's closed forms (ZeRO 2 and 3) equal the list scheduler on the same
    step, over random sizes: micro-batches, units, and every regime (comm-bound or not,
    forward hiding the tail or not); and the exposed parts add up to the makespan."""
    rng = random.Random(36)
    for trial in range(400):
        m, units = rng.randint(1, 4), rng.randint(1, 6)
        forward, backward, reduce = rng.uniform(0.1, 3), rng.uniform(0.1, 6), rng.uniform(0, 2)
        gather = rng.uniform(0.01, 2) if trial % 2 else 0.0
        backward_gather = gather * rng.choice((1, 2))
        timeline = schedule(zero_tasks(m, units, forward, backward, gather_s=gather,
                                       backward_gather_s=backward_gather, reduce_s=reduce))
        assert sum(timeline.exposed_s.values()) == pytest.approx(timeline.makespan_s, rel=EXACT)
        if gather:
            closed = zero3_exposed_s(m, units, forward, backward, gather, backward_gather, reduce)
        else:
            closed = bucketed_exposed_s(m, units, forward, backward, reduce)
        assert timeline.exposed_s.get(DP_COMM, 0.0) == pytest.approx(closed, rel=1e-9, abs=1e-12), (
            m, units, forward, backward, reduce, gather, backward_gather)


def test_tasks_listed_before_what_they_wait_for_are_refused():
    with pytest.raises(ValueError, match=r"after=\(1,\) must name earlier tasks"):
        schedule([Task(COMPUTE, 1.0, COMPUTE, (1,)), Task("comm", 1.0, DP_COMM)])
    with pytest.raises(ValueError, match="duration_s=-1.0"):
        schedule([Task(COMPUTE, -1.0, COMPUTE)])
