"""Session-wide test setup: one thread per process, and the harness's worker pools
shut down when the session ends."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus):
    from plait.testing import shutdown_pools

    shutdown_pools()
