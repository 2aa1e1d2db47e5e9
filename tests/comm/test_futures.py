"""Handles as torch's Work: get_future() holds the output (a list, as torch's does) or
carries the collective's error; is_success(); chaining with then() as DDP hooks do."""

import pytest
import torch
import torch.distributed as dist

import plait.comm as comm
from plait.comm.engine import Handle
from plait.testing import run_distributed

# ----- single process: the Handle alone ------------------------------------------------------


def test_future_of_a_handle_finished_later_and_before():
    handle = Handle("all_reduce(algorithm=ring)")
    handle.output = [torch.ones(2)]
    early = handle.get_future()
    assert not early.done()
    with pytest.raises(RuntimeError, match="before it finished"):
        handle.is_success()
    handle._finish(None)
    assert early.done() and torch.equal(early.wait()[0], torch.ones(2))
    assert handle.is_success()
    late = handle.get_future()
    assert late.done() and late.value()[0] is handle.output[0]


def test_future_carries_the_error():
    handle = Handle("all_reduce(algorithm=ring)")
    early = handle.get_future()
    handle._finish(comm.MismatchError("ranks disagree"))
    assert not handle.is_success()
    for future in (early, handle.get_future()):
        with pytest.raises(comm.MismatchError, match="ranks disagree"):
            future.wait()


# ----- real ranks ------------------------------------------------------------------------------


def futures_on_ranks(rank, p):
    results = {}
    x = torch.arange(5, dtype=torch.float64) + rank
    handle = comm.all_reduce(x, async_op=True, algorithm="ring")
    value = handle.get_future().wait()
    ours = torch.arange(5, dtype=torch.float64) + rank
    dist.all_reduce(ours)  # torch's own, for the value and the future's shape
    theirs = dist.all_reduce(torch.arange(5, dtype=torch.float64) + rank, async_op=True).get_future().wait()
    results["all_reduce"] = (isinstance(value, list) and len(value) == 1 and value[0] is x
                             and torch.equal(value[0], ours) and torch.equal(value[0], theirs[0])
                             and handle.is_success())
    # then() chains as in DDP's hooks: the value divided by p
    y = torch.full((3,), float(rank + 1))
    chained = comm.all_reduce(y, async_op=True, algorithm="star").get_future().then(lambda f: f.value()[0] / p)
    results["then"] = torch.allclose(chained.wait(), torch.full((3,), (p + 1) / 2))
    out = torch.empty(2 * p)
    gathered = comm.all_gather_single(out, torch.full((2,), float(rank)), async_op=True, algorithm="bruck")
    results["all_gather"] = gathered.get_future().wait()[0] is out and out.tolist() == [
        float(r) for r in range(p) for _ in range(2)]
    results["barrier"] = comm.barrier(async_op=True).get_future().wait() == []
    # a failed call: sizes differ between ranks -> MismatchError carried by the future
    # (the deep check raises it before any message, so this pooled group stays usable)
    comm.init_communicator(None, comm.CommConfig(check="deep"))
    bad = comm.all_reduce(torch.ones(4 + rank), async_op=True, algorithm="ring")
    future = bad.get_future()
    try:
        future.wait()
        results["mismatch"] = "no error"
    except comm.MismatchError as error:
        results["mismatch"] = str(error)
    results["mismatch_success"] = bad.is_success()
    comm.synchronize()  # the future delivered the error: nothing forgotten is re-raised
    # the group still works afterwards (errors before any message poison nothing)
    z = torch.ones(3)
    comm.all_reduce(z, algorithm="ring")
    results["after"] = torch.all(z == p).item()
    comm.init_communicator(None)
    return results


@pytest.mark.slow
def test_futures_hold_the_result_or_the_error_on_real_ranks():
    for rank, results in enumerate(run_distributed(futures_on_ranks, 3)):
        assert results["all_reduce"] and results["then"] and results["all_gather"] and results["barrier"], results
        assert "rank 0=4" in results["mismatch"] and "rank 2=6" in results["mismatch"], results["mismatch"]
        assert results["mismatch_success"] is False and results["after"], results
