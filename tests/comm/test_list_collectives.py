"""The list forms all_gather / reduce_scatter / all_to_all on real gloo ranks
(p = 2, 3), every algorithm of the underlying collective, against
torch.distributed's own list collectives on the same inputs; uneven entries fall
use padding (all_gather, reduce_scatter) or split sizes (all_to_all); async handles' futures hold the output list."""

import pytest
import torch
import torch.distributed as dist

import plait.comm as comm
from plait.testing import run_distributed

pytestmark = pytest.mark.slow


def _inputs(rank, p, shape, dtype=torch.float64, salt=0):
    generator = torch.Generator().manual_seed(100 * rank + salt)
    return [torch.randn(shape, generator=generator, dtype=torch.float64).mul(10).round().to(dtype)
            for _ in range(p)]


def list_forms(rank, p):
    failures = []
    for shape in [(2, 3), (1,), (0,), (5,)]:
        # all_gather
        mine = _inputs(rank, p, shape)[0]
        theirs = [torch.empty(shape, dtype=torch.float64) for _ in range(p)]
        dist.all_gather(theirs, mine)
        for algorithm in [None, "torch", *comm.algorithms_for("all_gather")]:
            ours = [torch.full(shape, -1.0, dtype=torch.float64) for _ in range(p)]
            comm.all_gather(ours, mine, algorithm=algorithm)
            if not all(torch.equal(a, b) for a, b in zip(ours, theirs)):
                failures.append(("all_gather", shape, algorithm))
        # reduce_scatter (exact: small integers in float64)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            sources = _inputs(rank, p, shape, salt=1)
            expected = torch.empty(shape, dtype=torch.float64)
            dist.reduce_scatter(expected, [s.clone() for s in sources], op)
            for algorithm in [None, "torch", *comm.algorithms_for("reduce_scatter")]:
                out = torch.full(shape, -1.0, dtype=torch.float64)
                kept = [s.clone() for s in sources]
                comm.reduce_scatter(out, kept, op, algorithm=algorithm)
                if not torch.equal(out, expected) or not all(torch.equal(a, b) for a, b in zip(kept, sources)):
                    failures.append(("reduce_scatter", shape, str(op), algorithm))
        # all_to_all
        sources = _inputs(rank, p, shape, dtype=torch.int64, salt=2)
        theirs = [torch.empty(shape, dtype=torch.int64) for _ in range(p)]
        dist.all_to_all(theirs, sources)
        for algorithm in [None, "torch", *comm.algorithms_for("all_to_all")]:
            ours = [torch.full(shape, -1, dtype=torch.int64) for _ in range(p)]
            comm.all_to_all(ours, sources, algorithm=algorithm)
            if not all(torch.equal(a, b) for a, b in zip(ours, theirs)):
                failures.append(("all_to_all", shape, algorithm))
    return failures


def uneven_and_async(rank, p):
    results = {}
    # uneven all_to_all: rank s sends s + d + 1 elements to rank d
    sources = [torch.full((rank + d + 1,), float(10 * rank + d)) for d in range(p)]
    # gloo's list all_to_all refuses uneven entries; the expected values are rebuilt here
    theirs = [torch.full((s + rank + 1,), float(10 * s + rank)) for s in range(p)]
    ours = [torch.empty(s + rank + 1) for s in range(p)]
    comm.all_to_all(ours, sources)
    results["uneven_all_to_all"] = all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # uneven all_gather (rank r gives r + 1 elements) and reduce_scatter (share r has 2r + 1)
    for algorithm in [None, *comm.algorithms_for("all_gather")]:
        gathered = [torch.full((r + 1,), -1.0) for r in range(p)]
        comm.all_gather(gathered, torch.arange(rank + 1.0) + 100 * rank, algorithm=algorithm)
        results.setdefault("uneven_all_gather", []).append(
            all(torch.equal(g, torch.arange(r + 1.0) + 100 * r) for r, g in enumerate(gathered)))
    for algorithm in [None, *comm.algorithms_for("reduce_scatter")]:
        out = torch.full((2 * rank + 1,), -1.0)
        comm.reduce_scatter(out, [torch.arange(2 * r + 1.0) * (rank + 1) for r in range(p)], algorithm=algorithm)
        expected = torch.arange(2 * rank + 1.0) * sum(s + 1 for s in range(p))
        results.setdefault("uneven_reduce_scatter", []).append(torch.equal(out, expected))
    try:
        comm.all_to_all([torch.empty(s + rank + 1) for s in range(p)], sources, algorithm="pairwise")
        results["uneven_named"] = "no error"
    except ValueError as error:
        results["uneven_named"] = str(error)
    # async: queued behind an async all_reduce, the future holds the list
    x = torch.ones(4)
    first = comm.all_reduce(x, async_op=True, algorithm="ring")
    gathered = [torch.empty(4) for _ in range(p)]
    handle = comm.all_gather(gathered, x, async_op=True, algorithm="ring")  # reads x after the all-reduce
    value = handle.get_future().wait()
    first.wait()
    results["async"] = (value is not None and len(value) == p and all(v is g for v, g in zip(value, gathered))
                        and all(torch.all(g == p).item() for g in gathered))
    out = torch.empty(3)
    handle = comm.reduce_scatter(out, [torch.full((3,), float(r + rank)) for r in range(p)], async_op=True)
    results["async_rs"] = handle.get_future().wait()[0] is out and torch.all(out == p * rank + sum(range(p))).item()
    try:
        comm.all_gather([torch.empty(4)] * (p + 1), x)
        results["bad_length"] = "no error"
    except ValueError as error:
        results["bad_length"] = str(error)
    return results


@pytest.mark.parametrize("p", [2, 3])
def test_list_forms_match_torch_distributed(p):
    failures = [f for rank_failures in run_distributed(list_forms, p) for f in rank_failures]
    assert not failures, failures[:10]


def test_uneven_lists_use_torch_and_async_futures_hold_the_list():
    for results in run_distributed(uneven_and_async, 3):
        assert results["uneven_all_to_all"] and results["async"] and results["async_rs"], results
        assert all(results["uneven_all_gather"]) and all(results["uneven_reduce_scatter"]), results
        assert "pairwise" in results["uneven_named"] and "'torch'" in results["uneven_named"]
        assert "world_size = 3" in results["bad_length"] and "got 4" in results["bad_length"]
