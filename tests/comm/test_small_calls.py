"""The per-call fast path of small collectives on real processes: a call like an earlier
one reuses what it derived (``Communicator.call_plans``) and a small call runs in lock
step from a cached step list (``Executor.run_small``). Repeated calls with new data give
the virtual executor's bits, and ranks whose warm (cached) calls then differ are still
named in band on every rank."""

import pytest
import torch

import plait.comm as comm
from plait.comm.communicator import communicator_for
from plait.comm.reference import rank_inputs
from plait.comm.virtual import simulate
from plait.testing import run_fresh_world

pytestmark = pytest.mark.slow

# (collective, algorithm, op): latency-bound calls of the default table and others
CALLS = [("all_reduce", "star", "sum"), ("all_reduce", "recursive_doubling", "max"), ("all_reduce", "ring", "sum"),
         ("all_reduce", "direct", "prod"), ("reduce_scatter", "direct", "sum"), ("all_gather", "bruck", "none")]
NUMEL = 1002  # 8 KB of float64: a small call (packed headers), not divisible by 4


def _run(collective, algorithm, op, x, p):
    if collective == "all_reduce":
        out = x.clone()
        comm.all_reduce(out, op, algorithm=algorithm)
    elif collective == "reduce_scatter":
        out = x.new_empty(x.numel() // p)
        comm.reduce_scatter_single(out, x, op, algorithm=algorithm)
    else:
        out = x.new_empty(x.numel() * p)
        comm.all_gather_single(out, x, algorithm=algorithm)
    return out


def warm_calls(rank, p):
    """Each call three times with new data (the first derives, the others reuse), bits
    against the virtual executor; then a warm all_reduce whose size differs on rank 0."""
    wrong = []
    for collective, algorithm, op in CALLS:
        for seed in range(3):
            inputs = rank_inputs(collective, p, NUMEL if collective != "reduce_scatter" else NUMEL - NUMEL % p,
                                 torch.float64, "sum" if op == "none" else op, seed=seed)
            out = _run(collective, algorithm, op, inputs[rank], p)
            expected = simulate(collective, algorithm, inputs, "sum" if op == "none" else op)[rank]
            if not torch.equal(out, expected):
                wrong.append((collective, algorithm, op, seed))
    plans = len(communicator_for(None).call_plans)
    x = torch.ones(256)
    for _ in range(2):
        comm.all_reduce(x, algorithm="direct")  # warm on every rank
    try:
        comm.all_reduce(torch.ones(256 if rank == 0 else 257), algorithm="direct")
        outcome = None
    except comm.MismatchError as error:
        outcome = str(error)
    return wrong, plans, outcome


def test_repeated_small_calls_give_the_virtual_executors_bits_and_warm_mismatches_are_named():
    for rank, (wrong, plans, outcome) in enumerate(run_fresh_world(warm_calls, 3, timeout_s=120)):
        assert wrong == [], (rank, wrong)
        assert plans >= len(CALLS), (rank, plans)  # the calls were derived once and kept
        assert outcome is not None, rank
        assert "256 elements" in outcome and "257 elements" in outcome and "they differ in elements" in outcome, \
            (rank, outcome)
