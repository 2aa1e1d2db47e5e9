"""The collectives API on real gloo ranks: async handles and overlap, program order,
non-contiguous tensors, sub-groups, stats, and every bad input with its message."""

import time

import pytest
import torch
import torch.distributed as dist

import plait.comm as comm
from plait.comm.algorithms import build_schedule
from plait.testing import run_distributed, run_fresh_world

pytestmark = pytest.mark.slow


# ----- rank functions ---------------------------------------------------------------------
def async_overlap(rank, p):
    """Queue several all-reduces, compute meanwhile, then wait: results and order hold."""
    tensors = [torch.full((50_000,), float(rank + i)) for i in range(4)]
    handles = [comm.all_reduce(t, async_op=True, algorithm=alg)
               for t, alg in zip(tensors, ["ring", "torch", "recursive_doubling", "tree"])]
    busy = torch.randn(200, 200)
    for _ in range(5):
        busy = busy @ busy.T / 200  # the caller keeps computing
    # a synchronous call queues behind the async ones
    sync = torch.full((10,), 1.0)
    comm.all_reduce(sync, algorithm="ring")
    # a later collective reads its input only after the queued ones wrote it, as in torch
    gathered = torch.empty(3 * p)
    comm.all_gather_single(gathered, tensors[3][:3], algorithm="ring")
    done = [h.wait() for h in handles]
    expected = [sum(r + i for r in range(p)) for i in range(4)]
    ok = all(torch.all(t == e).item() for t, e in zip(tensors, expected)) and torch.all(sync == p).item()
    ok = ok and torch.all(gathered == expected[3]).item()
    return ok, done, all(h.is_completed() for h in handles)


def non_contiguous(rank, p):
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4) + rank
    view = base.T  # not contiguous
    comm.all_reduce(view, algorithm="ring")
    expected = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * p + sum(range(p))).T
    return torch.equal(view, expected) and torch.equal(base.T, expected)


def sub_group(rank, p):
    members = [0, 2]
    group = dist.new_group(members)
    if rank not in members:
        return comm.all_reduce(torch.ones(3), group=group, algorithm="ring") is None
    x = torch.full((5,), float(rank))
    comm.all_reduce(x, group=group, algorithm="halving_doubling")
    y = torch.full((4,), float(rank))
    comm.broadcast(y, src=2, group=group, algorithm="tree")  # src is a global rank, as in torch
    return torch.all(x == 2.0).item() and torch.all(y == 2.0).item()


def stats_count(rank, p):
    communicator = comm.init_communicator(None, comm.CommConfig(check="off"))
    x = torch.ones(1000)
    try:
        comm.all_reduce(x, algorithm="ring")
    finally:
        comm.init_communicator(None)
    s = communicator.stats()["all_reduce"]
    schedule = build_schedule("all_reduce", "ring", p, 1000)
    return s["calls"], s["bytes_sent"], schedule.sent_numel(rank) * 4, s["messages"], s["time_s"] > 0


def expect_error(rank, p, case):
    """Run one bad call; return (exception type, message)."""
    x = torch.ones(8)
    if case in DEEP_CASES:  # a check before any message: the pooled group stays usable
        comm.init_communicator(None, comm.CommConfig(check="deep"))
    try:
        if case == "unknown_algorithm":
            comm.all_reduce(x, algorithm="ringg")
        elif case == "unsupported_collective":
            comm.broadcast(x, 0, algorithm="halving_doubling")
        elif case == "unknown_op":
            comm.all_reduce(x, op="median", algorithm="ring")
        elif case == "bitwise_float":
            comm.all_reduce(x, op=dist.ReduceOp.BXOR, algorithm="ring")
        elif case == "avg_int":
            comm.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG, algorithm="ring")
        elif case == "size_mismatch":
            comm.all_reduce(torch.ones(8 + rank), algorithm="ring")
        elif case == "dtype_mismatch":
            comm.all_reduce(torch.ones(8, dtype=torch.float32 if rank else torch.float64), algorithm="ring")
        elif case == "algorithm_mismatch":
            comm.all_reduce(x, algorithm="ring" if rank else "tree")
        elif case == "all_gather_sizes":
            comm.all_gather_single(torch.empty(5), torch.ones(2), algorithm="ring")
        elif case == "bad_root":
            comm.broadcast(x, src=p + 3, algorithm="tree")
        elif case == "uneven_all_to_all":
            comm.all_to_all_single(torch.empty(p + 1), torch.ones(p + 1), algorithm="direct")
        elif case == "segment_mismatch":  # refused when the communicator is created
            comm.init_communicator(None, comm.CommConfig(segment_bytes=4096 * (rank + 1)))
        elif case == "bad_hierarchy":
            comm.all_reduce(x, algorithm="hierarchical", hierarchy=[[0], [1, 1]])
        else:
            raise AssertionError(case)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return type(error).__name__, str(error)
    finally:
        if case in DEEP_CASES:
            comm.init_communicator(None)
    return None, None


DEEP_CASES = ("size_mismatch", "dtype_mismatch", "algorithm_mismatch")


def peer_never_arrives(rank, p, check):
    comm.init_communicator(None, comm.CommConfig(timeout_s=2.0, check=check))
    if rank == 1:
        time.sleep(3.5)  # never calls the collective
        return None
    try:
        comm.all_reduce(torch.ones(64), algorithm="ring")
    except comm.CommTimeoutError as error:
        first = str(error)
    else:
        return "no error", None
    start = time.monotonic()
    try:  # the group is no longer trusted: the next call fails at once, naming the first failure
        comm.all_reduce(torch.ones(64), algorithm="ring")
    except comm.CommError as error:
        return first, (str(error), time.monotonic() - start)
    return first, None


def peer_dies(rank, p):
    comm.init_communicator(None, comm.CommConfig(timeout_s=20.0, check="off"))
    if rank == 1:
        dist.destroy_process_group()  # its connections close, as when a process dies
        time.sleep(1.0)
        return None
    time.sleep(0.5)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(64), algorithm="ring")
    except comm.CommError as error:
        return str(error), time.monotonic() - start
    return "no error", 0.0


# ----- tests -------------------------------------------------------------------------------
def test_async_handles_overlap_and_keep_order():
    for ok, done, completed in run_distributed(async_overlap, 3):
        assert ok and all(done) and completed


def test_non_contiguous_is_handled_in_place():
    assert all(run_distributed(non_contiguous, 3))


def test_sub_groups_use_group_ranks_and_global_roots():
    assert all(run_distributed(sub_group, 3))


def test_stats_count_bytes_and_messages():
    for rank, (calls, sent, expected, messages, timed) in enumerate(run_distributed(stats_count, 3)):
        assert calls == 1 and sent == expected and messages == 4 and timed, rank


ERRORS = {
    "unknown_algorithm": ("ValueError", ["'ringg'", "valid:", "ring", "halving_doubling", "torch"]),
    "unsupported_collective": ("ValueError", ["does not implement broadcast", "tree"]),
    "unknown_op": ("ValueError", ["unsupported reduce op", "SUM"]),
    "avg_int": ("TypeError", ["AVG needs a floating-point dtype", "int32"]),
    "bitwise_float": ("TypeError", ["ReduceOp.BXOR needs an integer or bool dtype", "float32"]),
    "size_mismatch": ("MismatchError", ["rank 0=8", "rank 1=9", "rank 2=10"]),
    "dtype_mismatch": ("MismatchError", ["dtype differs between ranks [[0], [1, 2]]"]),
    "algorithm_mismatch": ("MismatchError", ["algorithm differs between ranks [[0], [1, 2]]"]),
    "all_gather_sizes": ("ValueError", ["all_gather", "5", "2"]),
    "bad_root": ("ValueError", ["src=6 (a global rank) is not a member", "group_src="]),
    "uneven_all_to_all": ("ValueError", ["equal chunks", "algorithm='torch'"]),
    "bad_hierarchy": ("ValueError", ["exactly once", "missing [2]"]),
    "segment_mismatch": ("MismatchError", ["group ranks 1, 2 asked for a different CommConfig"]),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_input_gets_a_clear_error(case):
    kind, fragments = ERRORS[case]
    for rank, (name, message) in enumerate(run_distributed(expect_error, 3, case)):
        assert name == kind, (rank, name, message)
        for fragment in fragments:
            assert fragment in message, (rank, fragment, message)


@pytest.mark.parametrize("check", ["off", "inband", "deep"])
def test_peer_that_never_arrives_times_out_naming_it(check):
    message, after = run_fresh_world(peer_never_arrives, 2, check, timeout_s=60)[0]
    next_message, elapsed_s = after
    assert "not run: an earlier collective" in next_message and elapsed_s < 1.0, after
    assert "rank 0" in message and "all_reduce" in message and "peer 1" in message, message
    assert "timed out after 2s" in message and "step 0" in message, message
    if check == "deep":
        assert "argument check" in message


def test_peer_that_dies_is_named():
    message, elapsed_s = run_fresh_world(peer_dies, 2, timeout_s=60)[0]
    assert "rank 0" in message and "peer 1" in message and "step 0" in message, message
    assert elapsed_s < 15  # detected from the closed connection, not the 20 s timeout


def test_without_process_group_the_error_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="init_process_group"):
        comm.all_reduce(torch.ones(2))


def segmented_and_pipelined(rank, p):
    """Tiny segment sizes force the executor to split messages (streamed reduction)
    and the chains/binary trees to pipeline in many segments; results must still
    match the virtual executor bit for bit (gloo_checks compares)."""
    from tests.comm.gloo_checks import check_collective

    comm.init_communicator(None, comm.CommConfig(segment_bytes=256, pipeline_segment_bytes=512))
    try:
        failures = []
        for collective in ("all_reduce", "reduce_scatter", "broadcast", "reduce", "all_gather"):
            failures += check_collective(rank, p, collective, "float32", [1031], ["sum", "max"])
        return failures
    finally:
        comm.init_communicator(None)


def test_segmented_messages_and_pipelines_on_real_ranks():
    failures = [f for rank_failures in run_distributed(segmented_and_pipelined, 3) for f in rank_failures]
    assert not failures, failures[:10]


def single_rank(rank, p):
    from tests.comm.gloo_checks import check_collective

    return [f for c in comm.COLLECTIVES for f in check_collective(rank, p, c, "float32", [0, 5])]


def test_world_of_one_is_a_no_op_with_torch_semantics():
    assert run_distributed(single_rank, 1) == [[]]


def large_exchange(rank, p, algorithm):
    """Algorithms that send and reduce the same region in one step (recursive doubling,
    the fold steps) must not overwrite data a send is still reading; large segmented
    messages give a send time to be in flight."""
    comm.init_communicator(None, comm.CommConfig(segment_bytes=64 * 1024, check="off"))
    try:
        inputs = [torch.randn(1 << 20, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
                  for r in range(p)]
        out = inputs[rank].clone()
        comm.all_reduce(out, algorithm=algorithm)
        from plait.comm.virtual import simulate

        return torch.equal(out, simulate("all_reduce", algorithm, inputs)[rank])
    finally:
        comm.init_communicator(None)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "halving_doubling", "direct", "star"])
def test_large_buffers_sent_and_reduced_in_one_step(algorithm):
    assert all(run_distributed(large_exchange, 3, algorithm))


def grad_and_uneven(rank, p):
    """Parameters that require grad reduce in place (as with torch); uneven
    all-to-all with split sizes runs torch's, with the argument check on."""
    results = []
    for algorithm in ("ring", "torch"):
        weight = torch.nn.Parameter(torch.full((6,), float(rank)))
        comm.all_reduce(weight, dist.ReduceOp.AVG, algorithm=algorithm)
        results.append(torch.allclose(weight.detach(), torch.full((6,), (p - 1) / 2)) and weight.requires_grad)
    splits_in = [rank + 1] * p  # rank r sends r+1 elements to everyone
    splits_out = [s + 1 for s in range(p)]
    out = torch.empty(sum(splits_out))
    comm.all_to_all_single(out, torch.full((sum(splits_in),), float(rank)), splits_out, splits_in)
    results.append(torch.equal(out, torch.cat([torch.full((s + 1,), float(s)) for s in range(p)])))
    return results


def test_parameters_and_uneven_all_to_all():
    for rank_results in run_distributed(grad_and_uneven, 3):
        assert all(rank_results), rank_results


def async_failure_surfaces(rank, p):
    """A failed async collective whose handle nobody waits for is re-raised by synchronize()."""
    comm.init_communicator(None, comm.CommConfig(timeout_s=1.5, check="off"))
    if rank == 1:
        time.sleep(2.5)
        return "idle"
    comm.all_reduce(torch.ones(4), async_op=True, algorithm="ring")  # handle dropped
    try:
        comm.synchronize()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_synchronize_reraises_forgotten_async_failures():
    message = run_fresh_world(async_failure_surfaces, 2, timeout_s=60)[0]
    assert "queued with async_op=True" in message and "timed out" in message, message
