"""plait's collectives on real gloo processes, p = 2, 3, 4, 5, every dtype, against
the reference, the virtual executor and torch.distributed (see gloo_checks)."""

import pytest

from plait.comm.algorithms import COLLECTIVES
from plait.testing import run_distributed
from tests.comm.gloo_checks import DTYPES, check_collective

pytestmark = pytest.mark.slow

SIZES = [0, 1, 5, 1031]


# the world size varies slowest, so each pool of workers is reused back to back
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_every_algorithm_float64_and_int64(p, collective):
    for dtype in ("float64", "int64"):
        results = run_distributed(check_collective, p, collective, dtype, SIZES)
        failures = [f for rank_failures in results for f in rank_failures]
        assert not failures, failures[:10]


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d not in ("float64", "int64")])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"])
@pytest.mark.parametrize("p", [3, 4])
def test_every_dtype(p, dtype, collective):
    results = run_distributed(check_collective, p, collective, dtype, [7, 300], ["sum", "max", "avg"])
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, failures[:10]
