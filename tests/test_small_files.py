"""Reading a user's small file (plait.files): a --config TOML and a calibration profile
are read only from a regular file of bounded size. Each case was a hostile input of
issue 31's review: a FIFO hung the reader forever, /dev/zero was read until memory
ran out, a directory failed late (IsADirectoryError, after the ranks started), a
300 MB file was read in full."""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from plait.cost.profile import load_profile
from plait.train.config import load_toml

READERS = {"config": (load_toml, "config file"), "profile": (load_profile, "calibration profile")}
CONFIG_LIMIT_NBYTES = 1 << 20  # the bounds the messages state (plait.train.config, plait.cost.profile)
PROFILE_LIMIT_NBYTES = 16 << 20
DEADLINE_S = 10  # the refusal takes milliseconds; a reader blocked on the FIFO never returns


def call_releasing_fifo(fifo: Path, call):
    """call() in a thread; if it is still blocked on ``fifo`` after DEADLINE_S, open the
    FIFO's writing end (so the blocked reader sees end of file) and fail."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    hung = thread.is_alive()
    if hung:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # release the reader: it reads end of file
        thread.join(DEADLINE_S)
    assert not hung, f"reading the FIFO {fifo} blocked for {DEADLINE_S} s"
    return outcome


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_fifo_is_refused_without_blocking(reader, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    load, what = READERS[reader]
    outcome = call_releasing_fifo(fifo, lambda: load(fifo))
    error = outcome.get("error")
    assert isinstance(error, ValueError), outcome
    assert str(error).startswith(f"{what} {str(fifo)!r} is a FIFO (named pipe), not a regular file: ")


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_directory_is_refused_by_name(reader, tmp_path):
    load, what = READERS[reader]
    with pytest.raises(ValueError, match=f"^{what} '{tmp_path}' is a directory, not a regular file: give "):
        load(tmp_path)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_dev_zero_is_refused_without_reading_it(reader):
    """In a child limited to 512 MiB of address space: the old reader read /dev/zero
    until it ran out (a MemoryError there; the whole machine's memory without the limit)."""
    load = {"config": "from plait.train.config import load_toml as load",
            "profile": "from plait.cost.profile import load_profile as load"}[reader]
    code = f"{load}\ntry:\n    load('/dev/zero')\nexcept ValueError as error:\n    print(error)\n"

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            preexec_fn=limit)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{READERS[reader][1]} '/dev/zero' is a character device, not a regular file" in result.stdout


def test_a_config_over_the_bound_is_refused_naming_the_bound(tmp_path):
    big = tmp_path / "big.toml"
    with big.open("wb") as file:
        file.truncate(CONFIG_LIMIT_NBYTES + 1)  # sparse: no disk used
    with pytest.raises(ValueError, match=rf"^config file '{big}' is larger than 1,048,576 bytes \(1 MiB\), the most "):
        load_toml(big)
    exact = tmp_path / "exact.toml"
    exact.write_bytes(b"lr = 0.001\n" + b" " * (CONFIG_LIMIT_NBYTES - 12) + b"\n")
    assert load_toml(exact) == {"lr": 0.001}  # the bound itself is allowed


def test_a_profile_over_the_bound_is_refused_naming_the_bound(tmp_path):
    big = tmp_path / "big.json"
    with big.open("wb") as file:
        file.truncate(PROFILE_LIMIT_NBYTES + 1)
    with pytest.raises(ValueError, match=rf"^calibration profile '{big}' is larger than 16,777,216 bytes \(16 MiB\)"):
        load_profile(big)


def test_a_config_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'data = "caf\xe9"\n')
    with pytest.raises(ValueError, match=f"^cannot read config file '{bad}': not UTF-8 text"):
        load_toml(bad)


def test_a_topology_file_that_is_a_fifo_or_a_device_is_refused(tmp_path):
    """plait bench --topology FIFO.json hung; a device like /dev/zero filled memory."""
    from plait.cost.topology_io import load_topology

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    error = call_releasing_fifo(fifo, lambda: load_topology(fifo)).get("error")
    assert isinstance(error, ValueError) and "is a FIFO (named pipe), not a regular file" in str(error), error
    zero = tmp_path / "zero.json"
    try:
        os.mknod(zero, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # the kernel's zero device, under its own name
    except PermissionError:
        pytest.skip("making a device node needs root")
    with pytest.raises(ValueError, match="is a character device, not a regular file"):
        load_topology(zero)
