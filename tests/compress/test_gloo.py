"""Compressors on real gloo processes: reduce() against oracles replayed on every rank."""

import pytest
import torch

from plait.testing import run_distributed
from tests.compress.dist_checks import (
    check_payload_reduce,
    check_powersgd_full_rank,
    check_powersgd_low_rank,
)

pytestmark = pytest.mark.slow


def _assert_same_on_every_rank(results):
    first = results[0][1]
    for rank, (_, other) in enumerate(results[1:], start=1):
        assert other.keys() == first.keys()
        for key in first:
            assert torch.equal(other[key], first[key]), f"rank {rank} differs from rank 0 on {key}"


def test_payload_compressors_match_local_aggregate_p3():
    # 2 steps, so the ErrorFeedback residual of step 0 feeds step 1; 1031 is not divisible by 3 or 8
    results = run_distributed(check_payload_reduce, 3, 1031, 2)
    failures = [f for rank_failures, _ in results for f in rank_failures]
    assert not failures, failures[:10]
    _assert_same_on_every_rank(results)


def test_payload_compressors_in_bfloat16_p2_over_torch():
    # half-precision buffers (values and scales travel as bytes of mixed dtypes), and
    # torch.distributed's own collectives underneath instead of plait's
    results = run_distributed(check_payload_reduce, 2, 300, 2, torch.bfloat16, "torch")
    failures = [f for rank_failures, _ in results for f in rank_failures]
    assert not failures, failures[:10]
    _assert_same_on_every_rank(results)


@pytest.mark.parametrize("world_size, dtype, tolerance, algorithm", [
    (2, torch.float64, 1e-10, "auto"), (3, torch.float64, 1e-10, "auto"), (2, torch.float32, 1e-4, "ring")])
def test_powersgd_full_rank_is_the_exact_mean(world_size, dtype, tolerance, algorithm):
    # float32: rounding 2^-24 amplified by cond(P) (a random Gaussian Q, cond ~ 10-100) stays well below 1e-4
    results = run_distributed(check_powersgd_full_rank, world_size, 3, dtype, tolerance, algorithm)
    failures = [f for rank_failures, _ in results for f in rank_failures]
    assert not failures, failures[:10]
    _assert_same_on_every_rank(results)


def test_powersgd_low_rank_p3():
    results = run_distributed(check_powersgd_low_rank, 3)
    failures = [f for rank_failures, _ in results for f in rank_failures]
    assert not failures, failures[:10]
    errors = results[0][1]
    assert all(result[1] == errors for result in results)  # same approximation on every rank
