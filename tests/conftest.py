"""Session-wide test setup: one thread per process, an empty profile cache, the
harness's worker pools shut down when the session ends, and then a check that no
shared-memory segment or doorbell of plait's survives the suite in /dev/shm."""

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests never read the developer's calibration profile (~/.cache/plait): with one,
# algorithm="auto" would follow it instead of the default table the tests expect.
# Set before the worker pools spawn, so they inherit it.
os.environ["PLAIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="plait-test-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

SHM_DIRECTORY = "/dev/shm"


def _plait_shm_files() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIRECTORY) if name.startswith("plait-shm-")}
    except OSError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Fails the session (an error on its last test) if any plait segment or doorbell
    created during it is still in /dev/shm: every one must be unlinked at set-up,
    whatever happens to its ranks."""
    before = _plait_shm_files()
    yield
    left = _plait_shm_files() - before
    assert not left, f"plait left shared-memory files behind in {SHM_DIRECTORY}: {sorted(left)}"


def pytest_sessionfinish(session, exitstatus):
    from plait.testing import shutdown_pools

    shutdown_pools()
