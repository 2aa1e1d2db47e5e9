"""Session-wide test setup: one thread per process, an empty profile cache, and the
harness's worker pools shut down when the session ends."""

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests never read the developer's calibration profile (~/.cache/plait): with one,
# algorithm="auto" would follow it instead of the default table the tests expect.
# Set before the worker pools spawn, so they inherit it.
os.environ["PLAIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="plait-test-cache-")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus):
    from plait.testing import shutdown_pools

    shutdown_pools()
