"""Resharding costs against the collectives' closed forms worked by hand (DESIGN.md 6).

Links with alpha = 0 and gamma = 0 leave only the bandwidth term, which every
bandwidth-optimal algorithm shares: all_gather, reduce_scatter and all_to_all move
(p-1)/p n bytes through the busiest port, all_reduce 2(p-1)/p n, with n as Cluster
means it (all_gather: the gathered output; reduce_scatter, all_to_all: the input).
Sums of a few float64 terms: compared at 1e-12 relative.
"""

from __future__ import annotations

import math

import pytest

from plait.cost import LinkModel
from plait.plan import device_preset
from plait.plan.auto.reshard_cost import ReshardStep, layout_graph, reshard_path, reshard_steps, reshard_time_s
from plait.plan.cluster import Cluster
from plait.parallel.auto.device_mesh import AutoMesh

BETA_INTRA = 1e-9   # s per byte within a node
BETA_INTER = 8e-9   # s per byte between nodes
ALPHA = 1e-5
F64 = 8


def _cluster(nodes: int, per_node: int, alpha_s: float = 0.0) -> Cluster:
    return Cluster(name="test", nodes=nodes, devices_per_node=per_node, device=device_preset("a100-80gb"),
                   intra_link=LinkModel(alpha_s, BETA_INTRA), inter_link=LinkModel(alpha_s, BETA_INTER))


def _close(actual: float, expected: float) -> None:
    assert actual == pytest.approx(expected, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("p", [3, 4])
def test_one_axis_reshards_cost_their_closed_forms(p):
    cluster, mesh = _cluster(1, p), AutoMesh((p,))
    shape = (6 * p, 5)  # n = 6p * 5 * 8 bytes, split on dim 0 only
    n = math.prod(shape) * F64
    share = (p - 1) / p

    def cost(src, dst):
        return reshard_time_s((src,), (dst,), shape, F64, mesh, cluster)

    _close(cost("S0", "R"), share * n * BETA_INTRA)             # all_gather fwd, slice bwd
    _close(cost("R", "S0"), share * n * BETA_INTRA)             # slice fwd, all_gather bwd
    _close(cost("P", "R"), 2 * share * n * BETA_INTRA)          # all_reduce fwd, nothing bwd
    _close(cost("P", "S0"), 2 * share * n * BETA_INTRA)         # reduce_scatter fwd + all_gather bwd
    assert cost("P", "S1") == math.inf                           # 5 columns do not split over 3 or 4
    assert cost("S0", "S0") == cost("R", "R") == cost("P", "P") == 0.0


def test_all_to_all_is_taken_when_bandwidth_dominates():
    """S0 -> S1 on 4 ranks: all_to_all of the local n/4 both ways, (3/4)(n/4) b each;
    gathering then slicing would cost 2 (3/4) n b."""
    cluster, mesh, shape = _cluster(1, 4), AutoMesh((4,)), (8, 16)
    n = 8 * 16 * F64
    _close(reshard_time_s(("S0",), ("S1",), shape, F64, mesh, cluster), 2 * 0.75 * (n / 4) * BETA_INTRA)
    assert reshard_steps(("S0",), ("S1",), shape, F64, mesh, cluster) == [
        ReshardStep("all_to_all", 0, n // 4, "forward"), ReshardStep("all_to_all", 0, n // 4, "backward")]


def test_latency_bound_reshards_count_rounds():
    """With alpha = 10 us and 1 KiB tensors: all_gather by recursive doubling, lg 4 = 2
    rounds; all_to_all pairwise 3 rounds, so S0 -> S1 gathers and slices (2 x 2 rounds)
    instead of two all_to_alls (2 x 3 rounds)."""
    cluster, mesh = _cluster(1, 4, alpha_s=ALPHA), AutoMesh((4,))
    shape, n = (8, 16), 8 * 16 * F64
    gather = 2 * ALPHA + 0.75 * n * BETA_INTRA
    _close(reshard_time_s(("S0",), ("R",), shape, F64, mesh, cluster), gather)
    _close(reshard_time_s(("S0",), ("S1",), shape, F64, mesh, cluster), 2 * gather)
    assert [step.collective for step in reshard_steps(("S0",), ("S1",), shape, F64, mesh, cluster)] == [
        "all_gather", "slice", "all_gather", "slice"]


def test_impossible_reshards_are_infinite_and_refused_by_name():
    cluster, mesh = _cluster(1, 4), AutoMesh((4,))
    for src in ("R", "S0"):
        assert reshard_time_s((src,), ("P",), (8, 8), F64, mesh, cluster) == math.inf
    assert reshard_time_s(("R",), ("S0",), (6, 8), F64, mesh, cluster) == math.inf  # 6 rows over 4 ranks
    with pytest.raises(ValueError, match=r"from \('R',\) to \('P',\).*never created"):
        reshard_steps(("R",), ("P",), (8, 8), F64, mesh, cluster)
    with pytest.raises(ValueError, match="placement 'S2' shards dim 2 of a 2-d tensor"):
        reshard_time_s(("S2",), ("R",), (8, 8), F64, mesh, cluster)
    with pytest.raises(ValueError, match="1 placements for the 2x2 mesh"):
        reshard_time_s(("R",), ("R",), (8, 8), F64, AutoMesh((2, 2)), cluster)


def test_axes_of_one_rank_cost_nothing():
    cluster, mesh = _cluster(1, 4), AutoMesh((1, 4))
    assert reshard_time_s(("R", "S0"), ("P", "S0"), (8, 8), F64, mesh, cluster) == 0.0


# 2 nodes x 2 devices, mesh (2, 2): axis 0 (ranks 2 apart) crosses nodes, axis 1 does not
def _two_by_two():
    return _cluster(2, 2), AutoMesh((2, 2))


def test_two_axes_gather_the_slow_axis_while_the_tensor_is_small():
    """(S0, S1) -> (R, R), n bytes: either order is exact; gathering axis 0 (slow) first
    moves (1/2)(n/2) b_inter, then axis 1 (1/2) n b_intra."""
    cluster, mesh = _two_by_two()
    shape, n = (8, 8), 64 * F64
    _close(reshard_time_s(("S0", "S1"), ("R", "R"), shape, F64, mesh, cluster),
           n / 4 * BETA_INTER + n / 2 * BETA_INTRA)
    assert reshard_path(("S0", "S1"), ("R", "R"), shape, F64, mesh, cluster) == [
        ("S0", "S1"), ("R", "S1"), ("R", "R")]


def test_nested_shards_never_gather_the_outer_axis_first():
    """(S0, S0) -> (R, R): dim 0 is split axis 0 outer, axis 1 inner, so axis 0 may not
    gather while axis 1 still splits dim 0 (that order would cost n/4 b_inter + n/2
    b_intra). The cheapest exact path moves the inner split to dim 1 by an all_to_all
    on the fast axis (both ways: 2 (1/2)(n/4) b_intra), gathers the slow axis while the
    tensor is small ((1/2)(n/2) b_inter), then axis 1 ((1/2) n b_intra): 3n/4 b_intra +
    n/4 b_inter, below gathering the inner axis first (n/4 b_intra + n/2 b_inter)."""
    cluster, mesh = _two_by_two()
    shape, n = (8, 8), 64 * F64
    _close(reshard_time_s(("S0", "S0"), ("R", "R"), shape, F64, mesh, cluster),
           3 * n / 4 * BETA_INTRA + n / 4 * BETA_INTER)
    assert reshard_path(("S0", "S0"), ("R", "R"), shape, F64, mesh, cluster) == [
        ("S0", "S0"), ("S0", "S1"), ("R", "S1"), ("R", "R")]
    assert reshard_steps(("S0", "S0"), ("R", "R"), shape, F64, mesh, cluster) == [
        ReshardStep("all_to_all", 1, n // 4, "forward"), ReshardStep("all_gather", 0, n // 2, "forward"),
        ReshardStep("all_gather", 1, n, "forward"), ReshardStep("slice", 1, n // 2, "backward"),
        ReshardStep("slice", 0, n // 4, "backward"), ReshardStep("all_to_all", 1, n // 4, "backward")]


def test_a_partial_sum_is_reduced_after_slicing_the_other_axis():
    """(P, R) -> (R, S0): slice axis 1 (its backward all_gathers n over axis 1:
    (1/2) n b_intra), then all_reduce n/2 over axis 0: 2 (1/2)(n/2) b_inter."""
    cluster, mesh = _two_by_two()
    shape, n = (8, 8), 64 * F64
    _close(reshard_time_s(("P", "R"), ("R", "S0"), shape, F64, mesh, cluster),
           n / 2 * BETA_INTRA + n / 2 * BETA_INTER)
    assert reshard_steps(("P", "R"), ("R", "S0"), shape, F64, mesh, cluster) == [
        ReshardStep("slice", 1, n // 2, "forward"), ReshardStep("all_reduce", 0, n // 2, "forward"),
        ReshardStep("all_gather", 1, n, "backward")]
    assert reshard_time_s(("P", "R"), ("P", "S1"), shape, F64, mesh, cluster) == pytest.approx(
        n / 2 * BETA_INTRA, rel=1e-12)  # P stays: slice axis 1, all_gather n in backward
    assert reshard_time_s(("P", "R"), ("R", "P"), shape, F64, mesh, cluster) == math.inf


def test_the_layout_graph_s_shortest_paths_are_the_reshard_costs():
    """The ILP may route a reshard as a flow over layout_graph's steps: its shortest
    paths (Floyd-Warshall here) must be reshard_time_s for every pair of layouts of a
    (4, 6, 8) tensor on a 2x2 mesh over two nodes (the same step costs summed in
    another order: 1e-12)."""
    cluster, mesh = _two_by_two()
    shape = (4, 6, 8)
    layouts, arcs = layout_graph(shape, F64, mesh, cluster)
    assert len(layouts) == 24 and ("P", "S2") in layouts and ("S1", "S1") not in layouts  # 6 rows over 4 ranks
    distance = {(a, b): 0.0 if a == b else math.inf for a in range(len(layouts)) for b in range(len(layouts))}
    for start, end, seconds in arcs:
        distance[start, end] = min(distance[start, end], seconds)
    for middle in range(len(layouts)):
        for start in range(len(layouts)):
            for end in range(len(layouts)):
                distance[start, end] = min(distance[start, end], distance[start, middle] + distance[middle, end])
    for (start, end), seconds in distance.items():
        expected = reshard_time_s(layouts[start], layouts[end], shape, F64, mesh, cluster)
        assert seconds == expected or seconds == pytest.approx(expected, rel=1e-12), (layouts[start], layouts[end])
