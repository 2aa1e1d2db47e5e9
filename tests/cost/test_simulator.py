"""The flow-level simulator: agreement with the alpha-beta model on a uniform topology,
hand-computed contention cases, a two-level cluster where hierarchical all-reduce
beats the flat ring by the closed-form factor, and invariants at scale.

Tolerance. Where the simulator must equal a formula, the two differ only by float
rounding (the simulator divides bytes by a fair-share rate, the model multiplies by
beta; latencies are summed in another order): ~1e-15 relative per step, so 1e-9
relative is a wide margin, while any modelling difference (one alpha, or one element
out of the >= 10^4 bytes these tests move) would be > 1e-6.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from plait.comm.algorithms import COLLECTIVES, ROOTED, algorithms_for, build_schedule
from plait.comm.schedule import Step, Transfer
from plait.cost.alpha_beta import pipeline_segments, predict_time_s, schedule_time_s
from plait.cost.flows import max_min_rates
from plait.cost.link import LinkModel
from plait.cost.presets import preset
from plait.cost.simulator import simulate
from plait.cost.topology import Link, Node, Topology

REL = 1e-9


def uniform(p: int, link: LinkModel) -> Topology:
    """Every device has one full-duplex port of bandwidth 1/beta into a non-blocking
    switch; alpha/2 latency each way, so a path costs alpha; reductions at 1/gamma."""
    reduce = None if link.gamma_s_per_byte == 0 else 1 / link.gamma_s_per_byte
    nodes = [Node(name="switch", kind="switch")]
    nodes += [Node(name=f"d{r}", kind="device", host=f"h{r}", reduce_bytes_per_s=reduce) for r in range(p)]
    links = [Link(endpoints=(f"d{r}", "switch"), bandwidth_bytes_per_s=1 / link.beta_s_per_byte,
                  latency_s=link.alpha_s / 2) for r in range(p)]
    return Topology(nodes=nodes, links=links, name=f"uniform{p}")


def hand_step_cost(schedule, link: LinkModel, itemsize: int) -> float:
    """Per step: alpha + beta max(bytes a port sends or receives) + gamma max(bytes a rank reduces)."""
    total = 0.0
    for step in schedule.steps:
        sent, received, reduced = {}, {}, {}
        for t in step.transfers:
            sent[t.src] = sent.get(t.src, 0) + t.numel * itemsize
            received[t.dst] = received.get(t.dst, 0) + t.numel * itemsize
            if t.reduce:
                reduced[t.dst] = reduced.get(t.dst, 0) + t.numel * itemsize
        port = max(max(sent.values()), max(received.values()))
        total += link.alpha_s + link.beta_s_per_byte * port + link.gamma_s_per_byte * max(reduced.values(), default=0)
    return total


LINK = LinkModel(10e-6, 1 / 1e9, 1 / 10e9)
CASES = [(c, a) for c in COLLECTIVES for a in algorithms_for(c)]


@pytest.mark.parametrize("p", [2, 3, 5, 6, 8])
@pytest.mark.parametrize("collective, algorithm", CASES)
def test_uniform_topology_equals_alpha_beta(collective, algorithm, p):
    numel = 1680 * 80  # divisible by every p <= 8 and by the 2 pipeline segments of 537,600 bytes
    itemsize = 4
    segments = pipeline_segments(numel * itemsize)
    schedule = build_schedule(collective, algorithm, p, numel, 0 if collective in ROOTED else None, segments)
    simulated = simulate(schedule, uniform(p, LINK), itemsize).total_time_s
    assert simulated == pytest.approx(hand_step_cost(schedule, LINK, itemsize), rel=REL)
    assert simulated == pytest.approx(schedule_time_s(schedule, LINK, itemsize), rel=REL)
    nbytes = numel * itemsize // (2 if collective == "all_to_all" else 1)  # all_to_all: the input half
    assert simulated == pytest.approx(
        predict_time_s(collective, algorithm, nbytes, p, LINK, segments=segments), rel=REL)


def test_closed_forms_of_the_design_document():
    p, n = 6, 6 * 1000 * 4
    alpha, beta, gamma = LINK.alpha_s, LINK.beta_s_per_byte, LINK.gamma_s_per_byte
    ring = simulate(build_schedule("all_reduce", "ring", p, n // 4), uniform(p, LINK), 4).total_time_s
    assert ring == pytest.approx(2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma, rel=REL)
    p = 8
    hd = simulate(build_schedule("all_reduce", "halving_doubling", p, n // 4), uniform(p, LINK), 4).total_time_s
    assert hd == pytest.approx(2 * 3 * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma, rel=REL)


# ----- contention, by hand ----------------------------------------------------------------------
def one_step(p: int, *transfers) -> SimpleNamespace:
    """A one-step schedule of (src, dst, numel[, reduce]) with itemsize 1 (numel = bytes)."""
    return SimpleNamespace(world_size=p, steps=[Step(tuple(
        Transfer(t[0], t[1], 0, 0, int(t[2]), *t[3:]) for t in transfers))])


def test_two_flows_through_one_link_take_twice_as_long():
    link = LinkModel(1e-6, 1 / 1e9)
    topo = uniform(3, link)
    n = 10**6
    alone = simulate(one_step(3, (0, 2, n)), topo, 1).total_time_s
    shared = simulate(one_step(3, (0, 2, n), (1, 2, n)), topo, 1).total_time_s
    assert alone == pytest.approx(1e-6 + n / 1e9, rel=REL)
    assert shared == pytest.approx(1e-6 + 2 * n / 1e9, rel=REL)


def test_reductions_wait_for_the_last_reducing_flow():
    link = LinkModel(1e-6, 1 / 1e9, 1 / 4e9)
    n = 10**6
    result = simulate(one_step(3, (0, 2, n, True), (1, 2, n, True)), uniform(3, link), 1)
    assert result.total_time_s == pytest.approx(1e-6 + 2 * n / 1e9 + 2 * n / 4e9, rel=REL)
    step = result.critical_path[0]
    assert step.dst_rank == 2 and step.reduce_s == pytest.approx(2 * n / 4e9, rel=REL)


def dumbbell() -> Topology:
    """a, b -> s ==X(1 GB/s)== t ==Y(2 GB/s)== c; t also reaches d and e. Zero latency."""
    names = ["a", "b", "c", "d", "e"]
    nodes = [Node(name=n, kind="device", host=n) for n in names]
    nodes += [Node(name="s", kind="switch"), Node(name="t", kind="switch")]
    fast = 100e9
    links = [Link(endpoints=e, bandwidth_bytes_per_s=bw, latency_s=0.0) for e, bw in [
        (("a", "s"), fast), (("b", "s"), fast), (("s", "t"), 1e9), (("t", "c"), 2e9),
        (("t", "d"), fast), (("e", "t"), fast)]]
    return Topology(nodes=nodes, links=links, name="dumbbell")


def test_max_min_fairness_gives_unequal_rates():
    # f1 a->c crosses X and Y, f2 b->d crosses X, f3 e->c crosses Y: X is the tightest
    # (1 GB/s over 2 flows = 0.5 each); Y then has 2 - 0.5 = 1.5 GB/s left for f3.
    topo = dumbbell()
    paths = [topo.route(0, 2), topo.route(1, 3), topo.route(4, 2)]
    entries = np.array([link for path in paths for link in path])
    entry_flow = np.repeat(np.arange(3), [len(p) for p in paths])
    rates, frozen_by = max_min_rates(entry_flow, entries, np.ones(3, dtype=bool),
                                     np.asarray(topo.capacity_bytes_per_s))
    assert rates.tolist() == pytest.approx([0.5e9, 0.5e9, 1.5e9], rel=REL)
    assert [topo.link_name(int(l)) for l in frozen_by] == ["s -> t", "s -> t", "t -> c"]
    n = 1.5e9
    result = simulate(one_step(5, (0, 2, n), (1, 3, n), (4, 2, n)), topo, 1)
    assert result.total_time_s == pytest.approx(n / 0.5e9, rel=REL)  # f3 finishing frees nothing for f1


def test_a_flow_speeds_up_when_its_bottleneck_clears():
    # f2 (0.5 GB) leaves X at t=1 s with f1 at 0.5 of its 1.5 GB done; f3 also ends at 1 s.
    # f1 then has X alone: 1 GB at 1 GB/s, done at 2 s (3 s if rates were frozen).
    result = simulate(one_step(5, (0, 2, 1.5e9), (1, 3, 0.5e9), (4, 2, 1.5e9)), dumbbell(), 1)
    assert result.total_time_s == pytest.approx(2.0, rel=REL)
    critical = result.critical_path[0]
    assert (critical.src_rank, critical.dst_rank) == (0, 2)
    assert result.topology.link_name(critical.bottleneck_link) == "s -> t"
    assert result.link_bytes[result.critical_path[0].bottleneck_link] == pytest.approx(2e9)


def test_unequal_flows_on_one_port_keep_it_busy():
    # rank 0 sends 1 GB and 3 GB at once: 0.5 GB/s each until 2 s, then 2 GB alone: 4 s
    result = simulate(one_step(3, (0, 1, 1e9), (0, 2, 3e9)), uniform(3, LinkModel(0.0, 1e-9)), 1)
    assert result.total_time_s == pytest.approx(4.0, rel=REL)
    assert result.busiest_links(1)[0].name == "d0 -> switch"
    assert result.busiest_links(1)[0].utilisation == pytest.approx(1.0, rel=REL)


# ----- two levels ---------------------------------------------------------------------------------
def two_level(nodes: int = 4, per_node: int = 4) -> Topology:
    """Fast intra-node switch (100 GB/s, 1 us device to device); one 10 GB/s NIC per
    device into a non-blocking fabric (5 us device to device); reductions at 50 GB/s."""
    node_list = [Node(name="fabric", kind="switch")]
    links = []
    for h in range(nodes):
        node_list.append(Node(name=f"n{h}.sw", kind="switch", host=f"n{h}"))
        for d in range(per_node):
            dev, nic = f"n{h}.d{d}", f"n{h}.nic{d}"
            node_list += [Node(name=dev, kind="device", host=f"n{h}", reduce_bytes_per_s=50e9),
                          Node(name=nic, kind="nic", host=f"n{h}")]
            links += [Link(endpoints=(dev, f"n{h}.sw"), bandwidth_bytes_per_s=100e9, latency_s=0.5e-6),
                      Link(endpoints=(dev, nic), bandwidth_bytes_per_s=10e9, latency_s=1e-6),
                      Link(endpoints=(nic, "fabric"), bandwidth_bytes_per_s=10e9, latency_s=1.5e-6)]
    return Topology(nodes=node_list, links=links, name="two-level")


def test_hierarchical_beats_ring_by_the_closed_form_factor():
    topo = two_level()
    p, g, k = 16, 4, 4
    n = 64 << 20  # divisible by p: every chunk the same size, so the closed forms are exact
    a_in, b_in, a_out, b_out, gamma = 1e-6, 1 / 100e9, 5e-6, 1 / 10e9, 1 / 50e9
    # by hand: the flat ring waits for its slowest (inter-node) hop in every step; BlueConnect
    # moves n/g within nodes and only n/(g k) per step across them
    ring_hand = 2 * (p - 1) * (a_out + n / p * b_out) + (p - 1) * n / p * gamma
    hier_hand = (2 * (g - 1) * (a_in + n / g * b_in) + (g - 1) * n / g * gamma
                 + 2 * (k - 1) * (a_out + n / (g * k) * b_out) + (k - 1) * n / (g * k) * gamma)
    hierarchy = topo.hierarchy()
    assert hierarchy == tuple(tuple(range(4 * h, 4 * h + 4)) for h in range(4))
    ring = simulate(build_schedule("all_reduce", "ring", p, n // 4), topo, 4).total_time_s
    hier = simulate(build_schedule("all_reduce", "hierarchical", p, n // 4, hierarchy=hierarchy), topo, 4).total_time_s
    assert ring == pytest.approx(ring_hand, rel=REL)
    assert hier == pytest.approx(hier_hand, rel=REL)
    assert hier < ring / 2
    inter, intra = topo.level_link_models()
    assert (inter.alpha_s, intra.alpha_s) == pytest.approx((a_out, a_in), rel=REL)
    predicted = (predict_time_s("all_reduce", "ring", n, p, inter)
                 / predict_time_s("all_reduce", "hierarchical", n, p, [inter, intra], hierarchy=hierarchy))
    assert ring / hier == pytest.approx(predicted, rel=REL)
    assert ring / hier == pytest.approx(ring_hand / hier_hand, rel=REL)


def test_oversubscribed_uplinks_slow_the_ring_down():
    n, p = 8 << 20, 8
    common = dict(nodes=4, devices_per_node=2, nodes_per_leaf=2, spines=1)
    full = preset("fat-tree", **common)
    thin = preset("fat-tree", **common, uplink_bandwidth_bytes_per_s=12.5e9)
    schedule = build_schedule("all_reduce", "ring", p, n // 4)
    full_s, thin_s = (simulate(schedule, t, 4).total_time_s for t in (full, thin))
    alpha = thin.link_model(3, 4).alpha_s  # the ring's leaf-crossing hop
    assert thin_s == pytest.approx(2 * (p - 1) * (alpha + n / p / 12.5e9), rel=REL)
    assert full_s == pytest.approx(2 * (p - 1) * (alpha + n / p / 25e9), rel=REL)


# ----- whole runs --------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "hierarchical", "direct", "double_binary_tree"])
def test_invariants_on_a_dgx_cluster(algorithm):
    topo = preset("dgx-a100", nodes=3, allocation="8+5+8")
    p = topo.world_size
    schedule = build_schedule("all_reduce", algorithm, p, 21 * 4096 + 5,
                              hierarchy=topo.hierarchy() if algorithm == "hierarchical" else None)
    result = simulate(schedule, topo, 2)
    assert len(result.step_times_s) == len(result.critical_path) == len(schedule.steps)
    assert result.total_time_s == pytest.approx(float(np.sum(result.step_times_s)), rel=REL)
    assert result.utilisation.max() <= 1 + 1e-9  # no link moves more than capacity x time
    # every byte is counted once on each link of its route
    on_links = sum(t.numel * 2 * len(topo.route(t.src, t.dst)) for s in schedule.steps for t in s.transfers)
    assert float(result.link_bytes.sum()) == pytest.approx(on_links, rel=REL)
    summary = result.as_dict()
    assert summary["steps"] == len(schedule.steps) and summary["busiest_links"][0]["utilisation"] > 0
    assert "steps" in result.critical_summary()


def test_hierarchical_wins_on_dgx():
    topo = preset("dgx-a100", nodes=4)
    numel = (256 << 20) // 4
    times = {a: simulate(build_schedule("all_reduce", a, 32, numel,
                                        hierarchy=topo.hierarchy() if a == "hierarchical" else None),
                         topo, 4).total_time_s for a in ("ring", "halving_doubling", "hierarchical")}
    assert times["hierarchical"] < times["halving_doubling"] < times["ring"]


def test_duck_typed_lazy_schedule_gives_the_same_result():
    topo = uniform(4, LINK)
    schedule = build_schedule("all_reduce", "ring", 4, 1000)
    lazy = SimpleNamespace(world_size=4, steps=(step for step in schedule.steps))
    assert simulate(lazy, topo, 4).total_time_s == simulate(schedule, topo, 4).total_time_s


def test_simulator_errors():
    topo = uniform(4, LINK)
    with pytest.raises(ValueError, match="schedule is for 8 ranks but topology 'uniform4' allocates 4"):
        simulate(build_schedule("all_reduce", "ring", 8, 64), topo, 4)
    with pytest.raises(ValueError, match="itemsize=0 must be a whole number of bytes"):
        simulate(build_schedule("all_reduce", "ring", 4, 64), topo, 0)
    with pytest.raises(ValueError, match="more than the simulator's"):
        simulate(SimpleNamespace(world_size=4, buffer_numel=1 << 60, steps=()), topo, 4)
    huge = SimpleNamespace(world_size=4, steps=[SimpleNamespace(transfers=[Transfer(0, 1, 0, 0, 1 << 70)])])
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        simulate(huge, topo, 4)
