"""Closed-form costs against costs read off the schedules plait runs."""

from __future__ import annotations

import math

import pytest

from plait.comm.algorithms import ALGORITHMS, ROOTED, TOPOLOGY_ALGORITHMS, build_schedule
from plait.cost import CostTerms, LinkModel
from plait.cost.alpha_beta import (
    closed_form_algorithms,
    cost_terms,
    pipeline_segments,
    predict_time_s,
    schedule_terms,
    schedule_time_s,
    uniform_hierarchy_dims,
)

ITEMSIZE = 4


def _numel(p: int) -> int:
    """Divisible by p, by every power of two <= 64 (the butterflies' p') and by every
    segment count used (1, 3, 8) times 2 (the double tree's halves), so every chunk
    is exactly n/p and the closed forms must match to float rounding."""
    return math.lcm(p, 64, 3) * 2 * 5

# Each side is a sum of at most a few hundred float terms of similar size, so the
# relative difference is bounded by ~1e-13; 1e-12 leaves room.
REL = 1e-12


def _buffer_numel(collective: str, p: int) -> int:
    return _numel(p) * 2 if collective == "all_to_all" else _numel(p)  # all_to_all: [input | output]


def _close(a: CostTerms, b: CostTerms) -> bool:
    return all(math.isclose(x, y, rel_tol=REL, abs_tol=0) for x, y in
               ((a.rounds, b.rounds), (a.beta_bytes, b.beta_bytes), (a.gamma_bytes, b.gamma_bytes)))


# blink and synth are built from a topology: they have no closed form (the simulator
# prices them, tests/comm/test_blink.py and test_synth.py check it)
PAIRS = [(c, a) for a, builders in ALGORITHMS.items() if a != "hierarchical" and a not in TOPOLOGY_ALGORITHMS
         for c in builders]


def test_every_algorithm_has_a_closed_form():
    for algorithm, builders in ALGORITHMS.items():
        if algorithm in TOPOLOGY_ALGORITHMS:
            continue
        for collective in builders:
            assert algorithm in closed_form_algorithms(collective), (collective, algorithm)


@pytest.mark.parametrize("collective,algorithm", PAIRS)
def test_closed_form_equals_schedule_for_p_2_to_64(collective, algorithm):
    segment_choices = (1, 3, 8) if algorithm in ("binary_tree", "double_binary_tree") or (
        algorithm == "ring" and collective in ("broadcast", "reduce")) else (1,)
    for p in range(2, 65):
        root = (p // 3) if collective in ROOTED else None
        for segments in segment_choices:
            schedule = build_schedule(collective, algorithm, p, _buffer_numel(collective, p), root, segments)
            expected = schedule_terms(schedule, ITEMSIZE)
            got = cost_terms(collective, algorithm, _numel(p) * ITEMSIZE, p, segments=segments)
            assert _close(got, expected), (collective, algorithm, p, segments, got, expected)


@pytest.mark.parametrize("dims", [(2, 2), (2, 3), (3, 5), (4, 8), (8, 8), (2, 2, 2), (2, 3, 4), (1, 6), (5, 1)])
def test_hierarchical_closed_form_equals_schedule(dims):
    p = math.prod(dims)
    spec = "x".join(map(str, dims))
    schedule = build_schedule("all_reduce", "hierarchical", p, _numel(p), hierarchy=spec)
    expected = schedule_terms(schedule, ITEMSIZE)
    got = cost_terms("all_reduce", "hierarchical", _numel(p) * ITEMSIZE, p, hierarchy=spec)
    assert _close(got, expected), (dims, got, expected)
    # the nested-list form of the same hierarchy is recognised
    assert uniform_hierarchy_dims(spec) == dims


def test_uneven_sizes_differ_by_less_than_one_element_per_round():
    # chunk_sizes hands the remainder out one element at a time, so each step's
    # busiest message is at most one element above n/p (or n/S, n/p')
    link = LinkModel(1e-5, 1e-9, 1e-10)
    for collective, algorithm in PAIRS:
        for p in (3, 5, 7, 12):
            for numel in (1000 * p * 2 + 7, 4099 * 2 * p + 2 * p):
                numel = numel - numel % (2 * p) if collective == "all_to_all" else numel
                root = 1 if collective in ROOTED else None
                schedule = build_schedule(collective, algorithm, p, numel, root, 3)
                nbytes = (numel // 2 if collective == "all_to_all" else numel) * ITEMSIZE
                got = cost_terms(collective, algorithm, nbytes, p, segments=3)
                expected = schedule_terms(schedule, ITEMSIZE)
                assert got.rounds == expected.rounds
                # two elements per round: a step may move two near-equal chunks
                bound = 2 * ITEMSIZE * expected.rounds * max(p, 2)
                assert abs(got.beta_bytes - expected.beta_bytes) <= bound, (collective, algorithm, p)
                assert abs(got.gamma_bytes - expected.gamma_bytes) <= bound, (collective, algorithm, p)
                t_closed = predict_time_s(collective, algorithm, nbytes, p, link, segments=3)
                t_schedule = schedule_time_s(schedule, link, ITEMSIZE)
                assert math.isclose(t_closed, t_schedule, rel_tol=0.02), (collective, algorithm, p)


def test_textbook_forms():
    a, b, g = 2e-6, 1e-10, 3e-11
    link = LinkModel(a, b, g)
    n, p = 1 << 24, 8
    ring = predict_time_s("all_reduce", "ring", n, p, link)
    assert math.isclose(ring, 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g)
    rd = predict_time_s("all_reduce", "recursive_doubling", n, p, link)
    assert math.isclose(rd, 3 * (a + n * b + n * g))
    hd = predict_time_s("all_reduce", "halving_doubling", n, p, link)
    assert math.isclose(hd, 2 * 3 * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g)
    star = predict_time_s("all_reduce", "star", n, p, link)
    assert math.isclose(star, 2 * a + 2 * (p - 1) * n * b + (p - 1) * n * g)
    tree = predict_time_s("all_reduce", "tree", n, p, link)
    assert math.isclose(tree, 2 * 3 * (a + n * b) + 3 * n * g)


def test_two_level_hierarchical_uses_each_levels_link():
    inter = LinkModel(5e-6, 1 / 25e9)
    intra = LinkModel(1e-6, 1 / 300e9)
    k, g, n = 4, 8, 1 << 30
    got = predict_time_s("all_reduce", "hierarchical", n, k * g, [inter, intra], hierarchy=f"{k}x{g}")
    expected = (2 * (g - 1) * intra.alpha_s + 2 * (g - 1) / g * n * intra.beta_s_per_byte
                + 2 * (k - 1) * inter.alpha_s + 2 * (k - 1) / k * (n / g) * inter.beta_s_per_byte)
    assert math.isclose(got, expected, rel_tol=1e-12)
    flat = predict_time_s("all_reduce", "ring", n, k * g, [inter, intra])
    assert flat == predict_time_s("all_reduce", "ring", n, k * g, inter)
    assert flat / got > 5  # the slow links carry n/g instead of n


def test_pipeline_segments_rule():
    assert pipeline_segments(1000) == 1
    assert pipeline_segments(10 * (256 << 10)) == 10
    assert pipeline_segments(1 << 40) == 64


@pytest.mark.parametrize("kwargs,message", [
    (dict(collective="all_reduce", algorithm="bogus"), "no cost model for algorithm 'bogus'"),
    (dict(collective="all_to_all", algorithm="ring"), "does not implement 'all_to_all'"),
    (dict(nbytes=-1), "nbytes=-1"),
    (dict(nbytes=float("inf")), "nbytes=inf"),
    (dict(nbytes=1e30), "above 2^53"),
    (dict(world_size=0), "world_size=0"),
    (dict(segments=0), "segments=0"),
    (dict(algorithm="hierarchical", hierarchy="3+5", world_size=8), "no closed form"),
])
def test_bad_input(kwargs, message):
    args = dict(collective="all_reduce", algorithm="ring", nbytes=1000, world_size=4,
                link=LinkModel(1e-6, 1e-9), segments=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("^", r"\^")):
        predict_time_s(args.pop("collective"), args.pop("algorithm"), args.pop("nbytes"),
                       args.pop("world_size"), args.pop("link"), **args)


@pytest.mark.parametrize("kwargs,message", [
    (dict(alpha_s=-1.0), "alpha_s=-1.0 must be >= 0"),
    (dict(beta_s_per_byte=0.0), "beta_s_per_byte=0.0 must be > 0"),
    (dict(gamma_s_per_byte=float("nan")), "gamma_s_per_byte=nan is not finite"),
])
def test_link_model_rejects_bad_values(kwargs, message):
    args = dict(alpha_s=1e-6, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        LinkModel(**args)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s=0"):
        LinkModel.from_bandwidth(1e-6, 0)


def test_one_rank_and_empty_buffers_cost_nothing():
    link = LinkModel(1e-6, 1e-9, 1e-10)
    assert predict_time_s("all_reduce", "ring", 1 << 20, 1, link) == 0.0
    assert predict_time_s("all_reduce", "ring", 0, 8, link) == 0.0


def test_shared_host_model_prices_total_work_over_the_ranks_sharing():
    from plait.cost.alpha_beta import shared_host_terms

    link = LinkModel(1e-3, 1e-9, 3e-10)
    p, numel = 4, 4000
    # ring: every step has p equal messages, so it equals the one-port model
    ring = build_schedule("all_reduce", "ring", p, numel)
    assert shared_host_terms(ring, ITEMSIZE, p).time_s(link) == pytest.approx(
        schedule_time_s(ring, link, ITEMSIZE), rel=1e-12)
    # star: 2(p-1) messages of n, (p-1) n reduced, all divided by the p ranks sharing
    star = build_schedule("all_reduce", "star", p, numel)
    n = numel * ITEMSIZE
    expected = (2 * (p - 1) * link.alpha_s + 2 * (p - 1) * n * link.beta_s_per_byte
                + (p - 1) * n * link.gamma_s_per_byte) / p
    assert shared_host_terms(star, ITEMSIZE, p).time_s(link) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="ranks_sharing=0"):
        shared_host_terms(star, ITEMSIZE, 0)


def _walk_every_rank(p: int, trees, segments: int) -> CostTerms:
    """The pipelined trees' terms walking all p ranks (the count before it walked one
    rank per role): trees are (positions of ranks 0..p-1, bytes)."""
    from plait.cost.alpha_beta import _binary_tree_activity

    per_step: dict = {}
    for positions, nbytes in trees:
        segment = nbytes / segments
        for rank, position in enumerate(positions):
            for step, (sent, received, reduced) in _binary_tree_activity(p, position, segments).items():
                entry = per_step.setdefault(step, {}).setdefault(rank, [0.0, 0.0, 0.0])
                entry[0] += sent * segment
                entry[1] += received * segment
                entry[2] += reduced * segment
    rounds = beta_bytes = gamma_bytes = 0.0
    for ranks in per_step.values():
        rounds += 1
        beta_bytes += max(max(sent, received) for sent, received, _ in ranks.values())
        gamma_bytes += max(reduced for _, _, reduced in ranks.values())
    return CostTerms(rounds, beta_bytes, gamma_bytes)


def test_tree_terms_walk_one_rank_per_role_and_equal_the_walk_over_every_rank():
    """The binary trees' terms walk the first rank of each run of ranks with the same
    role in every tree: bit for bit what walking all p ranks gives, from O(lg p) ranks."""
    from plait.cost.alpha_beta import _representative_ranks

    for p in list(range(1, 40)) + [63, 64, 65, 127, 128, 129, 383, 384, 385]:
        for segments in (1, 3, 8, 64) if p < 130 else (1, 3, 8):
            for nbytes in (12345.0, 2.0 ** 40 + 6):
                half = math.floor(nbytes / 2)
                single = _walk_every_rank(p, [(list(range(p)), nbytes)], segments)
                double = _walk_every_rank(p, [(list(range(p)), half), (list(range(p))[::-1], nbytes - half)],
                                          segments)
                assert cost_terms("all_reduce", "binary_tree", nbytes, p, segments=segments) == single
                assert cost_terms("all_reduce", "double_binary_tree", nbytes, p, segments=segments) == double
        walked = _representative_ranks(p, [(False, 1.0), (True, 1.0)])
        assert len(walked) <= 4 * max(1, p.bit_length()) + 4, (p, len(walked))


def test_tree_terms_for_a_million_ranks_take_little_memory():
    """Pricing the double binary tree over 2^20 ranks (a data-parallel group of the
    largest plans) holds O(lg p · S) entries: walking every rank held ~p · S of them,
    gigabytes at this size (a 4,096-rank walk already needs ~100 MB)."""
    import tracemalloc

    tracemalloc.start()
    try:
        small = cost_terms("all_reduce", "double_binary_tree", 2.0 ** 30, 4096, segments=64)
        large = cost_terms("all_reduce", "double_binary_tree", 2.0 ** 30, 1 << 20, segments=64)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 4 << 20, peak_bytes
    # 2 floor(lg p) + S - 1 rounds per tree; the reversed tree's steps line up with the first's
    assert small.rounds == 2 * 12 + 64 - 1 and large.rounds == 2 * 20 + 64 - 1
