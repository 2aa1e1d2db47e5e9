"""Session-wide test setup: one thread per process, an empty profile cache, the
harness's worker pools shut down when the session ends, and then a check that no
shared-memory segment or doorbell of plait's survives the suite in /dev/shm."""

import os
import subprocess
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


# Markers whose tests run only when -m names them: ``long`` (whole plait train runs under
# torchrun: restarts, stops, two nodes; make test-long) and ``docs_slow`` (the docs' slow
# blocks; make docs-check). make test leaves both out, to stay under 20 minutes on the
# 2-core machine; make test-all runs long and the rest.
OPT_IN_MARKERS = ("long", "docs_slow")


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("markexpr") or ""
    left_out = [marker for marker in OPT_IN_MARKERS if marker not in markexpr]
    kept = [item for item in items if not any(item.get_closest_marker(marker) for marker in left_out)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


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


@pytest.fixture
def small_tmpfs(tmp_path):
    """small_tmpfs(size) -> a fresh tmpfs of ``size`` (e.g. "512k"): a real filesystem
    that fills up, unmounted at the end; skips where mounting needs privileges
    (root / CAP_SYS_ADMIN) this process lacks."""
    mounted = []

    def mount(size: str):
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"mounting a small tmpfs needs root (CAP_SYS_ADMIN): {result.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def pytest_sessionfinish(session, exitstatus):
    from plait.testing import shutdown_pools

    shutdown_pools()
