"""plait's user-error classes (plait.errors.PlaitError) reach the plait command as one
line, exit 2, like a ValueError; checked on a real path: `plait checkpoint export`
onto a filesystem that is really full (a 512 KiB tmpfs filled to the last block)."""


import pytest

from plait.cli.main import main
from plait.memory.loss_scale import LossScaleError
from plait.testbed import netns
from tests.train.test_checkpoint import build_reference, save


def test_the_user_facing_error_classes_are_plait_errors():
    """Each keeps the builtin it refines, so existing ``except`` clauses still catch it."""
    from plait.errors import DiskFull, PlaitError  # new with this test: the module fails on older code alone

    assert issubclass(LossScaleError, PlaitError) and issubclass(LossScaleError, RuntimeError)
    assert issubclass(netns.TestbedError, PlaitError) and issubclass(netns.TestbedError, RuntimeError)
    assert issubclass(DiskFull, PlaitError) and issubclass(DiskFull, OSError)


@pytest.fixture
def full_disk(small_tmpfs):
    """A 512 KiB tmpfs with every block taken."""
    mount_point = small_tmpfs("512k")
    with open(mount_point / "filler", "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError:
            pass
    return mount_point


def test_export_onto_a_full_disk_is_one_line(full_disk, tmp_path, capsys):
    """Before: DiskFull was an OSError, not a ValueError: the CLI printed its traceback
    (exit 1). Now: plait checkpoint: error: no space left on device writing PATH: ..."""
    run_dir = tmp_path / "run"
    save(run_dir, 100, build_reference())
    out = full_disk / "model.pt"
    status = main(["checkpoint", "export", str(run_dir), "--out", str(out)])
    captured = capsys.readouterr()
    assert status == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert lines[-1].startswith(f"plait checkpoint: error: no space left on device writing {out}: it needs "), \
        captured.err
    assert "bytes are free there" in lines[-1] and "Traceback" not in captured.err
