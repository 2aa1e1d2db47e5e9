"""Every algorithm x collective x op on the virtual executor, p = 1..9, sizes
0, 1, p-1, p+1 and two odd larger ones, against the float64 reference."""

import pytest
import torch

from plait.comm.algorithms import ALGORITHMS, COLLECTIVES, REDUCING, ROOTED, algorithms_for
from plait.comm.reference import count_wrong, reference, rank_inputs
from plait.comm.virtual import simulate

PAIRS = [(c, a) for c in COLLECTIVES for a in algorithms_for(c)]
OPS = ("sum", "avg", "min", "max", "prod")
CHUNKED = ("reduce_scatter", "scatter", "all_to_all")


def sizes(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p + 1, 97, 1031})


def per_rank_numel(collective: str, p: int, size: int) -> int:
    # reduce_scatter, scatter and all_to_all take p equal chunks; size is then the chunk
    return size * p if collective in CHUNKED else size


def hierarchy_for(p: int):
    # unequal groups of 2 and 3 (last may be smaller); p = 7 -> "2+3+2"
    sizes_, left = [], p
    while left > 0:
        take = min(3 if len(sizes_) % 2 else 2, left)
        sizes_.append(take)
        left -= take
    return "+".join(map(str, sizes_))


@pytest.mark.parametrize("collective,algorithm", PAIRS, ids=[f"{c}-{a}" for c, a in PAIRS])
def test_every_size_world_and_op(collective, algorithm):
    ops = OPS if collective in REDUCING else ("sum",)
    failures = []
    for p in range(1, 10):
        roots = sorted({0, p - 1, p // 2}) if collective in ROOTED else [0]
        for size in sizes(p):
            for op in ops:
                for root in roots:
                    inputs = rank_inputs(collective, p, per_rank_numel(collective, p, size), torch.float64, op)
                    if collective == "barrier":
                        inputs = [None] * p
                    kwargs = {"hierarchy": hierarchy_for(p)} if algorithm == "hierarchical" else {}
                    for segments in (1, 3):
                        outputs = simulate(collective, algorithm, inputs, op, root, segments=segments, **kwargs)
                        expected, bounds = reference(collective, inputs, op, root)
                        for rank in range(p):
                            wrong = count_wrong(outputs[rank], expected[rank], bounds[rank])
                            if wrong:
                                failures.append((p, size, op, root, segments, rank, wrong))
    assert not failures, f"{collective}/{algorithm}: (p, size, op, root, segments, rank, #wrong): {failures[:10]}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64])
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "halving_doubling", "direct", "tree"])
def test_dtypes_all_reduce(dtype, algorithm):
    for p in (3, 4, 5):
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            inputs = rank_inputs("all_reduce", p, 53, dtype, op)
            outputs = simulate("all_reduce", algorithm, inputs, op)
            expected, bounds = reference("all_reduce", inputs, op)
            for rank in range(p):
                assert outputs[rank].dtype == dtype
                assert count_wrong(outputs[rank], expected[rank], bounds[rank]) == 0, (p, op, rank)


@pytest.mark.parametrize("algorithm", [a for a in algorithms_for("all_reduce")])
def test_all_reduce_gives_every_rank_the_same_bits(algorithm):
    """DDP relies on it: replicas must not drift apart by rounding."""
    for p in (3, 5, 6, 8):
        inputs = rank_inputs("all_reduce", p, 101, torch.float32, "sum", seed=3)
        outputs = simulate("all_reduce", algorithm, inputs, "sum", hierarchy=hierarchy_for(p))
        for rank in range(1, p):
            assert torch.equal(outputs[rank], outputs[0]), (p, rank)


def test_hierarchical_three_levels_and_prime_world():
    tree = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    inputs = rank_inputs("all_reduce", 8, 1000, torch.float64, "sum")
    expected, bounds = reference("all_reduce", inputs, "sum")
    for spec in (tree, "2x2x2", "3+5", "1+7", [[0, 4], [1, 5], [2, 6], [3, 7]]):
        outputs = simulate("all_reduce", "hierarchical", inputs, "sum", hierarchy=spec)
        assert all(count_wrong(o, e, b) == 0 for o, e, b in zip(outputs, expected, bounds)), spec
    inputs = rank_inputs("all_reduce", 7, 50, torch.float64, "sum")
    expected, bounds = reference("all_reduce", inputs, "sum")
    outputs = simulate("all_reduce", "hierarchical", inputs, "sum", hierarchy="3+4")
    assert all(count_wrong(o, e, b) == 0 for o, e, b in zip(outputs, expected, bounds))


def test_inputs_are_not_modified():
    inputs = rank_inputs("reduce_scatter", 4, 16, torch.float64, "sum")
    saved = [x.clone() for x in inputs]
    simulate("reduce_scatter", "ring", inputs, "sum")
    assert all(torch.equal(a, b) for a, b in zip(inputs, saved))


def test_registry_lists_what_the_issue_names():
    for name in ("direct", "star", "ring", "tree", "recursive_doubling", "halving_doubling", "bruck", "hierarchical"):
        assert name in ALGORITHMS
    assert set(algorithms_for("all_reduce")) >= {"direct", "star", "ring", "tree", "binary_tree",
                                                 "double_binary_tree", "recursive_doubling",
                                                 "halving_doubling", "hierarchical"}
    assert "bruck" in algorithms_for("all_gather")
