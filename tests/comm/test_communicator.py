"""One Communicator per group on real gloo ranks: groups progress independently (threads,
overlapping groups, async calls), in-band checks name mismatched calls, creation names
missing ranks, p2p takes torch's global ranks, barriers and async calls really wait."""

import gc
import itertools
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import plait.comm as comm
from plait.testing import run_distributed, run_fresh_world

pytestmark = pytest.mark.slow


# ----- groups progress independently -----------------------------------------------------------
def two_threads_two_groups(rank, p, calls):
    """Each of two threads issues ``calls`` all-reduces on its own group (both groups hold
    every rank); the threads interleave differently on each rank. One queue per process
    deadlocks here; torch completes it."""
    groups = [dist.new_group(list(range(p))), dist.new_group(list(range(p)))]
    results, errors = {}, []

    def worker(index):
        try:
            values = []
            for call in range(calls):
                x = torch.full((64,), float(rank + call + 100 * index))
                comm.all_reduce(x, group=groups[index], algorithm="ring" if call % 2 else "star")
                values.append(x[0].item())
                if (rank + index) % 2:
                    time.sleep(0.001)  # a different interleaving on each rank
            results[index] = values
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(repr(error))

    start = time.monotonic()
    threads = [threading.Thread(target=worker, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    expected = {index: [float(sum(range(p)) + p * (call + 100 * index)) for call in range(calls)] for index in range(2)}
    return errors, results == expected, time.monotonic() - start


def test_two_threads_on_two_groups_complete():
    for errors, correct, elapsed_s in run_distributed(two_threads_two_groups, 2, 20, timeout_s=90):
        assert not errors and correct, errors
        assert elapsed_s < 30, elapsed_s


def overlapping_cycle(rank, p):
    """Groups [0,1], [1,2], [0,2]; each rank issues async calls on its two groups in an
    order that makes a cycle: 0 waits for 1, 1 for 2, 2 for 0 if one queue served both."""
    pairs = [(0, 1), (1, 2), (0, 2)]
    groups = {pair: dist.new_group(list(pair)) for pair in pairs}
    order = {0: [(0, 1), (0, 2)], 1: [(1, 2), (0, 1)], 2: [(0, 2), (1, 2)]}[rank]
    tensors = {pair: torch.full((16,), float(rank)) for pair in order}
    handles = [comm.all_reduce(tensors[pair], group=groups[pair], async_op=True) for pair in order]
    for handle in handles:
        handle.wait(timeout=30)
    return all(torch.all(tensors[pair] == float(sum(pair))) for pair in order)


def test_overlapping_groups_issued_in_a_cycle_complete():
    assert all(run_distributed(overlapping_cycle, 3, timeout_s=60))


def dp_buckets_beside_tp(rank, p):
    """DataParallel's bucket all-reduces queued on the dp group while tensor-parallel
    collectives run on the tp group. Rank 0 queues its dp buckets, then runs the next
    micro-batch's tp all-reduces; rank 1 runs its tp all-reduces first and joins the dp
    calls 1 s later. Behind one queue per process this deadlocks (rank 0's tp calls
    wait for its dp calls, which wait for rank 1, which waits in its tp calls); with a
    queue per group the tp calls finish at once on both ranks."""
    dp_group, tp_group = dist.new_group([0, 1]), dist.new_group([0, 1])
    for group in (dp_group, tp_group):
        comm.init_communicator(group)
    buckets = [torch.full((1000,), float(rank + i)) for i in range(3)]

    def launch_buckets():
        return [comm.all_reduce(bucket, group=dp_group, async_op=True) for bucket in buckets]

    handles = launch_buckets() if rank == 0 else []
    start = time.monotonic()
    activation = torch.full((256,), float(rank))
    for _ in range(5):  # the next micro-batch's forward: its tp all-reduces
        comm.all_reduce(activation, group=tp_group)
        activation /= 2
    tp_s = time.monotonic() - start
    if rank == 1:
        time.sleep(1.0)
        handles = launch_buckets()
    for handle in handles:
        handle.wait(timeout=30)
    correct = all(torch.all(bucket == float(1 + 2 * i)) for i, bucket in enumerate(buckets))
    return rank, tp_s, correct


def test_dp_buckets_do_not_hold_up_tensor_parallel_collectives():
    results = run_distributed(dp_buckets_beside_tp, 2, timeout_s=60)
    assert all(correct for _, _, correct in results)
    tp_s = dict((rank, seconds) for rank, seconds, _ in results)
    assert max(tp_s.values()) < 0.8, tp_s  # the tp calls ran while rank 0's dp calls waited ~1 s


# ----- in-band checks -------------------------------------------------------------------------
def mismatched_calls(rank, p, case):
    comm.init_communicator(None, comm.CommConfig(timeout_s=10.0))
    x = torch.ones(300)
    try:
        if case == "size":
            comm.all_reduce(torch.ones(300 + rank), algorithm="ring")
        elif case == "order":  # rank 0: all_reduce then broadcast; rank 1 the other way round
            first, second = (("all_reduce", "broadcast") if rank == 0 else ("broadcast", "all_reduce"))
            for name in (first, second):
                if name == "all_reduce":
                    comm.all_reduce(x, algorithm="ring")
                else:
                    comm.broadcast(x, src=0, algorithm="tree")
        elif case == "collective":
            if rank == 0:
                comm.all_gather_single(torch.empty(300 * p), torch.ones(300), algorithm="ring")
            else:
                comm.reduce_scatter_single(torch.empty(300), torch.ones(300 * p), algorithm="ring")
        elif case == "named":  # a small broadcast is carried in the agreement unless its algorithm is named
            comm.broadcast(x, src=0, algorithm="tree" if rank == 1 else None)
        elif case == "large":  # over INLINE_BYTES: the header travels alone, the payload after it
            comm.all_reduce(torch.ones(40_000), algorithm="ring" if rank == 0 else "halving_doubling")
        else:
            raise AssertionError(case)
    except comm.MismatchError as error:
        return "MismatchError", str(error)
    except comm.CommError as error:
        return type(error).__name__, str(error)
    return None, None


@pytest.mark.parametrize("case, fragments", [
    ("size", ["300 elements", "301 elements", "they differ in elements"]),
    ("order", ["issued in different orders", "all_reduce(", "broadcast("]),
    ("collective", ["all_gather(", "reduce_scatter(", "they differ in collective"]),
    ("large", ["algorithm=ring", "algorithm=halving_doubling", "they differ in algorithm"]),
    ("named", ["algorithm=bruck", "algorithm=tree", "they differ in algorithm"]),
])
def test_mismatched_calls_are_named_in_band_on_every_rank(case, fragments):
    for rank, (kind, message) in enumerate(run_fresh_world(mismatched_calls, 2, case, timeout_s=60)):
        assert kind == "MismatchError", (rank, kind, message)
        for fragment in fragments:
            assert fragment in message, (rank, fragment, message)
        assert f"rank {rank} is running call" in message and f"rank {1 - rank} sent call" in message


ROOTED_CALLS = ("broadcast", "reduce", "gather", "scatter")


def mismatched_roots(rank, p, transport, algorithms):
    """Each rank names itself (at p = 3: ranks 0 and 1 name rank 0, rank 2 itself) as the
    root of each rooted call, at 1 KB and 1 MB, under each of ``algorithms`` (None: the
    default table); after each, an all-reduce on the same group. Returns, per
    (collective, numel, algorithm): the error, the tensor's first element afterwards and
    the all-reduce's result."""
    comm.init_communicator(None, comm.CommConfig(timeout_s=20.0, transport=transport))
    root = rank if p == 2 else (2 if rank == 2 else 0)
    results = {}
    for collective, algorithm in itertools.product(ROOTED_CALLS, algorithms):
        kwargs = {} if algorithm is None else {"algorithm": algorithm}
        for numel in (256, 1 << 18):  # 1 KB and 1 MB: inside and above the 64 KiB inline size
            x = torch.full((numel,), float(rank + 1))
            outcome = None
            try:
                if collective == "broadcast":
                    comm.broadcast(x, src=root, **kwargs)
                elif collective == "reduce":
                    comm.reduce(x, dst=root, **kwargs)
                elif collective == "gather":
                    targets = [torch.empty(numel) for _ in range(p)] if rank == root else None
                    comm.gather(x, targets, dst=root, **kwargs)
                else:
                    sources = [torch.full((numel,), 10.0 + i) for i in range(p)] if rank == root else None
                    comm.scatter(x, sources, src=root, **kwargs)
            except comm.MismatchError as error:
                outcome = str(error)
            except comm.CommError as error:
                outcome = f"{type(error).__name__}: {error}"
            y = torch.full((8,), float(rank + 1))
            comm.all_reduce(y)  # no data moved: the group is still in step
            results[collective, numel, algorithm] = (outcome, x[0].item(), y[0].item())
    return results


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("p", [2, 3])
def test_mismatched_roots_are_named_on_every_rank_before_any_data_moves(transport, p):
    """Different roots used to return at once with different data over shared memory (a
    broadcast, a scatter: each "root" only sends) or wait out the deadline (a reduce, a
    gather: each only receives). Every rank now names every rank's root, its tensor is
    untouched, and the group goes on; under algorithm="torch" (torch's own collective
    after plait's check) too."""
    algorithms = (None, "torch") if (p, transport) == (2, "shm") else (None,)
    expected = "root: rank 0=0, rank 1=1" if p == 2 else "root: rank 0=0, rank 1=0, rank 2=2"
    for rank, results in enumerate(run_fresh_world(mismatched_roots, p, transport, algorithms, timeout_s=120)):
        assert len(results) == 2 * len(ROOTED_CALLS) * len(algorithms)
        for (collective, numel, algorithm), (message, x0, y0) in results.items():
            where = (collective, numel, algorithm, rank)
            assert message is not None and f"{collective}: ranks disagree ({expected})" in message, (where, message)
            assert x0 == float(rank + 1), where  # nothing received into the tensor
            assert y0 == sum(range(1, p + 1)), where


def root_refuses_its_list(rank, p):
    """The root gives a gather_list / scatter_list of the wrong length: it refuses its own
    arguments, the other ranks are already in the call. Per (collective, numel,
    algorithm): each rank's error, seconds to raise, and the next all-reduce."""
    comm.init_communicator(None, comm.CommConfig(timeout_s=30.0, transport="shm"))
    results = {}
    for collective, numel, algorithm in itertools.product(("gather", "scatter"), (16, 100_000), (None, "torch")):
        kwargs = {} if algorithm is None else {"algorithm": algorithm}
        x, start, outcome = torch.ones(numel), time.monotonic(), None
        try:
            short = [torch.empty(numel)] if rank == 0 else None  # p - 1 entries short
            if collective == "gather":
                comm.gather(x, short, dst=0, **kwargs)
            else:
                comm.scatter(x, short, src=0, **kwargs)
        except (ValueError, comm.CommError) as error:
            outcome = f"{type(error).__name__}: {error}"
        seconds = time.monotonic() - start
        y = torch.ones(4)
        comm.all_reduce(y)
        results[collective, numel, algorithm] = (outcome, seconds, y[0].item())
    return results


def test_a_root_that_refuses_its_own_list_is_named_on_every_rank():
    """The root's ValueError used to leave the other ranks in the call: they named the
    root's next call as a mismatch (or waited out the deadline), and the group was
    broken after it. Now the root still joins the argument exchange, saying it refused,
    so every rank raises at once and the group goes on."""
    p = 3
    for rank, results in enumerate(run_fresh_world(root_refuses_its_list, p, timeout_s=120)):
        for (collective, numel, algorithm), (outcome, seconds, after) in results.items():
            where = (rank, collective, numel, algorithm, outcome)
            if rank == 0:
                assert outcome.startswith(f"ValueError: {collective}: the root's {collective}_list must hold "
                                          f"world_size = {p} tensors, got 1"), where
            else:
                assert outcome.startswith(f"MismatchError: {collective}: rank 0 refused its own arguments"), where
            assert seconds < 15.0 and after == p, where  # not the 30 s deadline; the group still works


def agreed_rooted_calls(rank, p):
    """Rooted calls whose ranks agree still move their data, with no header on the payload:
    the agreement (a Bruck all-gather of the arguments) is the only extra traffic."""
    comm.init_communicator(None, comm.CommConfig(transport="shm"))
    results = []
    for root in range(p):
        x = torch.full((1000,), float(rank))
        comm.broadcast(x, src=root)
        y = torch.full((1000,), float(rank + 1))
        comm.reduce(y, dst=root)
        results.append((x[0].item(), y[0].item() if rank == root else None))
    comm.init_communicator(None)
    return results


def test_rooted_calls_that_agree_move_their_data():
    p = 3
    for rank, results in enumerate(run_distributed(agreed_rooted_calls, p)):
        for root, (broadcast_value, reduced) in enumerate(results):
            assert broadcast_value == float(root)
            assert reduced == (sum(range(1, p + 1)) if rank == root else None)


def carried_rooted_calls(rank, p):
    """Small broadcasts, scatters and gathers whose payload rides in the agreement, and
    the sizes just above the carried limit that run their schedule after it: every dtype
    byte-exact against what each rank computes for itself, every root, a non-contiguous
    broadcast, and what ran (stats) and how many messages each rank sent."""
    from plait.comm.agreement import CARRIED_BYTES

    communicator = comm.init_communicator(None, comm.CommConfig(transport="shm"))
    transport = communicator.transport
    failures, ran, sent = [], {}, {}

    def counted(name, key, call):  # messages handed to the rings, counted by the transport
        before = transport.messages_sent
        call()
        sent[name, *key] = transport.messages_sent - before

    def data(r, numel, dtype, salt):
        g = torch.Generator().manual_seed(1000 * r + salt)
        values = torch.randn(numel, generator=g, dtype=torch.float64) * 100
        return values > 0 if dtype == torch.bool else values.to(dtype)

    for dtype in (torch.float32, torch.float16, torch.bool, torch.int64, torch.complex64):
        size = torch.tensor([], dtype=dtype).element_size()
        limit = CARRIED_BYTES // size
        for numel in (1, 7, limit // p, limit // p + 1, limit, limit + 1):
            for root in range(p):
                salt = numel * 10 + root
                comm.reset_stats()
                key = (dtype, numel, root)
                x = data(rank, numel, dtype, salt)
                counted("broadcast", key, lambda: comm.broadcast(x, src=root))
                if not torch.equal(x, data(root, numel, dtype, salt)):
                    failures.append(("broadcast", dtype, numel, root))
                out = torch.empty(numel, dtype=dtype)
                sources = [data(i, numel, dtype, salt) for i in range(p)] if rank == root else None
                counted("scatter", key, lambda: comm.scatter(out, sources, src=root))
                if not torch.equal(out, data(rank, numel, dtype, salt)):
                    failures.append(("scatter", dtype, numel, root))
                targets = [torch.empty(numel, dtype=dtype) for _ in range(p)] if rank == root else None
                counted("gather", key, lambda: comm.gather(data(rank, numel, dtype, salt), targets, dst=root))
                if rank == root and not all(torch.equal(t, data(i, numel, dtype, salt)) for i, t in enumerate(targets)):
                    failures.append(("gather", dtype, numel, root))
                stats = comm.stats()
                for name in ("broadcast", "scatter", "gather"):
                    ran[name, *key] = (dict(stats[name]["algorithms"]), sent[name, *key])
    strided = torch.arange(20.0).view(4, 5).t() * (rank + 1)  # non-contiguous: written back
    comm.broadcast(strided, src=p - 1)
    if not torch.equal(strided, torch.arange(20.0).view(4, 5).t() * p):
        failures.append(("broadcast non-contiguous",))
    comm.init_communicator(None)
    return failures, ran


def test_small_rooted_calls_carry_their_payload_in_the_agreement():
    """One exchange where the agreement and the payload used to take two: ceil(lg p)
    messages per rank for a carried call (the Bruck all-gather; counted by the transport,
    not by the executor that planned them), and byte-exact data."""
    p = 3
    rounds = 2  # ceil(lg 3)
    for rank, (failures, ran) in enumerate(run_distributed(carried_rooted_calls, p, timeout_s=300)):
        assert failures == [], (rank, failures[:5])
        for (name, dtype, numel, root), (algorithms, messages) in ran.items():
            nbytes = numel * torch.tensor([], dtype=dtype).element_size()
            block = nbytes if name == "gather" else (nbytes * p if name == "scatter" else nbytes)
            carried = block <= (8 << 10) and p * (72 + -(-block // 8) * 8) <= (64 << 10)
            where = (rank, name, dtype, numel, root, algorithms, messages)
            if carried:
                assert algorithms == {"bruck": 1} and messages == rounds, where
            else:
                assert "bruck" not in algorithms and messages >= rounds, where  # the exchange, then the schedule


def inband_costs_no_message(rank, p):
    """The in-band check adds bytes (a header per first message to a peer) but, for small
    calls, not one message: counted at the transport."""
    results = {}
    for check in ("off", "inband"):
        communicator = comm.init_communicator(None, comm.CommConfig(check=check))
        before = (communicator.transport.messages_sent, communicator.transport.bytes_sent)
        x = torch.full((256,), float(rank))
        comm.all_reduce(x, algorithm="ring")
        results[check] = (communicator.transport.messages_sent - before[0],
                          communicator.transport.bytes_sent - before[1], bool(torch.all(x == sum(range(p)))))
    comm.init_communicator(None)
    return results


def test_inband_check_adds_no_message_for_small_calls():
    from plait.comm.inband import HEADER_BYTES

    for results in run_distributed(inband_costs_no_message, 3):
        (off_messages, off_bytes, off_ok), (in_messages, in_bytes, in_ok) = results["off"], results["inband"]
        assert off_ok and in_ok
        assert in_messages == off_messages  # the header rides in each (small) message
        assert in_bytes == off_bytes + in_messages * HEADER_BYTES


# ----- creation ------------------------------------------------------------------------------
def created_on_some_ranks(rank, p):
    if rank == 2:
        time.sleep(3.0)  # never creates it
        return None
    try:
        comm.init_communicator(None, comm.CommConfig(timeout_s=1.5))
    except comm.CommTimeoutError as error:
        return str(error)
    return "no error"


def test_a_communicator_missing_on_some_ranks_names_them():
    for rank, message in enumerate(run_fresh_world(created_on_some_ranks, 3, timeout_s=60)[:2]):
        assert "group ranks 2 never created their communicator" in message, (rank, message)


# ----- point-to-point with torch's ranks ------------------------------------------------------
def p2p_global_ranks(rank, p):
    group = dist.new_group([1, 2, 3])
    out = {}
    if rank == 1:
        comm.send(torch.full((4,), 10.0), dst=2, group=group)  # global rank 2, as torch
        comm.send(torch.full((4,), 11.0), group=group, group_dst=2)  # group rank 2 = global 3
        for bad in (dict(dst=0), dict(dst=1), dict(group_dst=3), dict(dst=2, group_dst=1)):
            try:
                comm.send(torch.ones(1), group=group, **bad)
            except ValueError as error:
                out[str(bad)] = str(error)
    elif rank == 2:
        t = torch.zeros(4)
        out["from"] = comm.recv(t, src=1, group=group)
        out["value"] = t[0].item()
    elif rank == 3:
        t = torch.zeros(4)
        out["from"] = comm.recv(t, group=group)  # any source
        out["value"] = t[0].item()
    # rank 3's any-source receive must be over before rank 2 sends it anything else: without
    # this barrier rank 2's swap message could be the one it takes (the test's own race)
    dist.barrier()
    messages = []
    if rank in (2, 3):  # batch_isend_irecv: 2 and 3 swap in one batch
        peer = 5 - rank
        mine, theirs = torch.full((3,), float(rank)), torch.zeros(3)
        ops = [comm.P2POp(comm.isend, mine, peer, group), comm.P2POp(comm.irecv, theirs, peer, group)]
        messages = comm.batch_isend_irecv(ops)
        for message in messages:
            message.wait()
        out["swapped"] = theirs[0].item()
    return out


def test_p2p_takes_global_ranks_as_torch_does():
    results = run_distributed(p2p_global_ranks, 4)
    assert results[2]["from"] == 1 and results[2]["value"] == 10.0
    assert results[3]["from"] == 1 and results[3]["value"] == 11.0
    assert results[2]["swapped"] == 3.0 and results[3]["swapped"] == 2.0
    errors = results[1]
    assert "dst=0 (a global rank) is not a member of this group (global ranks [1, 2, 3])" in errors["{'dst': 0}"]
    assert "cannot send to or receive from itself" in errors["{'dst': 1}"]
    assert "group_dst=3 is not a rank of this group of 3 ranks" in errors["{'group_dst': 3}"]
    assert "not both" in errors["{'dst': 2, 'group_dst': 1}"]


def rooted_group_ranks(rank, p):
    group = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    a = torch.full((5,), float(rank))
    comm.broadcast(a, group=group, group_src=1)  # group rank 1 = global rank 2
    b = torch.full((5,), float(rank))
    comm.reduce(b, dst=3, group=group)
    return a[0].item(), b[0].item()


def test_rooted_collectives_take_group_src_and_group_dst():
    results = run_distributed(rooted_group_ranks, 4)
    assert [r[0] for r in results[1:]] == [2.0, 2.0, 2.0]
    assert results[3][1] == 6.0


# ----- waits that really wait -----------------------------------------------------------------
def barrier_waits(rank, p, algorithm):
    comm.barrier(algorithm=algorithm)  # line up first
    time.sleep(0.3 * rank)
    entered = time.time()
    comm.barrier(algorithm=algorithm)
    left = time.time()
    return entered, left


@pytest.mark.parametrize("algorithm", ["bruck", "tree", "direct", "torch"])
def test_nobody_leaves_a_barrier_before_the_last_rank_entered(algorithm):
    times = run_distributed(barrier_waits, 3, algorithm)
    last_entered = max(entered for entered, _ in times)
    for rank, (_, left) in enumerate(times):
        assert left >= last_entered, (rank, left - last_entered)


def async_really_overlaps(rank, p):
    comm.barrier()
    if rank == 1:
        time.sleep(1.0)
    start = time.monotonic()
    x = torch.full((1000,), float(rank))
    handle = comm.all_reduce(x, async_op=True, algorithm="ring")
    returned_s = time.monotonic() - start
    completed_at_return = handle.is_completed()
    handle.wait()
    return returned_s, completed_at_return, time.monotonic() - start, bool(torch.all(x == 1.0))


def test_async_call_returns_at_once_and_completes_only_when_the_peer_comes():
    (returned_s, completed, waited_s, correct), _ = run_distributed(async_really_overlaps, 2)
    assert correct
    assert returned_s < 0.2 and not completed, (returned_s, completed)
    assert waited_s > 0.7, waited_s


# ----- destroying a group ---------------------------------------------------------------------
def destroyed_group(rank, p):
    """A subgroup used by plait, then destroyed with plait.comm.destroy_process_group:
    its comm thread stops and nothing of plait's keeps the group object alive (a group
    left alive at exit runs gloo's worker threads into Python's shutdown, which aborts)."""
    group = dist.new_group(list(range(p)))
    x = torch.ones(8)
    comm.all_reduce(x, group=group, async_op=True).wait()  # starts the group's comm thread
    communicator = comm.communicator_for(group)
    thread_name = communicator.engine.name
    alive_before = any(thread.name == thread_name for thread in threading.enumerate())
    group_ref = weakref.ref(group)
    comm.destroy_process_group(group)
    del group
    gc.collect()
    alive_after = any(thread.name == thread_name for thread in threading.enumerate())
    try:
        comm.all_reduce(x, group=communicator)
        later = "ran"
    except RuntimeError as error:
        later = str(error)
    world_still_works = torch.ones(4)
    comm.all_reduce(world_still_works)
    return x[0].item(), alive_before, alive_after, group_ref() is None, later, world_still_works[0].item()


def test_destroying_a_group_stops_its_thread_and_lets_go_of_it():
    for value, alive_before, alive_after, collected, later, world in run_fresh_world(destroyed_group, 2,
                                                                                      timeout_s=60):
        assert value == 2.0 and world == 2.0
        assert alive_before and not alive_after
        assert collected, "a communicator still holds the destroyed process group"
        assert "was closed (its process group was destroyed)" in later, later
