"""The shared-memory transport on real processes: the collective matrix on it (also
through a ring small enough that every message streams and wraps), gloo still
covered, ranks on two "hosts" (two shared-memory directories) mixing both
transports, and a rank killed mid-collective: named by its peers, nothing left in
/dev/shm."""

import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

import plait.comm as comm
from plait.comm.communicator import communicator_for
from plait.comm.errors import CommError
from plait.testing import run_distributed, run_fresh_world
from plait.testing.world import WorkerCrashed
from tests.comm.gloo_checks import check_collective

pytestmark = pytest.mark.slow

ALL = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather", "scatter", "all_to_all",
       "barrier"]


def _plait_files():
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith("plait-shm-"))


def world_transport(rank, world_size, numel):
    communicator = communicator_for(None)
    communicator.created.wait()
    tensor = torch.arange(numel, dtype=torch.float32) + rank
    before_sent, before_ring = communicator.transport.bytes_sent, communicator.transport.shm.payload_bytes_written
    comm.all_reduce(tensor, algorithm="ring")
    sent = communicator.transport.bytes_sent - before_sent
    ring = communicator.transport.shm.payload_bytes_written - before_ring
    expected = torch.arange(numel, dtype=torch.float32) * world_size + sum(range(world_size))
    # p2p through link_for: the communicator (the whole group is on this host), so shared memory
    link = comm.link_for(None)
    before_ring = communicator.transport.shm.payload_bytes_written
    if rank == 0:
        comm.send(torch.arange(10.0), group=link, group_dst=world_size - 1, tag=3)
    elif rank == world_size - 1:
        got = torch.zeros(10)
        comm.recv(got, group=link, group_src=0, tag=3)
        assert torch.equal(got, torch.arange(10.0))
    p2p_bytes = communicator.transport.shm.payload_bytes_written - before_ring
    return (communicator.transport.description, sent, ring, torch.equal(tensor, expected), link is communicator,
            p2p_bytes)


@pytest.mark.parametrize("p", [2, 5])
def test_the_default_world_talks_through_shared_memory(p):
    results = run_distributed(world_transport, p, 100_003)
    for rank, (description, sent, ring, correct, linked, p2p_bytes) in enumerate(results):
        assert description.startswith(f"shm with group ranks {list(range(p))}")
        assert correct and linked
        assert p2p_bytes == (40 if rank == 0 else 0)  # the p2p message went into a ring
        # every byte the executor handed over went into a ring (the in-band header included)
        assert ring == sent and ring >= 2 * (p - 1) * (100_003 // p) * 4


@pytest.mark.parametrize("collective", ALL)
def test_every_algorithm_through_a_ring_smaller_than_its_messages(collective):
    # float64 and sum only (the full matrix of dtypes and ops runs on shared memory in test_gloo.py)
    # segment_bytes=0: whole messages (a split would cap segments at a quarter ring: transport.stream_segment_bytes)
    config = dict(transport="shm", shm_ring_bytes=4096, segment_bytes=0)
    results = run_distributed(check_collective, 3, collective, "float64", [0, 1031, 70_001], ["sum"], config=config)
    failures = [failure for rank_failures in results for failure in rank_failures]
    assert not failures, failures[:10]


@pytest.mark.parametrize("collective", ALL)
def test_every_algorithm_still_runs_on_gloo(collective):
    results = run_distributed(check_collective, 3, collective, "float64", [5, 1031], ["sum"],
                              config=dict(transport="gloo"))
    failures = [failure for rank_failures in results for failure in rank_failures]
    assert not failures, failures[:10]


def two_hosts(rank, world_size, base):
    """Ranks 0, 1 see one shared-memory directory and ranks 2, 3 another: two hosts."""
    directory = os.path.join(base, f"host{rank // 2}")
    os.makedirs(directory, exist_ok=True)
    group = dist.new_group(list(range(world_size)))
    communicator = comm.init_communicator(group, comm.CommConfig(transport="shm", shm_dir=directory))
    results = {"description": communicator.transport.description}
    for algorithm in ("ring", "hierarchical", "halving_doubling", "star"):
        tensor = torch.arange(300_001, dtype=torch.float64) * (rank + 1)
        comm.all_reduce(tensor, algorithm=algorithm, group=communicator)
        results[algorithm] = torch.equal(tensor, torch.arange(300_001, dtype=torch.float64) * 10)
    results["link"] = comm.link_for(group) is group  # two hosts: p2p protocols keep gloo
    try:
        comm.irecv(torch.zeros(1), group=communicator, tag=5)
        results["any"] = "posted"
    except CommError as error:
        results["any"] = str(error)
    peer = rank ^ 1  # a pair on one host, through shared memory
    remote = (rank + 2) % 4  # a pair across hosts, through gloo
    for other in (peer, remote):
        out, back = torch.full((7,), float(rank)), torch.zeros(7)
        sent = comm.isend(out, group=communicator, group_dst=other, tag=9)
        comm.irecv(back, group=communicator, group_src=other, tag=9).wait()
        sent.wait()
        results[f"p2p {other}"] = back.tolist() == [float(other)] * 7
    comm.destroy_process_group(group)
    return results


def test_ranks_on_two_hosts_mix_shared_memory_and_gloo(tmp_path):
    base = "/dev/shm/plait-test-two-hosts"
    try:
        results = run_distributed(two_hosts, 4, base)
    finally:
        for host in ("host0", "host1"):
            directory = os.path.join(base, host)
            if os.path.isdir(directory):
                assert os.listdir(directory) == []  # every segment unlinked
                os.rmdir(directory)
        if os.path.isdir(base):
            os.rmdir(base)
    for rank, result in enumerate(results):
        assert result["description"].startswith(f"shm with group ranks {[0, 1] if rank < 2 else [2, 3]}")
        assert all(result[name] for name in ("ring", "hierarchical", "halving_doubling", "star")), result
        assert "cannot span shared memory and gloo" in result["any"] and result["link"]
        assert all(value for key, value in result.items() if key.startswith("p2p")), result


def killed_mid_collective(rank, world_size):
    comm.init_communicator(None, comm.CommConfig(transport="shm", timeout_s=60.0))
    tensor = torch.ones(4 << 20)
    comm.all_reduce(tensor)  # everyone is set up and running
    if rank == 2:
        threading.Timer(0.05, os._exit, (3,)).start()
    start = time.monotonic()
    try:
        for _ in range(1000):
            comm.all_reduce(tensor, algorithm="ring")
    except CommError as error:
        raise RuntimeError(f"after {time.monotonic() - start:.1f} s: {error}") from None
    return "no error"


def test_a_rank_killed_mid_collective_is_named_and_leaves_nothing_behind():
    before = _plait_files()
    with pytest.raises(WorkerCrashed) as crash:
        run_fresh_world(killed_mid_collective, 3, timeout_s=120.0, grace_s=30.0)
    text = str(crash.value)
    assert crash.value.rank == 2 and "ranks [0, 1] had raised" in text, text
    # each survivor names the rank it waited for as dead (rank 2, or a survivor that failed
    # and exited first), found by the liveness check well inside the 60 s timeout
    found = dict((rank, (float(elapsed_s), dead)) for elapsed_s, rank, dead in
                 re.findall(r"after ([0-9.]+) s: rank (\d): .*? rank (\d) \(pid \d+\) died", text))
    assert sorted(found) == ["0", "1"] and "2" in {dead for _, dead in found.values()}, text
    assert all(elapsed_s < 30.0 for elapsed_s, _ in found.values()), text
    assert _plait_files() == before


def auto_per_transport(rank, world_size):
    chosen = {}
    # the default communicator of a fresh group is created by its first call: auto must wait for
    # the set-up's answer (shared memory for the whole group) before it picks from a table
    lazy = dist.new_group(list(range(world_size)))
    comm.broadcast(torch.zeros(2 << 20), 0, group=lazy)  # 8 MiB
    chosen["shm"] = comm.communicator_for(lazy).stats()["broadcast"]["algorithms"]
    comm.destroy_process_group(lazy)
    group = comm.init_communicator(dist.new_group(list(range(world_size))), comm.CommConfig(transport="gloo"))
    comm.broadcast(torch.zeros(2 << 20), 0, group=group)
    chosen["gloo"] = group.stats()["broadcast"]["algorithms"]
    comm.destroy_process_group(group)
    return chosen


def test_auto_follows_the_table_of_the_transport_the_whole_group_uses():
    for chosen in run_distributed(auto_per_transport, 3):
        assert chosen == {"shm": {"tree": 1}, "gloo": {"ring": 1}}


def fallbacks(rank, world_size):
    outcomes = {}
    cases = {"missing": dict(shm_dir="/nonexistent-plait-shm"), "too small": dict(shm_ring_bytes=1 << 40)}
    for name, fields in cases.items():
        for transport in ("auto", "shm"):
            group = dist.new_group(list(range(world_size)))
            try:
                communicator = comm.init_communicator(group, comm.CommConfig(transport=transport, **fields))
                tensor = torch.ones(5)
                comm.all_reduce(tensor, group=communicator)  # still works, over gloo
                outcomes[(name, transport)] = (communicator.transport.description, tensor.tolist())
            except ValueError as error:
                outcomes[(name, transport)] = ("error", str(error))
            comm.destroy_process_group(group)
    return outcomes


def test_an_unusable_shared_memory_directory_falls_back_to_gloo_or_fails_naming_why():
    for outcomes in run_distributed(fallbacks, 2):
        description, values = outcomes[("missing", "auto")]
        assert description == ("gloo (no shared memory: /nonexistent-plait-shm is missing or not writable)")
        assert values == [2.0] * 5
        kind, text = outcomes[("missing", "shm")]
        assert kind == "error" and "rank 0 cannot use shared memory: /nonexistent-plait-shm is missing" in text
        description, values = outcomes[("too small", "auto")]
        need = 2 * (4096 + (4096 + (1 << 40)))
        assert description.startswith("gloo (no shared memory: /dev/shm has ") and f"need {need} bytes" in description
        assert values == [2.0] * 5
        kind, text = outcomes[("too small", "shm")]
        assert kind == "error" and f"need {need} bytes" in text and "lower CommConfig.shm_ring_bytes" in text


def pipeline_over(rank, world_size):
    """The same 1F1B training over a group on gloo and over the shared-memory world:
    the engine's activations and gradients take the group's transport."""
    import copy

    import torch.nn.functional as F

    from plait.parallel.pipeline import build
    from plait.parallel.pipeline.engine import PipelineEngine
    from tests.parallel.test_pipeline_engine import _batch, _chunks, _model

    losses, moved = {}, {}
    gloo_group = comm.init_communicator(dist.new_group(list(range(world_size))), comm.CommConfig(transport="gloo"))
    for name, group in (("gloo", gloo_group.group), ("shm", None)):
        schedule = build("1f1b", world_size, 4)
        chunks = _chunks(copy.deepcopy(_model()), schedule.stages)
        engine = PipelineEngine(schedule, {s: chunks[s] for _, s in schedule.stages_of(rank)}, F.cross_entropy,
                                group=group, timeout_s=60)
        optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
        world = communicator_for(None)
        world.created.wait()
        shm = world.transport.shm
        before = shm.payload_bytes_written
        losses[name] = [engine.train_step(*_batch(step, 16), optimizer) for step in range(2)]
        moved[name] = (type(engine.link).__name__, shm.payload_bytes_written - before)
    comm.destroy_process_group(gloo_group)
    return losses, moved


def test_the_pipeline_engine_moves_activations_through_shared_memory_with_the_same_losses():
    for losses, moved in run_distributed(pipeline_over, 2):
        assert losses["shm"] == losses["gloo"]  # bit for bit: the transport changes no arithmetic
        assert moved["shm"][0] == "Communicator" and moved["gloo"][0] == "ProcessGroup"
        # 4 micro-batches of 4 x 16 float64 activations (or their gradients) each way, 2 steps
        assert moved["shm"][1] >= 2 * 4 * 4 * 16 * 8 and moved["gloo"][1] < moved["shm"][1]
