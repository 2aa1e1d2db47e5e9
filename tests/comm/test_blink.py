"""Blink: spanning-tree packings (against max-flow and closed forms) and the schedules
built from them (against the float64 reference on the virtual executor)."""

import itertools

import numpy as np
import pytest
import torch

from plait.comm import layout
from plait.comm.algorithms import blink, blink_packing
from plait.comm.algorithms.blink_packing import (
    Tree, broadcast_upper_bound_bytes_per_s, max_flow_bytes_per_s, min_arborescence, pack_all_gather, pack_trees)
from plait.comm.reference import count_wrong, rank_inputs, reference
from plait.comm.schedule import make_schedule
from plait.comm.virtual import run_schedule
from plait.cost.simulator import simulate
from plait.cost.topology import Link, Node, Topology
from plait.cost.topology_io import topology_fingerprint
from tests.comm.topologies import LOCAL_BYTES_PER_S, SLOW_BYTES_PER_S, hosts

def switch(p, port_bytes_per_s=1e9):
    """p devices on one non-blocking switch, one port of ``port_bytes_per_s`` each."""
    nodes = [Node(name="sw", kind="switch")] + [Node(name=f"d{i}", kind="device") for i in range(p)]
    links = [Link(endpoints=(f"d{i}", "sw"), bandwidth_bytes_per_s=port_bytes_per_s, latency_s=1e-6)
             for i in range(p)]
    return Topology(nodes=nodes, links=links, name=f"switch{p}")


RING_SLOW_BYTES_PER_S = 3e6
TOPOLOGIES = {
    "2x2": lambda: hosts([2, 2], {(0, 1): SLOW_BYTES_PER_S}),
    "3+5": lambda: hosts([3, 5], {(0, 1): 25e6}),
    # h0-h1-h2-h3-h0, h3-h0 slow; h0 <-> h2 traffic routes through h1 or h3
    "ring4": lambda: hosts([2, 2, 2, 2], {(0, 1): SLOW_BYTES_PER_S, (1, 2): SLOW_BYTES_PER_S,
                                           (2, 3): SLOW_BYTES_PER_S, (3, 0): RING_SLOW_BYTES_PER_S}),
    "ring4x1": lambda: hosts([1, 1, 1, 1], {(0, 1): SLOW_BYTES_PER_S, (1, 2): SLOW_BYTES_PER_S,
                                             (2, 3): SLOW_BYTES_PER_S, (3, 0): RING_SLOW_BYTES_PER_S}),
    "switch5": lambda: switch(5),
    "unequal3": lambda: hosts([2, 3, 1], {(0, 1): SLOW_BYTES_PER_S, (1, 2): 25e6, (0, 2): 5e6}),
    "1+1": lambda: hosts([1, 1], {(0, 1): SLOW_BYTES_PER_S}),
}
BUILT = {name: make() for name, make in TOPOLOGIES.items()}


# ----- schedules against the reference ----------------------------------------------------------
def run_blink(collective, topology, numel, root, segments, op="sum", dtype=torch.float32):
    """Wrong elements of every rank after running blink's schedule on the virtual executor."""
    p = topology.world_size
    inputs = rank_inputs(collective, p, numel, dtype, op, seed=3)
    prepared, outputs = [], []
    for rank, x in enumerate(inputs):
        if collective == "all_gather":
            out = x.new_empty(numel * p)
            prepared.append(layout.prepare_all_gather(out, x, rank, p))
        else:
            out = x.clone()
            prepared.append({"broadcast": lambda: layout.prepare_broadcast(out, rank, p, root),
                             "reduce": lambda: layout.prepare_reduce(out, rank, p, root, op),
                             "all_reduce": lambda: layout.prepare_all_reduce(out, rank, p, op)}[collective]())
        outputs.append(out)
    options = {"topology": topology, "segments": segments}
    steps = blink.BUILDERS[collective](p, prepared[0].numel, root, options)
    schedule = make_schedule(collective, "blink", p, prepared[0].numel, steps, root)
    buffers = [item.build() for item in prepared]
    run_schedule(schedule, buffers, op)
    for item, buffer in zip(prepared, buffers):
        item.finish(buffer)
    expected, bounds = reference(collective, inputs, op, root if root is not None else 0)
    return [count_wrong(o, e, b) for o, e, b in zip(outputs, expected, bounds)]


@pytest.mark.parametrize("collective", ["broadcast", "reduce", "all_reduce", "all_gather"])
@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_every_builder_matches_the_reference(collective, name):
    topology = BUILT[name]
    p = topology.world_size
    roots = sorted({0, p // 2, p - 1}) if collective in ("broadcast", "reduce") else [None]
    failures = []
    for root, segments, numel in itertools.product(roots, (1, 3), (1, p - 1, 97, 1031)):
        wrong = run_blink(collective, topology, numel, root, segments)
        if any(wrong):
            failures.append((root, segments, numel, wrong))
    assert not failures, failures


@pytest.mark.parametrize("collective", ["reduce", "all_reduce"])
def test_reductions_with_max(collective):
    assert not any(run_blink(collective, BUILT["unequal3"], 211, 4, 2, op="max"))


def test_parts_follow_the_tree_rates():
    assert blink.proportional_sizes(10, [1.0, 1.0, 1.0]) == [4, 3, 3]  # like chunk_sizes
    assert blink.proportional_sizes(7, [3.0, 1.0]) == [5, 2]
    assert blink.proportional_sizes(1, [1.0, 5.0]) == [0, 1]
    assert sum(blink.proportional_sizes(1031, [0.3, 0.2, 0.5, 1e-9])) == 1031


def test_broadcast_steps_are_segments_plus_height():
    topology = BUILT["2x2"]
    tree = pack_trees(topology, 0).trees[0]
    assert tree.height == 2  # root -> its host mate and one remote rank, which relays to its mate
    schedule = make_schedule("broadcast", "blink", 4, 1000, blink.broadcast(4, 1000, 0, {"topology": topology,
                                                                                          "segments": 5}), 0)
    assert schedule.num_steps == 5 + 2 - 1
    assert [schedule.recv_numel(r) for r in range(4)] == [0, 1000, 1000, 1000]


# ----- packings --------------------------------------------------------------------------------------
def assert_is_spanning_arborescence(parent, root):
    assert parent[root] == -1 and sum(1 for u in parent if u == -1) == 1
    for v in range(len(parent)):
        seen = set()
        while parent[v] != -1:
            assert v not in seen, f"cycle through {v} in {parent}"
            seen.add(v)
            v = parent[v]
        assert v == root


def link_loads(topology, packing, both_ways=False, up=False):
    """Bytes/s each directed link carries, recounted from the routes."""
    load = np.zeros(topology.num_directed_links)
    for tree in packing.trees:
        for child, parent in enumerate(tree.parent):
            if parent >= 0:
                routes = [topology.route(child, parent)] if up else [topology.route(parent, child)]
                if both_ways:
                    routes.append(topology.route(child, parent))
                for route in routes:
                    for link in route:
                        load[link] += tree.rate_bytes_per_s
    return load


@pytest.mark.parametrize("name", ["2x2", "3+5", "ring4", "ring4x1", "switch5", "unequal3"])
def test_broadcast_rate_reaches_the_max_flow_bound(name):
    topology = BUILT[name]
    p = topology.world_size
    for root in sorted({0, p // 2, p - 1}):
        packing = pack_trees(topology, root, "broadcast")
        bound = broadcast_upper_bound_bytes_per_s(topology, root)
        assert packing.bound_bytes_per_s == bound
        assert 0.95 * bound <= packing.rate_bytes_per_s <= bound * (1 + 1e-6), (root, packing)
        assert 1 <= len(packing.trees) <= 2 * p
        for tree in packing.trees:
            assert_is_spanning_arborescence(tree.parent, root)
        capacity = np.asarray(topology.capacity_bytes_per_s)
        assert (link_loads(topology, packing) <= capacity * (1 + 1e-9)).all()
        reduce = pack_trees(topology, root, "reduce")
        assert 0.95 * reduce.bound_bytes_per_s <= reduce.rate_bytes_per_s
        assert (link_loads(topology, reduce, up=True) <= capacity * (1 + 1e-9)).all()


@pytest.mark.parametrize("name,expected_bytes_per_s", [
    ("2x2", SLOW_BYTES_PER_S),  # every byte to host 1 crosses the one link once
    ("3+5", 25e6),
    ("ring4", SLOW_BYTES_PER_S + RING_SLOW_BYTES_PER_S),  # both ways round: the root host's two links
    ("switch5", 1e9),  # each rank receives through its one port; a chain (or p-1 two-level trees) fills it
])
def test_broadcast_rate_closed_forms(name, expected_bytes_per_s):
    topology = BUILT[name]
    for root in range(topology.world_size):
        assert pack_trees(topology, root).rate_bytes_per_s == pytest.approx(expected_bytes_per_s, rel=1e-6)


@pytest.mark.parametrize("p", [3, 5, 8])
def test_switch_all_reduce_and_all_gather_match_the_ring_optimum(p):
    """On a uniform switch with port bandwidth B: all-reduce sends every byte up and down
    each tree, and the p ports together carry 2(p-1) R <= p B, so R = p B / (2(p-1));
    all-gather: each rank receives p - 1 chunks through one port, lambda = B / (p-1).
    Both are what a ring achieves: the packings must find them."""
    topology = switch(p, port_bytes_per_s=2e9)
    assert blink.best_all_reduce_packing(topology).rate_bytes_per_s == pytest.approx(p * 2e9 / (2 * (p - 1)))
    gather = pack_all_gather(topology)
    assert gather.rate_bytes_per_s == pytest.approx(2e9 / (p - 1))
    assert gather.bound_bytes_per_s == pytest.approx(2e9 / (p - 1))
    for r in range(p):
        assert 1 <= len(gather.trees_of(r)) <= 2 * p
        for tree in gather.trees_of(r):
            assert_is_spanning_arborescence(tree.parent, r)
    assert (link_loads(topology, gather) <= np.asarray(topology.capacity_bytes_per_s) * (1 + 1e-9)).all()


@pytest.mark.parametrize("ranks,link_bytes_per_s", [([2, 2], SLOW_BYTES_PER_S), ([3, 5], 25e6)])
def test_two_host_all_gather_closed_form(ranks, link_bytes_per_s):
    """Every chunk of a host's a ranks crosses its one link to the other host: with
    fast local links lambda = link / max(a, b)."""
    topology = hosts(ranks, {(0, 1): link_bytes_per_s})
    assert pack_all_gather(topology).rate_bytes_per_s == pytest.approx(link_bytes_per_s / max(ranks))


def every_arborescence(p, root):
    """Every parent array whose pointers all lead to ``root`` (p^(p-2) of them)."""
    for choice in itertools.product(range(p), repeat=p - 1):
        parent = choice[:root] + (-1,) + choice[root:]
        if all(_reaches(parent, v, root) for v in range(p)):
            yield parent


def _reaches(parent, v, root):
    for _ in range(len(parent)):
        if v == root:
            return True
        v = parent[v]
        if v == -1:
            return False
    return v == root


def route_usage(topology, parent, direction, memo):
    """Directed-link counts of a tree, recounted from topology.route."""
    usage = np.zeros(topology.num_directed_links)
    for child, u in enumerate(parent):
        if u >= 0:
            for a, b in {"down": [(u, child)], "up": [(child, u)], "both": [(u, child), (child, u)]}[direction]:
                if (a, b) not in memo:
                    memo[a, b] = np.bincount(topology.route(a, b), minlength=topology.num_directed_links)
                usage += memo[a, b]
    return usage


@pytest.mark.parametrize("name", ["2x2", "ring4x1", "switch5", "unequal3"])
def test_column_generation_equals_the_lp_over_every_tree(name):
    """The oracle: the same LP with a column for every spanning arborescence (n^(n-2) per
    root, enumerated), solved at once. Column generation must reach its optimum."""
    from scipy.optimize import linprog

    topology = BUILT[name]
    p, capacity = topology.world_size, np.asarray(topology.capacity_bytes_per_s)
    cases = [("broadcast", "down", [0]), ("reduce", "up", [p - 1]), ("all_reduce", "both", [0]),
             ("all_gather", "down", list(range(p)))]
    for collective, direction, roots in cases:
        memo = {}
        columns = [(r, route_usage(topology, parent, direction, memo)) for r in roots
                   for parent in every_arborescence(p, r)]
        # variables: lambda, then one rate per tree; lambda <= each root's total
        a_cap = np.column_stack([np.zeros(len(capacity))] + [usage for _, usage in columns])
        a_root = np.array([[1.0] + [-1.0 if r == root else 0.0 for r, _ in columns] for root in roots])
        result = linprog(np.r_[-1.0, np.zeros(len(columns))], A_ub=np.vstack([a_cap, a_root]),
                         b_ub=np.r_[capacity, np.zeros(len(roots))] / 1e6, bounds=(0, None), method="highs")
        optimum_bytes_per_s = -result.fun * 1e6
        if collective == "all_gather":
            packing = pack_all_gather(topology)
        else:
            packing = pack_trees(topology, roots[0], collective)
        assert packing.lp_rate_bytes_per_s == pytest.approx(optimum_bytes_per_s, rel=1e-6), collective
        assert packing.rate_bytes_per_s == pytest.approx(optimum_bytes_per_s, rel=1e-6), collective


def test_all_reduce_packing_fits_both_directions():
    topology = BUILT["ring4"]
    packing = blink.best_all_reduce_packing(topology)
    assert 0 < packing.rate_bytes_per_s <= packing.bound_bytes_per_s * (1 + 1e-6)
    load = link_loads(topology, packing, both_ways=True)
    assert (load <= np.asarray(topology.capacity_bytes_per_s) * (1 + 1e-9)).all()
    assert load.max() > 0
    for root in range(topology.world_size):  # the chosen root is the best one
        assert pack_trees(topology, root, "all_reduce").rate_bytes_per_s <= packing.rate_bytes_per_s * (1 + 1e-9)


def test_rounding_keeps_at_most_2p_trees_and_refills_the_capacity():
    topology = switch(3)
    usage = blink_packing._edge_usage(topology, "down")
    capacity = np.asarray(topology.capacity_bytes_per_s)
    chain, star = (-1, 0, 1), (-1, 0, 0)
    trees = [(0, chain, 1e8)] * 4 + [(0, star, 2e8)] * 4  # 8 > 2p = 6 trees, load below capacity
    kept = blink_packing._round(trees, usage, capacity, [0])
    assert len(kept) == 6
    assert [t.parent for t in kept[:4]] == [star] * 4  # the fastest survive
    load = sum(t.rate_bytes_per_s * blink_packing._tree_usage(usage, t.parent) for t in kept)
    assert load.max() == pytest.approx(1e9)  # scaled up until the root's port is full
    assert (load <= capacity * (1 + 1e-12)).all()


def test_min_arborescence_matches_brute_force():
    generator = np.random.default_rng(5)
    n = 5
    for trial in range(15):
        weight = generator.uniform(0.1, 1.0, (n, n))
        if trial % 3 == 0:
            weight[generator.random((n, n)) < 0.3] = np.inf  # some missing edges
        root = trial % n
        best = np.inf
        for choice in itertools.product(range(n), repeat=n - 1):
            parent = list(choice[:root]) + [-1] + list(choice[root:])
            try:
                assert_is_spanning_arborescence(parent, root)
            except AssertionError:
                continue
            best = min(best, sum(weight[parent[v], v] for v in range(n) if v != root))
        if not np.isfinite(best):
            with pytest.raises(ValueError):
                min_arborescence(weight, root)
            continue
        parent = min_arborescence(weight, root)
        assert_is_spanning_arborescence(parent, root)
        assert sum(weight[parent[v], v] for v in range(n) if v != root) == pytest.approx(best)


def test_max_flow_counts_parallel_paths():
    topology = BUILT["ring4x1"]
    # rank 0 to rank 2: via h1 (12.5e6) and via h3 (the 3e6 link)
    assert max_flow_bytes_per_s(topology, 0, 2) == pytest.approx(SLOW_BYTES_PER_S + RING_SLOW_BYTES_PER_S, rel=1e-6)
    assert max_flow_bytes_per_s(BUILT["2x2"], 0, 1) == pytest.approx(LOCAL_BYTES_PER_S, rel=1e-6)


def test_fingerprint_is_stable_and_tells_topologies_apart():
    assert topology_fingerprint(TOPOLOGIES["2x2"]()) == topology_fingerprint(BUILT["2x2"])
    assert topology_fingerprint(hosts([2, 2], {(0, 1): 25e6})) != topology_fingerprint(BUILT["2x2"])
    assert topology_fingerprint(BUILT["3+5"].with_allocation("3+4")) != topology_fingerprint(BUILT["3+5"])


# ----- the simulator agrees with the packing rate ---------------------------------------------------
@pytest.mark.parametrize("name", ["2x2", "ring4"])
def test_simulated_broadcast_time_is_size_over_rate(name):
    """Each step moves part_k / S over every edge of tree k, so every link carries at most
    capacity x n / (S R) bytes and (flows sharing a link max-min fairly, all finishing
    together when the link is the bottleneck) a full step takes n / (S R) plus latency.
    With S = 100 and height H, the S + H - 1 steps take at most (1 + (H-1)/S) n / R plus
    ~0.02 s of latency (the fill and drain steps are partly on fast local links): within
    3% of n / R, and never below it, since no schedule beats the packing's rate here."""
    topology = BUILT[name]
    packing = pack_trees(topology, 0)
    numel, itemsize, segments = 50_000_000, 4, 100
    steps = blink.broadcast(topology.world_size, numel, 0, {"topology": topology, "segments": segments})
    schedule = make_schedule("broadcast", "blink", topology.world_size, numel, steps, 0)
    ideal_s = numel * itemsize / packing.rate_bytes_per_s
    time_s = simulate(schedule, topology, itemsize).total_time_s
    assert ideal_s <= time_s <= 1.03 * ideal_s, (time_s, ideal_s)


# ----- errors --------------------------------------------------------------------------------------
def test_missing_topology_says_how_to_pass_one():
    with pytest.raises(ValueError, match=r'"blink" needs a topology.*topology=.*CommConfig'):
        blink.broadcast(4, 10, 0, {"segments": 1})


def test_wrong_world_size_names_both_numbers():
    with pytest.raises(ValueError, match=r"allocates 4 ranks.*world_size=6.*allocate 6 devices"):
        blink.all_reduce(6, 10, None, {"topology": BUILT["2x2"]})


def test_all_gather_needs_p_equal_chunks():
    with pytest.raises(ValueError, match="not p=4 equal chunks"):
        blink.all_gather(4, 10, None, {"topology": BUILT["2x2"]})


def test_unreachable_ranks_are_named():
    # Topology refuses zero bandwidth, so zero one link's capacity behind its back
    # (a bandwidth no other test uses, so no cached packing is shared).
    topology = hosts([2, 2], {(0, 1): 7e6})
    link = next(i for i, l in enumerate(topology.links) if l.endpoints == ("h0", "h1"))
    topology._index["capacity"][2 * link] = 0.0  # h0 -> h1
    with pytest.raises(ValueError, match=r"ranks \[2, 3\] cannot be reached from rank 0"):
        pack_trees(topology, 0)
    assert pack_trees(topology, 2, "broadcast").rate_bytes_per_s == pytest.approx(7e6)  # h1 -> h0 still works


def test_a_single_rank_needs_no_steps():
    assert blink.broadcast(1, 10, 0, {"topology": hosts([1], {})}) == []


def test_trees_report_depths():
    tree = Tree(1.0, (-1, 0, 1, 1))
    assert tree.depths() == (0, 1, 2, 2) and tree.height == 2 and tree.root == 0
