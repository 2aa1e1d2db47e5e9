"""The algorithms built from a topology (blink, synth) through plait.comm: the
topology is given to build_schedule or set in the CommConfig, checked against the
group, part of the ranks' agreement; the tuner prices them with the simulator; on
real gloo ranks they give the reference's result and the virtual executor's bits."""

import pytest
import torch

import plait.comm as comm
from plait.comm.algorithms import algorithms_for, build_schedule
from plait.comm.reference import count_wrong, rank_inputs, reference
from plait.comm.tuner import Tuner
from plait.comm.virtual import run_schedule
from plait.cost.simulator import simulate
from plait.cost.topology import Topology
from plait.testing import run_distributed, run_fresh_world
from tests.comm.topologies import SLOW_BYTES_PER_S, hosts

def two_hosts(ranks=(2, 2), between_bytes_per_s=SLOW_BYTES_PER_S) -> Topology:
    """Hosts h0, h1 with their ranks' devices, as `plait testbed probe` writes them."""
    return hosts(list(ranks), {(0, 1): between_bytes_per_s})


def test_topology_algorithms_need_the_groups_topology():
    with pytest.raises(ValueError, match="algorithm 'blink' is built from the cluster's links and needs its "
                                         "topology: pass topology="):
        build_schedule("all_reduce", "blink", 4, 64)
    with pytest.raises(ValueError, match="places 4 ranks but the group has 3: give the group's own topology"):
        build_schedule("all_reduce", "blink", 3, 64, topology=two_hosts())
    with pytest.raises(TypeError, match="must be a plait.cost.topology.Topology, got str"):
        build_schedule("all_reduce", "synth", 4, 64, topology="two-hosts.json")
    with pytest.raises(ValueError, match="topology='two-hosts.json': must be a plait.cost.topology.Topology"):
        comm.CommConfig(topology="two-hosts.json")


def test_they_are_listed_only_where_a_topology_is_at_hand():
    assert "blink" not in algorithms_for("all_reduce") and "synth" not in algorithms_for("all_gather")
    assert {"blink", "synth"} <= set(algorithms_for("all_reduce", with_topology=True))
    with pytest.raises(ValueError, match="does not implement reduce_scatter; algorithms for reduce_scatter"):
        build_schedule("reduce_scatter", "blink", 4, 64, topology=two_hosts())


def test_schedules_are_cached_per_cluster_not_per_object():
    first = build_schedule("broadcast", "blink", 4, 1000, root=0, topology=two_hosts())
    assert build_schedule("broadcast", "blink", 4, 1000, root=0, topology=two_hosts()) is first
    faster = build_schedule("broadcast", "blink", 4, 1000, root=0, topology=two_hosts(between_bytes_per_s=25e6))
    assert faster is not first


def test_the_tuner_on_a_topology_prices_by_simulation_and_picks_around_the_slow_link():
    """On two hosts joined by 100 Mbit, the ring's all-reduce sends 2(p-1)/p n = 1.5 n
    across the link each way, a host-aware one n: the tuner must not pick the ring for
    large sizes, and its prices are the simulator's times."""
    topology = two_hosts()
    tuner = Tuner(None, topology=topology, call_overhead_s=1e-3, source="test")
    assert {"blink", "synth", "hierarchical"} <= set(tuner.algorithms("all_reduce", 4))
    nbytes = 16 << 20
    predicted = tuner.predictions("all_reduce", nbytes, 4)
    ring = build_schedule("all_reduce", "ring", 4, nbytes // 4, segments=64)
    assert predicted["ring"] == pytest.approx(1e-3 + simulate(ring, topology, 4).total_time_s)
    assert predicted["ring"] > 1.4 * min(predicted.values())
    assert tuner.choose("all_reduce", nbytes, 4) in ("blink", "synth", "hierarchical")
    # a bucket's middle size is no multiple of p inputs: priced as the nearest all-gather that is
    assert tuner.choose("all_gather", 4 << 20, 4) in ("blink", "synth")


# hierarchical: grouped by the topology's hosts when no hierarchy is given
CASES = [("broadcast", "blink"), ("reduce", "blink"), ("all_reduce", "blink"), ("all_gather", "blink"),
         ("all_reduce", "synth"), ("all_gather", "synth"), ("all_reduce", "hierarchical")]


def topology_collectives(rank, p, numel):
    """Every (collective, algorithm) of CASES on this world, whose topology is hosts of
    1 and 3 ranks;
    returns failures (wrong elements or bits other than the virtual executor's)."""
    topology = two_hosts(ranks=(1, 3))
    comm.init_communicator(None, comm.CommConfig(topology=topology, pipeline_segment_bytes=1024))
    failures = []
    try:
        for collective, algorithm in CASES:
            total = numel * p if collective == "all_gather" else numel
            inputs = rank_inputs(collective, p, numel, torch.float64, "sum", seed=5)
            expected, bounds = reference(collective, inputs, "sum", 1)
            mine = inputs[rank].clone()
            if collective == "all_gather":
                out = torch.empty(total, dtype=torch.float64)
                comm.all_gather_single(out, mine, algorithm=algorithm)
            elif collective == "broadcast":
                comm.broadcast(mine, src=1, algorithm=algorithm)
                out = mine
            elif collective == "reduce":
                comm.reduce(mine, dst=1, algorithm=algorithm)
                out = mine if rank == 1 else None
            else:
                comm.all_reduce(mine, algorithm=algorithm)
                out = mine
            if out is None:
                continue
            if count_wrong(out, expected[rank], bounds[rank]):
                failures.append((collective, algorithm, rank, "wrong vs reference"))
            schedule = build_schedule(collective, algorithm, p, total, 1 if collective in ("broadcast", "reduce")
                                      else None, max(1, total * 8 // 1024), hierarchy=topology.hierarchy(),
                                      topology=topology)
            buffers = [x.clone() if collective != "all_gather" else _gather_buffer(x, r, p)
                       for r, x in enumerate(inputs)]
            run_schedule(schedule, buffers)
            if not torch.equal(out, buffers[rank]):
                failures.append((collective, algorithm, rank, "differs from the virtual executor"))
    finally:
        comm.init_communicator(None)
    return failures


def _gather_buffer(x, rank, p):
    buffer = torch.zeros(x.numel() * p, dtype=x.dtype)
    buffer[rank * x.numel():(rank + 1) * x.numel()] = x
    return buffer


@pytest.mark.slow
def test_real_ranks_give_the_reference_and_the_virtual_executors_bits():
    failures = [f for rank_failures in run_distributed(topology_collectives, 4, 1031) for f in rank_failures]
    assert not failures, failures[:10]


def other_topology_per_rank(rank, p):
    try:
        comm.init_communicator(None, comm.CommConfig(topology=two_hosts(between_bytes_per_s=SLOW_BYTES_PER_S * (
            2 if rank == 3 else 1))))
    except comm.MismatchError as error:
        return str(error)
    finally:
        comm.init_communicator(None)
    return None


@pytest.mark.slow
def test_ranks_given_other_clusters_are_refused_when_the_communicator_is_made():
    messages = run_distributed(other_topology_per_rank, 4)
    assert all(message and "asked for a different CommConfig" in message for message in messages), messages


def diverging_schedules(rank, p):
    """Rank 1's blink broadcast is built with one more pipeline segment than the
    others' (as a synthesis cut short by its clock on one rank would differ): same
    cluster, other schedule. Returns what the call raised."""
    from plait.comm.algorithms import ALGORITHMS, blink

    if rank == 1:
        ALGORITHMS["blink"] = {**ALGORITHMS["blink"], "broadcast": lambda world, numel, root, options: blink.broadcast(
            world, numel, root, {**options, "segments": options["segments"] + 1})}
    # the deep check agrees before any message; the in-band one compares headers as they
    # arrive, and a payload of another size can reach gloo first (which then aborts)
    comm.init_communicator(None, comm.CommConfig(topology=two_hosts(), timeout_s=20.0, check="deep"))
    try:
        comm.broadcast(torch.ones(1 << 16), src=0, algorithm="blink")
    except comm.MismatchError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_ranks_whose_schedules_differ_are_named_not_fed_wrong_messages():
    messages = run_fresh_world(diverging_schedules, 4, timeout_s=60)
    assert all(message and "hierarchy or schedule differs between ranks [[0, 2, 3], [1]]" in message
               for message in messages), messages
