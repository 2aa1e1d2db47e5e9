"""The streaming executor's pieces that need no processes: how a step's receives
become landing units, and the scratch pool's bound."""

import torch

from plait.comm.algorithms import build_schedule
from plait.comm.dataflow import DIRECT, SCRATCH, STREAM_REDUCE, ScratchPool, units_for_step
from plait.comm.executor import plan_rank


def kinds(collective, algorithm, p, n, rank, segment_numel=0):
    plans = plan_rank(build_schedule(collective, algorithm, p, n), rank, segment_numel)
    return [[(u.kind, u.lo, u.hi) for u in units_for_step(plan)] for plan in plans]


def test_ring_reductions_stream_and_gathers_land_in_place():
    steps = kinds("all_reduce", "ring", 3, 9, rank=0, segment_numel=2)
    # reduce-scatter: rank 0 adds chunk 1 = [3, 6) then chunk 0 = [0, 3), in segments of 2
    assert steps[0] == [(STREAM_REDUCE, 3, 5), (STREAM_REDUCE, 5, 6)]
    assert steps[1] == [(STREAM_REDUCE, 0, 2), (STREAM_REDUCE, 2, 3)]
    # all-gather: chunks 2 then 1 land straight in the buffer
    assert steps[2] == [(DIRECT, 6, 8), (DIRECT, 8, 9)]
    assert steps[3] == [(DIRECT, 3, 5), (DIRECT, 5, 6)]


def test_exchange_that_sends_what_it_reduces_goes_through_scratch():
    # recursive doubling sends and reduces the whole buffer in one step
    assert kinds("all_reduce", "recursive_doubling", 4, 8, rank=0) == [[(SCRATCH, 0, 8)], [(SCRATCH, 0, 8)]]


def test_same_region_reductions_land_as_one_unit():
    (step,) = [[u for u in units_for_step(plan)] for plan in
               plan_rank(build_schedule("all_reduce", "direct", 4, 8), 0, 0)]
    assert len(step) == 1 and step[0].kind == SCRATCH and len(step[0].parts) == 3


def test_scratch_pool_reuses_and_stays_bounded():
    pool = ScratchPool(max_bytes=64)
    like = torch.empty(0, dtype=torch.float32)
    a = pool.take(8, like)
    pool.give(a)
    assert pool.take(8, like) is a
    pool.give(a)
    pool.give(torch.empty(12))  # 32 + 48 bytes > 64: the older size is dropped
    assert pool._held_bytes == 48 and pool.take(8, like) is not a
