"""The run directory's lock (plait.train.runlock): one run at a time, shared by the
processes of one run, released by the kernel when its holder dies however it dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from plait.train import runlock

HOLD = """
import sys, time
from plait.train import runlock
lock = runlock.acquire(sys.argv[1], sys.argv[2])
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
    with runlock.acquire(tmp_path, "run-a", started_unix_s=1_700_000_000.0) as first:
        assert first.owned
        with pytest.raises(runlock.RunDirectoryBusy) as refused:
            runlock.acquire(tmp_path, "run-b")
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message and "run run-a" in message
        assert time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_700_000_000.0)) in message
        assert "choose another --out" in message
        assert runlock.holder(tmp_path).run_id == "run-a"
        with pytest.raises(runlock.RunDirectoryBusy):
            runlock.check_free(tmp_path, "run-b")
        runlock.check_free(tmp_path, "run-a")  # the run's own processes may go on
    assert runlock.holder(tmp_path) is None
    with runlock.acquire(tmp_path, "run-b") as second:  # released: the next run gets it
        assert second.owned and json.loads((tmp_path / runlock.LOCK_NAME).read_text())["run_id"] == "run-b"


def test_processes_of_one_run_share_the_lock(tmp_path):
    with runlock.acquire(tmp_path, "run-a") as holder_lock:
        shared = runlock.acquire(tmp_path, "run-a")
        assert not shared.owned and shared.holder == holder_lock.holder
        with pytest.raises(ValueError, match="held by pid"):
            shared.fileno()
        shared.release()  # sharing releases nothing
        with pytest.raises(runlock.RunDirectoryBusy):
            runlock.acquire(tmp_path, "run-b")


def test_the_kernel_releases_the_lock_of_a_killed_holder(tmp_path):
    """The holder is SIGKILLed: no cleanup code runs, yet the next run gets the lock."""
    holder_process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), "killed-run"],
                                      stdout=subprocess.PIPE, text=True)
    try:
        assert holder_process.stdout.readline().strip() == "held"
        with pytest.raises(runlock.RunDirectoryBusy, match=f"pid {holder_process.pid} .*killed-run"):
            runlock.acquire(tmp_path, "next-run")
        holder_process.send_signal(signal.SIGKILL)
        holder_process.wait(timeout=30)
        with runlock.acquire(tmp_path, "next-run") as lock:
            assert lock.owned
    finally:
        holder_process.kill()
        holder_process.wait()


def test_an_inherited_descriptor_keeps_the_directory_locked(tmp_path):
    """The launcher passes its descriptor to the agent: if the launcher dies, the
    directory stays locked while the agent lives."""
    lock = runlock.acquire(tmp_path, "run-a")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(lock.fileno(),))
    try:
        lock.release()  # the launcher's copy is gone
        with pytest.raises(runlock.RunDirectoryBusy):
            runlock.acquire(tmp_path, "run-b")
        child.kill()
        child.wait(timeout=30)
        runlock.acquire(tmp_path, "run-b").release()
    finally:
        child.kill()
        child.wait()


def test_an_unreadable_holder_record_still_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "HOLDER_RECORD_WAIT_S", 0.1)
    lock = runlock.acquire(tmp_path, "run-a")
    (tmp_path / runlock.LOCK_NAME).write_text("")  # e.g. a holder that has not written its record yet
    with pytest.raises(runlock.RunDirectoryBusy, match="lock record cannot be read"):
        runlock.acquire(tmp_path, "run-a")
    lock.release()


def test_an_empty_run_id_is_refused(tmp_path):
    with pytest.raises(ValueError, match="run_id"):
        runlock.acquire(tmp_path, "")
