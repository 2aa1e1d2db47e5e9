"""The tuner: algorithm="auto" picks the algorithm the cost model prices lowest."""

from __future__ import annotations

import pytest
import torch

import plait.comm as comm
from plait.comm.choice import auto_algorithm, default_algorithm
from plait.comm.tuner import Tuner, parse_overrides, size_bucket
from plait.cost import LinkModel
from plait.cost.alpha_beta import predict_time_s
from plait.testing import run_distributed

LATENCY_BOUND = LinkModel(1e-3, 1e-10, 0.0)  # 1 ms per round, 10 GB/s


def test_size_buckets_are_powers_of_two():
    assert size_bucket(1) == (1, 2, 1)
    assert size_bucket(1000)[:2] == (512, 1024)
    lo, hi, mid = size_bucket(1 << 20)
    assert (lo, hi) == (1 << 20, 1 << 21) and lo < mid < hi


@pytest.mark.parametrize("p", [2, 3, 6, 8, 13])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"])
def test_choice_is_the_cheapest_prediction_at_the_bucket_middle(p, collective):
    tuner = Tuner(LinkModel(2e-5, 1 / 5e9, 1 / 20e9))
    for nbytes in (100, 5000, 1 << 16, 3 << 20, 1 << 28):
        _, _, middle = size_bucket(nbytes)
        predictions = tuner.predictions(collective, middle, p)
        assert tuner.choose(collective, nbytes, p) == min(predictions, key=predictions.get)


def test_known_best_algorithms_on_synthetic_links():
    tuner = Tuner(LATENCY_BOUND)
    # latency-bound: one round beats everything
    assert tuner.choose("all_reduce", 1024, 8) == "direct"
    # bandwidth-bound, p a power of two: halving-doubling moves ring's bytes in lg p rounds
    assert tuner.choose("all_reduce", 1 << 30, 8) == "halving_doubling"
    # p = 6 is not a power of two: halving-doubling's fold costs 2n more, so ring wins
    assert tuner.choose("all_reduce", 1 << 30, 6) == "ring"
    # a reduction so slow that reducing (p-1)/p n once beats moving anything twice
    assert Tuner(LinkModel(1e-6, 1e-12, 1e-6)).choose("all_reduce", 1 << 26, 8) == "halving_doubling"


def test_switch_points_cover_the_range_and_merge_buckets():
    tuner = Tuner(LATENCY_BOUND)
    ranges = tuner.switch_points("all_reduce", 8, 1, 1 << 30)
    assert ranges[0][0] == 1 and ranges[-1][1] == (1 << 30) + 1
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(a[2] != b[2] for a, b in zip(ranges, ranges[1:]))
    assert [r[2] for r in ranges][0] == "direct" and ranges[-1][2] == "halving_doubling"


def test_hierarchical_is_a_candidate_only_with_a_real_hierarchy():
    inter, intra = LinkModel(1e-5, 1 / 25e9), LinkModel(1e-6, 1 / 300e9)
    flat = Tuner([inter, intra])
    assert "hierarchical" not in flat.algorithms("all_reduce", 32)
    two_level = Tuner([inter, intra], hierarchy="4x8")
    assert "hierarchical" in two_level.algorithms("all_reduce", 32)
    assert two_level.choose("all_reduce", 1 << 30, 32) == "hierarchical"
    expected = predict_time_s("all_reduce", "hierarchical", 1 << 30, 32, [inter, intra], hierarchy="4x8")
    assert two_level.predict_s("all_reduce", "hierarchical", 1 << 30, 32) == pytest.approx(expected)


def test_overrides_parse_and_reject_bad_names():
    assert parse_overrides("all_reduce=ring, broadcast=tree") == {"all_reduce": "ring", "broadcast": "tree"}
    assert parse_overrides({"all_gather": "torch"}) == {"all_gather": "torch"}
    with pytest.raises(ValueError, match="collective=algorithm"):
        parse_overrides("all_reduce:ring")
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        parse_overrides("allreduce=ring")
    with pytest.raises(ValueError, match="does not implement all_to_all"):
        parse_overrides({"all_to_all": "ring"})


def test_auto_follows_override_then_tuner_then_table():
    tuned = comm.CommConfig(algorithms={"all_reduce": "tree"}, tuner=Tuner(LATENCY_BOUND))
    assert auto_algorithm("all_reduce", 1 << 24, 8, tuned) == "tree"
    assert auto_algorithm("all_reduce", 1024, 8, tuned.replace(algorithms={})) == "direct"
    # no tuner in the config: the table decides, whatever profile a cache may hold
    assert auto_algorithm("all_reduce", 1 << 24, 8, comm.CommConfig()) == default_algorithm("all_reduce", 1 << 24, 8)


def auto_runs_the_tuners_choice(rank, p):
    communicator = comm.init_communicator(None, comm.CommConfig(tuner=Tuner(LATENCY_BOUND, source="test link")))
    x = torch.full((256,), float(rank))
    comm.all_reduce(x, algorithm="auto")
    used = communicator.stats()["all_reduce"]["algorithms"]
    comm.init_communicator(None)  # back to the defaults for later tests in this pooled worker
    return used, bool(torch.all(x == sum(range(p)))), communicator.tuner_used


@pytest.mark.slow
def test_auto_runs_the_tuners_choice_on_real_ranks():
    for used, correct, source in run_distributed(auto_runs_the_tuners_choice, 3, timeout_s=60):
        assert used == {"direct": 1} and correct and source == "test link"


def test_shared_host_tuner_prices_schedules_with_the_shared_model():
    from plait.comm.algorithms import build_schedule
    from plait.cost.alpha_beta import shared_host_terms

    link = LinkModel(1e-3, 1e-9, 3e-10)
    tuner = Tuner(link, call_overhead_s=2e-4, shared_host_ranks=4)
    for algorithm in ("star", "ring", "tree"):
        schedule = build_schedule("all_reduce", algorithm, 4, 1 << 18, None, 4)
        expected = 2e-4 + shared_host_terms(schedule, 4, 4).time_s(link)
        assert tuner.predict_s("all_reduce", algorithm, 1 << 20, 4) == pytest.approx(expected, rel=1e-12)
    # on a shared host the star's one busy rank costs no more than everyone busy in a ring
    assert tuner.choose("all_reduce", 4096, 4) == "star"
    with pytest.raises(ValueError, match="shared_host_ranks=0"):
        Tuner(link, shared_host_ranks=0)


def test_the_shared_memory_table_broadcasts_large_messages_down_a_tree():
    assert default_algorithm("broadcast", 8 << 20, 4, "shm") == "tree"
    assert default_algorithm("reduce", 8 << 20, 4, "shm") == "tree"
    assert default_algorithm("broadcast", 8 << 20, 4) == "ring"  # gloo's table is unchanged
    assert default_algorithm("all_reduce", 8 << 20, 4, "shm") == default_algorithm("all_reduce", 8 << 20, 4) == "ring"
    assert default_algorithm("all_reduce", 2 << 20, 4, "shm") == "star"  # a ring only from 4 MiB on shm
    assert default_algorithm("all_reduce", 2 << 20, 4) == "ring"
