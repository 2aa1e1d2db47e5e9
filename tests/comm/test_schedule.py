"""Schedule data types, chunking, validation, the printed table, and that each
schedule's own count of rounds and bytes equals the closed form in its docstring."""

import math

import pytest

from plait.comm.algorithms import build_schedule, describe
from plait.comm.schedule import Schedule, ScheduleError, Step, Transfer, chunk_bounds, chunk_sizes, make_schedule


def lg(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def test_uneven_chunks():
    assert chunk_sizes(10, 3) == [4, 3, 3]
    assert chunk_sizes(2, 5) == [1, 1, 0, 0, 0]
    assert chunk_sizes(0, 4) == [0, 0, 0, 0]
    assert chunk_bounds(5, 7, 3) == [(5, 3), (8, 2), (10, 2)]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        chunk_sizes(3, 0)


def test_validation_names_the_problem():
    with pytest.raises(ScheduleError, match="outside the buffer"):
        make_schedule("all_reduce", "bad", 2, 4, [Step((Transfer(0, 1, 2, 2, 3),))])
    with pytest.raises(ScheduleError, match="sends to itself"):
        make_schedule("all_reduce", "bad", 2, 4, [Step((Transfer(1, 1, 0, 0, 1),))])
    with pytest.raises(ScheduleError, match="rank outside"):
        make_schedule("all_reduce", "bad", 2, 4, [Step((Transfer(0, 2, 0, 0, 1),))])
    with pytest.raises(ScheduleError, match="overlapping copies"):
        make_schedule("all_reduce", "bad", 3, 4, [Step((Transfer(0, 2, 0, 0, 2), Transfer(1, 2, 1, 1, 2)))])
    with pytest.raises(ScheduleError, match="overlapping"):
        make_schedule("all_reduce", "bad", 3, 4, [Step((Transfer(0, 2, 0, 0, 2, True), Transfer(1, 2, 1, 1, 2, True)))])
    # identical reducing ranges are fine (direct, star)
    make_schedule("all_reduce", "ok", 3, 4, [Step((Transfer(0, 2, 0, 0, 2, True), Transfer(1, 2, 0, 0, 2, True)))])


def test_table_shows_every_rank_and_step():
    text = build_schedule("all_reduce", "ring", 3, 7).table()
    lines = text.splitlines()
    assert lines[0] == "ring all_reduce: p=3, n=7, steps=4"
    assert lines[1].split() == ["step", "rank", "0", "rank", "1", "rank", "2"]
    assert len(lines) == 2 + 4
    assert "->1+[5:7]" in lines[2]  # rank 0 sends its last chunk to rank 1, which adds it


def test_empty_and_single_rank_schedules():
    assert build_schedule("all_reduce", "ring", 1, 100).num_steps == 0
    assert build_schedule("all_reduce", "ring", 4, 0).num_steps == 0


def test_describe_gives_cost():
    assert "2(p-1)" in describe("all_reduce", "ring")


# (collective, algorithm, p, n) -> (rounds, bytes sent by the busiest rank) in elements
def closed_form(collective, algorithm, p, n, segments=1):
    if collective == "all_reduce":
        return {
            "ring": (2 * (p - 1), 2 * (p - 1) * n // p),
            "recursive_doubling": (lg(p), lg(p) * n),
            "halving_doubling": (2 * lg(p), 2 * (p - 1) * n // p),
            "tree": (2 * lg(p), None),
            "direct": (1, (p - 1) * n),
            "star": (2, (p - 1) * n),
        }.get(algorithm)
    if collective == "all_gather":
        return {"ring": (p - 1, (p - 1) * n // p), "bruck": (lg(p), (p - 1) * n // p),
                "recursive_doubling": (lg(p), (p - 1) * n // p), "direct": (1, (p - 1) * n // p)}.get(algorithm)
    if collective == "reduce_scatter":
        return {"ring": (p - 1, (p - 1) * n // p), "halving_doubling": (lg(p), (p - 1) * n // p),
                "direct": (1, (p - 1) * n // p)}.get(algorithm)
    if collective == "broadcast":
        return {"tree": (lg(p), lg(p) * n), "ring": (p + segments - 2, n), "direct": (1, (p - 1) * n)}.get(algorithm)
    return None


CASES = [
    (c, a, p)
    for c, algs in [
        ("all_reduce", ["ring", "recursive_doubling", "halving_doubling", "tree", "direct", "star"]),
        ("all_gather", ["ring", "bruck", "recursive_doubling", "direct"]),
        ("reduce_scatter", ["ring", "halving_doubling", "direct"]),
        ("broadcast", ["tree", "ring", "direct"]),
    ]
    for a in algs
    for p in (2, 4, 8, 16, 32, 64)
]


@pytest.mark.parametrize("collective,algorithm,p", CASES)
def test_counts_match_closed_form_power_of_two(collective, algorithm, p):
    n = p * 64  # divisible, so every chunk is equal
    schedule = build_schedule(collective, algorithm, p, n, 0 if collective == "broadcast" else None)
    rounds, busiest = closed_form(collective, algorithm, p, n)
    assert schedule.num_steps == rounds
    if busiest is not None:
        assert schedule.max_sent_numel() == busiest


@pytest.mark.parametrize("p", [3, 5, 6, 7, 9, 12, 33])
def test_counts_non_power_of_two(p):
    n = p * 64
    # ring and bruck are exact for any p
    ring = build_schedule("all_reduce", "ring", p, n)
    assert (ring.num_steps, ring.max_sent_numel()) == (2 * (p - 1), 2 * (p - 1) * n // p)
    bruck = build_schedule("all_gather", "bruck", p, n)
    assert (bruck.num_steps, bruck.max_sent_numel()) == (lg(p), (p - 1) * n // p)
    # the butterflies fold: two extra rounds around the power-of-two core
    core = 1 << (p.bit_length() - 1)
    assert build_schedule("all_reduce", "recursive_doubling", p, n).num_steps == int(math.log2(core)) + 2
    assert build_schedule("all_reduce", "halving_doubling", p, n).num_steps == 2 * int(math.log2(core)) + 2
    tree = build_schedule("all_reduce", "tree", p, n)
    assert tree.num_steps == 2 * lg(p)
    assert tree.critical_path_numel() == 2 * lg(p) * n


def test_pipelined_chain_and_binary_tree_step_counts():
    for p, segments in [(2, 1), (4, 8), (5, 3)]:
        chain = build_schedule("broadcast", "ring", p, 1000, 0, segments)
        assert chain.num_steps == p + segments - 2
        depth = int(math.log2(p))
        tree = build_schedule("all_reduce", "binary_tree", p, 1000, None, segments)
        assert tree.num_steps == 2 * depth + segments - 1


def test_hierarchical_two_level_bytes():
    # k groups of g: 2(g-1) + 2(k-1) rounds; per rank 2(g-1)/g n + 2(k-1)/k n/g
    for k, g in [(2, 4), (3, 2), (4, 4)]:
        p, n = k * g, k * g * 120
        s = build_schedule("all_reduce", "hierarchical", p, n, hierarchy=tuple(
            tuple(range(i * g, (i + 1) * g)) for i in range(k)))
        assert s.num_steps == 2 * (g - 1) + 2 * (k - 1)
        assert s.max_sent_numel() == 2 * (g - 1) * n // g + 2 * (k - 1) * (n // g) // k


def test_gamma_and_message_counts():
    p, n = 4, 400
    ring = build_schedule("all_reduce", "ring", p, n)
    assert all(ring.reduced_numel(r) == (p - 1) * n // p for r in range(p))  # the gamma term
    assert all(ring.messages(r) == 2 * (p - 1) for r in range(p))
    tree = build_schedule("all_reduce", "tree", p, n)
    assert tree.reduced_numel(0) == 2 * n and tree.reduced_numel(3) == 0  # root adds its two children


def test_star_server_link_carries_2pn():
    p, n = 6, 600
    s = build_schedule("all_reduce", "star", p, n)
    assert s.sent_numel(0) + s.recv_numel(0) == 2 * (p - 1) * n


def test_schedule_is_data():
    s = build_schedule("all_reduce", "ring", 4, 8)
    assert isinstance(s, Schedule) and s.world_size == 4 and s.buffer_numel == 8
    assert all(isinstance(t, Transfer) for step in s.steps for t in step.transfers)
