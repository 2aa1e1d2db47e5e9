"""Synthesised collectives (MILP routes): correct on the virtual executor, priced as the
simulator prices them, no slower than the ring, deterministic, cached, and a ring
fallback that says so."""

import json
import math
import warnings

import pytest
import torch

from plait.comm.algorithms import ring, synth, synth_milp
from plait.comm.algorithms.synth import BUILDERS, Sketch, synthesize
from plait.cost.topology_io import topology_fingerprint
from plait.comm.reference import rank_inputs, reference
from plait.comm.schedule import make_schedule
from plait.comm.virtual import run_schedule
from plait.cost.simulator import simulate
from plait.cost.topology import Link, Node, Topology


def profiled_like(ranks_per_host, inter_bytes_per_s=12.5e6, intra_bytes_per_s=(1e9,)):
    """The shape ``testbed.probe.profiled_topology`` gives: hosts h<i>, devices h<i>.r<k>
    linked to their host, one link between every two hosts. ``intra_bytes_per_s[i]``
    is host i's device link (the last value repeats)."""
    nodes, links = [], []
    for i, count in enumerate(ranks_per_host):
        nodes.append(Node(name=f"h{i}", kind="host", host=f"h{i}"))
        bandwidth = intra_bytes_per_s[min(i, len(intra_bytes_per_s) - 1)]
        for k in range(count):
            nodes.append(Node(name=f"h{i}.r{k}", kind="device", host=f"h{i}"))
            links.append(Link(endpoints=(f"h{i}.r{k}", f"h{i}"), bandwidth_bytes_per_s=bandwidth, latency_s=25e-6))
    for a in range(len(ranks_per_host)):
        for b in range(a + 1, len(ranks_per_host)):
            links.append(Link(endpoints=(f"h{a}", f"h{b}"), bandwidth_bytes_per_s=inter_bytes_per_s, latency_s=2e-4))
    return Topology(nodes=nodes, links=links, name=f"testbed-{'+'.join(map(str, ranks_per_host))}")


def host_ring(hosts=4, ranks=2, slow_bytes_per_s=2e6):
    """Hosts in a ring, 12.5 MB/s links but one slow one (h0-h1): traffic between
    non-neighbours routes through the host between."""
    nodes, links = [], []
    for i in range(hosts):
        nodes.append(Node(name=f"h{i}", kind="host", host=f"h{i}"))
        for k in range(ranks):
            nodes.append(Node(name=f"h{i}.r{k}", kind="device", host=f"h{i}"))
            links.append(Link(endpoints=(f"h{i}.r{k}", f"h{i}"), bandwidth_bytes_per_s=1e9, latency_s=25e-6))
    for i in range(hosts):
        bandwidth = slow_bytes_per_s if i == 0 else 12.5e6
        links.append(Link(endpoints=(f"h{i}", f"h{(i + 1) % hosts}"), bandwidth_bytes_per_s=bandwidth, latency_s=2e-4))
    return Topology(nodes=nodes, links=links, name="host-ring")


TOPOLOGIES = {
    "2x2": profiled_like([2, 2]),
    "3+5": profiled_like([3, 5], intra_bytes_per_s=(1e9, 4e8)),
    "ring4": host_ring(),
}


def buffer_numel(collective, topology, numel):
    return numel * topology.world_size if collective == "all_gather" else numel


def schedule_of(collective, topology, numel, sketch=None, **kwargs):
    n = buffer_numel(collective, topology, numel)
    result = synthesize(topology, collective, n, 4, sketch, **kwargs)
    return result, make_schedule(collective, "synth", topology.world_size, n, list(result.steps))


def run_and_check(collective, schedule, numel):
    """Run on the virtual executor against the reference oracle."""
    p = schedule.world_size
    inputs = rank_inputs(collective, p, numel, torch.float64, "sum", seed=3)
    if collective == "all_reduce":
        buffers = [x.clone() for x in inputs]
    else:
        buffers = [torch.zeros(p * numel, dtype=torch.float64) for _ in range(p)]
        for r, x in enumerate(inputs):
            buffers[r][r * numel:(r + 1) * numel] = x
    run_schedule(schedule, buffers, "sum")
    expected, bounds = reference(collective, inputs, "sum")
    for rank in range(p):
        error = (buffers[rank] - expected[rank]).abs()
        assert bool((error <= bounds[rank] + 1e-9).all()), f"rank {rank} wrong at {torch.nonzero(error > 1e-9)[:5]}"


CASES = [  # (topology, numel per rank input, sketch)
    ("2x2", 37, Sketch()),
    ("2x2", 3, Sketch(chunks_per_rank=2)),  # buffer smaller than the 8 chunks
    ("2x2", 37, Sketch(inter_host="matching", chunks_per_rank=2)),
    ("2x2", 37, Sketch(symmetry=False)),
    ("3+5", 101, Sketch()),
    ("3+5", 1, Sketch(inter_host="matching")),  # all-reduce of 1 element: 7 empty chunks
    ("3+5", 37, Sketch(chunks_per_rank=2)),
    ("ring4", 37, Sketch()),
    ("ring4", 101, Sketch(inter_host="matching")),
]


@pytest.mark.parametrize("collective", ["all_gather", "all_reduce"])
@pytest.mark.parametrize("name,numel,sketch", CASES)
def test_matches_the_reference(name, numel, sketch, collective):
    topology = TOPOLOGIES[name]
    result, schedule = schedule_of(collective, topology, numel, sketch)
    assert result.used == "synth"
    run_and_check(collective, schedule, numel)


@pytest.mark.parametrize("name,numel,sketch", CASES)
def test_each_rank_receives_each_chunk_once(name, numel, sketch):
    """Copies land on every element a rank does not own exactly once; the reduce-scatter
    sends each non-owned chunk out of each rank exactly once (the reversed trees)."""
    topology = TOPOLOGIES[name]
    p = topology.world_size
    _, gather = schedule_of("all_gather", topology, numel, sketch)
    for rank in range(p):
        landed = torch.zeros(p * numel, dtype=torch.int64)
        for step in gather.steps:
            for t in step.transfers:
                if t.dst == rank:
                    landed[t.dst_offset:t.dst_offset + t.numel] += 1
        expected = torch.ones(p * numel, dtype=torch.int64)
        expected[rank * numel:(rank + 1) * numel] = 0
        assert torch.equal(landed, expected), rank
    result, reduce = schedule_of("all_reduce", topology, numel, sketch)
    half = len(result.steps) // 2
    for rank in range(p):
        sent = torch.zeros(numel, dtype=torch.int64)
        for step in result.steps[:half]:
            for t in step.transfers:
                assert t.reduce
                if t.src == rank:
                    sent[t.src_offset:t.src_offset + t.numel] += 1
        owned = synth._chunk_regions("all_reduce", p, numel, sketch.chunks_per_rank)
        expected = torch.ones(numel, dtype=torch.int64)
        for c in range(rank * sketch.chunks_per_rank, (rank + 1) * sketch.chunks_per_rank):
            expected[owned[c][0]:owned[c][0] + owned[c][1]] = 0
        assert torch.equal(sent, expected), rank


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_objective_is_the_simulated_time(name):
    """With chunks of exactly the bucket size the MILP's objective is the schedule's
    time under its own model, and the simulator agrees to 1%: they differ only where a
    round's slowest flow is not the one with the longest route latency, or max-min
    fair sharing leaves a link idle while another is still busy (neither happens much
    when bandwidth dominates)."""
    topology = TOPOLOGIES[name]
    numel = 1 << 16  # one chunk of 256 KiB per rank
    result, schedule = schedule_of("all_gather", topology, numel)
    assert result.bucket_bytes == numel * 4
    assert result.objective_s == pytest.approx(result.milp_objective_s, rel=1e-9)
    assert simulate(schedule, topology, 4).total_time_s == pytest.approx(result.objective_s, rel=1e-2)


@pytest.mark.parametrize("collective", ["all_gather", "all_reduce"])
@pytest.mark.parametrize("name", ["3+5", "ring4"])
@pytest.mark.parametrize("numel", [64, 1 << 16])
def test_no_slower_than_the_ring_on_heterogeneous_topologies(name, numel, collective):
    topology = TOPOLOGIES[name]
    p, n = topology.world_size, buffer_numel(collective, topology, numel)
    _, schedule = schedule_of(collective, topology, numel)
    ring_schedule = make_schedule(collective, "ring", p, n, ring.BUILDERS[collective](p, n, None, {}))
    assert simulate(schedule, topology, 4).total_time_s <= simulate(ring_schedule, topology, 4).total_time_s * 1.001


@pytest.mark.parametrize("collective", ["all_gather", "all_reduce"])
def test_beats_the_ring_across_a_slow_link(collective):
    """2 hosts x 2 ranks: the ring crosses the 100 Mbit link with p-1 chunks each way
    (3 for all-gather), synthesis with each host's 2 chunks only: 2/3 of the time."""
    topology = TOPOLOGIES["2x2"]
    n = buffer_numel(collective, topology, 1 << 18)
    _, schedule = schedule_of(collective, topology, 1 << 18)
    ring_schedule = make_schedule(collective, "ring", 4, n, ring.BUILDERS[collective](4, n, None, {}))
    ratio = simulate(schedule, topology, 4).total_time_s / simulate(ring_schedule, topology, 4).total_time_s
    assert ratio < 0.7


@pytest.mark.parametrize("collective", ["all_gather", "all_reduce"])
def test_impossible_sketch_falls_back_to_the_ring(collective):
    topology = TOPOLOGIES["2x2"]
    sketch = Sketch(inter_host="matching", rounds=1)  # rank 0 cannot reach rank 3 in one round
    with pytest.warns(RuntimeWarning, match=r"ring \(fallback: from rank 0 to rank 3 it takes 2 rounds"):
        result, schedule = schedule_of(collective, topology, 37, sketch)
    assert result.used.startswith("ring (fallback:")
    n = buffer_numel(collective, topology, 37)
    assert list(result.steps) == ring.BUILDERS[collective](4, n, None, {})
    run_and_check(collective, schedule, 37)


def test_a_solver_that_runs_out_falls_back_to_the_ring():
    topology = TOPOLOGIES["3+5"]
    synth.clear_cache()
    with pytest.warns(RuntimeWarning, match=r"ring \(fallback: HiGHS"):
        result, schedule = schedule_of("all_reduce", topology, 41, time_limit_s=1e-9)
    assert result.used.startswith("ring (fallback: HiGHS")
    run_and_check("all_reduce", schedule, 41)
    synth.clear_cache()


def test_a_solution_found_by_the_clock_is_not_used(monkeypatch):
    """Whatever HiGHS holds when the wall-clock backstop stops it depends on the
    machine's speed; ranks could disagree, so it is refused."""
    real_milp = synth_milp.milp

    def out_of_time(*args, **kwargs):
        result = real_milp(*args, **kwargs)
        assert result.x is not None
        result.message = "Time limit reached. (HiGHS Status 13: ...)"
        return result

    monkeypatch.setattr(synth_milp, "milp", out_of_time)
    synth.clear_cache()
    with pytest.warns(RuntimeWarning, match="hit the 60 s backstop"):
        result, _ = schedule_of("all_gather", TOPOLOGIES["2x2"], 10)
    assert result.used.startswith("ring (fallback: HiGHS hit the 60 s backstop")
    synth.clear_cache()


def test_a_sketch_with_just_enough_rounds_is_synthesised():
    """Under "matching" rank 0 reaches rank 3 (other host, other local index) in 2 rounds."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result, schedule = schedule_of("all_gather", TOPOLOGIES["2x2"], 9, Sketch(inter_host="matching", rounds=2))
    assert result.used == "synth" and schedule.num_steps == 2
    run_and_check("all_gather", schedule, 9)


def test_host_cuts_make_the_lp_bound_useful():
    """Without the "enter every host" rows the LP relaxation copies a sliver of each
    chunk across the slow link and fans it out, and its bound is near 0. With them the
    LP alone knows each direction of the 2x2 link carries the other host's 2 chunks."""
    problem = synth._route_problem(TOPOLOGIES["2x2"], Sketch(), 1 << 20)
    model, _, unit_s = synth_milp._build(problem)
    objective = [0.0] * len(model.col_lower)
    for t in range(1, problem.rounds + 1):
        objective[model.col["tau", t]] = 1.0
    matrix = synth_milp.csr_matrix((model.data, model.indices, model.ptr),
                                   shape=(len(model.row_lower), len(model.col_lower)))
    relaxed = synth_milp.milp(objective, bounds=synth_milp.Bounds(model.col_lower, model.col_upper),
                              constraints=synth_milp.LinearConstraint(matrix, model.row_lower, model.row_upper))
    assert relaxed.fun * unit_s >= 2 * (1 << 20) / 12.5e6


def test_cache_returns_the_same_schedule(tmp_path, monkeypatch):
    topology = TOPOLOGIES["3+5"]
    synth.clear_cache()
    first, _ = schedule_of("all_reduce", topology, 1000, cache_dir=tmp_path)
    assert not first.from_cache
    [stored] = tmp_path.glob("synth-*.json")
    assert json.loads(stored.read_text())["key"]["topology"] == topology_fingerprint(topology)

    def refuse(*args, **kwargs):
        raise AssertionError("solved again instead of using the cache")

    monkeypatch.setattr(synth, "solve_routes", refuse)
    again, _ = schedule_of("all_reduce", topology, 1000)  # in memory
    same_bucket, _ = schedule_of("all_reduce", topology, 990)  # 124 elements a chunk: same 512 B bucket
    synth.clear_cache()
    from_disk, _ = schedule_of("all_reduce", topology, 1000, cache_dir=tmp_path)
    assert again.from_cache and same_bucket.from_cache and from_disk.from_cache
    assert again.steps == first.steps == from_disk.steps
    assert same_bucket.used == "synth"
    run_and_check("all_reduce", make_schedule("all_reduce", "synth", 8, 990, list(same_bucket.steps)), 990)


def test_two_solves_give_identical_steps():
    topology = TOPOLOGIES["3+5"]
    steps = []
    for _ in range(2):
        synth.clear_cache()
        result, _ = schedule_of("all_gather", topology, 777)
        assert not result.from_cache and result.used == "synth"
        steps.append(result.steps)
    assert steps[0] == steps[1]


def test_fingerprint_sees_links_and_allocation_not_the_name():
    base = profiled_like([2, 2])
    renamed = Topology(nodes=base.nodes, links=base.links, name="other")
    slower = profiled_like([2, 2], inter_bytes_per_s=12e6)
    assert topology_fingerprint(base) == topology_fingerprint(renamed)
    assert topology_fingerprint(base) != topology_fingerprint(slower)
    assert topology_fingerprint(base) != topology_fingerprint(base.with_allocation(["h0.r0", "h1.r0", "h0.r1", "h1.r1"]))


def test_symmetry_shrinks_the_milp_only_where_ranks_and_hosts_are_alike():
    def orbit_sizes(topology, **fields):
        return [len(members) for _, members in synth._route_problem(topology, Sketch(**fields), 64).orbits]

    assert orbit_sizes(TOPOLOGIES["2x2"]) == [4]  # hosts alike: one chunk stands for all
    assert orbit_sizes(TOPOLOGIES["ring4"]) == [2, 2, 2, 2]  # the slow link tells hosts apart
    assert orbit_sizes(TOPOLOGIES["3+5"]) == [3, 5]
    assert orbit_sizes(TOPOLOGIES["3+5"], inter_host="matching") == [1] * 8
    assert orbit_sizes(TOPOLOGIES["2x2"], symmetry=False, chunks_per_rank=2) == [1] * 8


def test_sketch_edges_and_rounds():
    topology = TOPOLOGIES["3+5"]  # ranks 0-2 on h0, 3-7 on h1
    matching = Sketch(inter_host="matching").edges(topology)
    assert (0, 3) in matching and (2, 5) in matching and (0, 4) not in matching and (1, 2) in matching
    assert len(Sketch().edges(topology)) == 8 * 7
    assert Sketch().rounds_for(topology) == 1 + 3 + 1  # hosts, fan-out in 5 ranks, slack
    assert Sketch(rounds=2).rounds_for(topology) == 2


def test_builders_read_the_options():
    topology = TOPOLOGIES["2x2"]
    steps = BUILDERS["all_reduce"](4, 37, None, {"topology": topology, "sketch": Sketch(chunks_per_rank=2),
                                                  "itemsize": 8, "segments": 3})
    run_and_check("all_reduce", make_schedule("all_reduce", "synth", 4, 37, steps), 37)
    assert BUILDERS["all_gather"](4, 0, None, {"topology": topology}) == []


def test_error_messages():
    topology = TOPOLOGIES["2x2"]
    with pytest.raises(ValueError, match='algorithm "synth" needs a topology'):
        BUILDERS["all_reduce"](4, 10, None, {})
    with pytest.raises(ValueError, match=r"allocates 4 ranks but the collective runs on 3; .*3 ranks"):
        BUILDERS["all_gather"](3, 9, None, {"topology": topology})
    with pytest.raises(ValueError, match=r"chunks_per_rank=0 must be an int >= 1; inter_host='ring' must be one of"):
        Sketch(chunks_per_rank=0, inter_host="ring")
    with pytest.raises(ValueError, match=r"rounds=0 must be an int >= 1"):
        Sketch(rounds=0)
    with pytest.raises(TypeError, match="sketch must be"):
        synthesize(topology, "all_reduce", 10, 4, {"chunks_per_rank": 2})
    with pytest.raises(ValueError, match="not p=4 equal regions"):
        synthesize(topology, "all_gather", 10, 4)
    with pytest.raises(ValueError, match="not 'broadcast'"):
        synthesize(topology, "broadcast", 10, 4)


def test_single_rank_and_empty_buffers_need_no_steps():
    one = profiled_like([1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert synthesize(one, "all_reduce", 10, 4).steps == ()
        assert synthesize(TOPOLOGIES["2x2"], "all_reduce", 0, 4).steps == ()


def test_round_time_is_latency_plus_busiest_link():
    problem = synth._route_problem(TOPOLOGIES["2x2"], Sketch(), 1000)
    # ranks 0 and 1 both send to host h1: 2000 bytes on the h0 -> h1 link
    cost_s = synth_milp.round_time_s([(0, 0, 2), (1, 1, 3)], lambda chunk: 1000, problem)
    assert cost_s == pytest.approx(2 * 25e-6 + 2e-4 + 2000 / 12.5e6)
    assert math.isclose(synth_milp.round_time_s([], lambda chunk: 1000, problem), 0.0)
