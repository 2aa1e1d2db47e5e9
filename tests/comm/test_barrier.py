"""Barrier semantics on schedules as data: when a rank finishes a barrier schedule
it must have heard, directly or through others, from every rank (a barrier that
returns at once, or drops a round, would let a rank leave before a peer arrived).

Two independent checks per registered barrier algorithm and p = 1..17 (powers of
two and not): knowledge sets pushed through the schedule's transfers step by step
(a step's sends carry what the sender knew at the start of the step, as in the
buffer model), and the virtual executor run on one-hot buffers with max, where
rank r's buffer ends all ones iff it heard from everyone.
"""

import pytest
import torch

from plait.comm.algorithms import algorithms_for, build_schedule
from plait.comm.schedule import Schedule, Step, Transfer
from plait.comm.virtual import run_schedule

BARRIERS = algorithms_for("barrier")
WORLD_SIZES = range(1, 18)


def heard_from(schedule: Schedule) -> list[set[int]]:
    """Per rank, the ranks it has heard from (itself included) after the last step."""
    knows = [{rank} for rank in range(schedule.world_size)]
    for step in schedule.steps:
        start = [set(known) for known in knows]  # every send reads the state at the step's start
        for transfer in step.transfers:
            assert transfer.numel > 0, f"{schedule.algorithm}: an empty message signals nothing: {transfer}"
            knows[transfer.dst] |= start[transfer.src]
    return knows


def test_every_registered_barrier_is_checked():
    assert {"bruck", "tree", "direct"} <= set(BARRIERS)


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("algorithm", BARRIERS)
def test_every_rank_hears_from_every_rank(algorithm, p):
    schedule = build_schedule("barrier", algorithm, p, 1)
    everyone = set(range(p))
    missing = {rank: sorted(everyone - known) for rank, known in enumerate(heard_from(schedule)) if known != everyone}
    assert not missing, f"{algorithm} barrier, p={p}: ranks leave without hearing from {missing}"


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("algorithm", BARRIERS)
def test_the_virtual_executor_spreads_every_arrival(algorithm, p):
    schedule = build_schedule("barrier", algorithm, p, p)  # one slot per rank: slot q = "q has arrived"
    buffers = run_schedule(schedule, [torch.eye(p, dtype=torch.int64)[rank].clone() for rank in range(p)], op="max")
    unheard = {rank: torch.nonzero(buffer == 0).flatten().tolist() for rank, buffer in enumerate(buffers)
               if not bool(buffer.all())}
    assert not unheard, f"{algorithm} barrier, p={p}: ranks leave without hearing from {unheard}"


def test_the_check_itself_fails_on_broken_barriers():
    """A barrier that returns at once, and a dissemination barrier one round short."""
    p = 6
    assert heard_from(Schedule("barrier", "none", p, 1, ())) != [set(range(p))] * p
    short = build_schedule("barrier", "bruck", p, 1).steps[:-1]
    assert any(known != set(range(p)) for known in heard_from(Schedule("barrier", "short", p, 1, short)))
    one_way = (Step(tuple(Transfer(r, 0, 0, 0, 1, True) for r in range(1, p))),)  # a gather: only rank 0 knows
    assert heard_from(Schedule("barrier", "gather", p, 1, one_way))[0] == set(range(p))
    assert heard_from(Schedule("barrier", "gather", p, 1, one_way))[1] == {1}
