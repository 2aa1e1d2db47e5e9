"""plait testbed: link specs and presets are checked before anything is built; a real
testbed of network namespaces carries, measured by one TCP stream timed at the
receiver, the rates its links were given (and much more where none was), refuses to
start twice, and leaves nothing behind: not after `down`, not after a failure in the
middle of `up`. The namespace tests need root (they skip, saying so, without it) and
use a prefix of their own, so a testbed someone has up is never touched."""

import concurrent.futures
import json
import os
import re
import subprocess
import time

import pytest

from plait.cli.main import main
from plait.cost.topology_io import load_topology, save_topology
from plait.testbed import netns
from plait.testbed.measure import tcp_rate_bits_per_s
from plait.testbed.probe import probe, profiled_topology
from plait.testbed.run import run_on_testbed
from plait.testbed import spec as testbed_spec
from plait.testbed.spec import PRESETS, LinkSpec, TestbedSpec, parse_rate, spec_from

PREFIX = f"plt-test{os.getpid()}"


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"{PREFIX}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _root_links() -> set[str]:
    """The interfaces of the namespace the tests run in (the testbed must add none)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


_NO_NAMESPACES = _can_make_namespaces()  # why namespace tests cannot run here (not root, no netns), or None
needs_namespaces = pytest.mark.skipif(_NO_NAMESPACES is not None, reason=_NO_NAMESPACES or "")


def test_rates_and_links_parse_as_tc_reads_them():
    assert parse_rate("100mbit") == 100e6 and parse_rate("1.5gbit") == 1.5e9 and parse_rate("64kbit") == 64e3
    assert LinkSpec.parse("0-2:rate=20mbit") == LinkSpec(0, 2, 20e6)


@pytest.mark.parametrize("flags,message", [
    (dict(links=["0-1:rate=10mbps"]), "rate '10mbps' is not a rate tc takes"),
    (dict(links=["0-1:rate=10mbit,delay=1ms"]), "delay needs the kernel's netem qdisc"),
    (dict(links=["0-5:rate=10mbit"]), "link 0-5: hosts are numbered 0 to 1"),
    (dict(links=["0-1:rate=1mbit", "1-0:rate=2mbit"]), "link 1-0 is given twice"),
    (dict(links=["0:1"]), "write A-B:rate=RATE"),
    (dict(hosts=1), "--hosts 1: a testbed has 2 to 9 hosts"),
    (dict(preset="2x2-slow", hosts=2), "--preset names the whole testbed"),
    (dict(preset="nope", hosts=None), "--preset 'nope' is unknown; presets: 2x2-slow, partial-3+5, ring-one-slow"),
    (dict(hosts=10), "--hosts 10: a testbed has 2 to 9 hosts"),
])
def test_bad_specs_are_named_before_anything_is_built(flags, message):
    arguments = {"preset": None, "hosts": 2, "ranks_per_host": None, "links": [], **flags}
    with pytest.raises(ValueError, match=re.escape(message)):
        spec_from(arguments["preset"], arguments["hosts"], arguments["ranks_per_host"], arguments["links"])


@pytest.mark.parametrize("flags,message", [
    # before: 0 was taken for "unset" and the testbed came up with 1 rank per host
    (dict(ranks_per_host=0), "--ranks-per-host 0: every host runs 1 to "),
    (dict(ranks_per_host=-1), "--ranks-per-host -1: every host runs 1 to "),
    # before: accepted (up printed 100000000 rank(s) per host; run would start them)
    (dict(ranks_per_host=10**8), "--ranks-per-host 100000000: every host runs 1 to "),
    # before: a MemoryError traceback (the ranks tuple was built before the host count was checked)
    (dict(hosts=10**11), "--hosts 100000000000: a testbed has 2 to 9 hosts"),
    (dict(hosts=0), "--hosts 0: a testbed has 2 to 9 hosts"),
    # before: tc failed inside `up` ('"rate" is required'), after the namespaces were made
    (dict(links=["0-1:rate=99999999999999999999gbit"]), "is not a rate tc takes: give a positive number below"),
    (dict(links=["0-1:rate=0mbit"]), "rate '0mbit' is not a rate tc takes"),
])
def test_bad_counts_and_rates_are_refused_naming_the_value(flags, message):
    arguments = {"preset": None, "hosts": 2, "ranks_per_host": None, "links": [], **flags}
    with pytest.raises(ValueError, match=re.escape(message)):
        spec_from(arguments["preset"], arguments["hosts"], arguments["ranks_per_host"], arguments["links"])


def test_the_rank_limit_is_the_machines_process_limit():
    limit = testbed_spec.max_processes()
    assert spec_from(None, 2, limit // 2, []).ranks == (limit // 2, limit // 2)
    with pytest.raises(ValueError, match=f"every host runs 1 to {limit // 2} ranks"):
        spec_from(None, 2, limit // 2 + 1, [])
    assert spec_from(None, 3, None, []).ranks == (1, 1, 1)  # unset: one rank per host


@pytest.mark.parametrize("job,message", [
    # before: every agent started, and torchrun's traceback per host ended it (exit 1)
    (["nonexistent.py"], "script 'nonexistent.py' does not exist (looked in "),
    (["."], "'.' is a directory without __main__.py"),
    (["-m", "plait_no_such_module"], "module 'plait_no_such_module' cannot be found from "),
    (["--no-python", "plait-no-such-program"], "program 'plait-no-such-program' is not on PATH"),
    ([], "give the command to run after --"),
])
def test_testbed_run_checks_the_script_before_any_namespace(job, message, tmp_path, monkeypatch, capsys):
    """The check comes before the privilege check and before the testbed is looked up,
    so it needs no testbed (and no root): one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    assert main(["testbed", "run", "--", *job]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"plait testbed: error: {message}"), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("timeout", ["0", "-5", "nan", "inf"])
def test_testbed_run_refuses_a_timeout_that_is_no_deadline(timeout, tmp_path, monkeypatch, capsys):
    """Before: -5 or 0 stopped every agent at once (exit 124), nan never did."""
    monkeypatch.chdir(tmp_path)
    assert main(["testbed", "run", "--timeout", timeout, "--", "job.py"]) == 2
    assert f"--timeout {float(timeout)}: give a finite number of seconds > 0" in capsys.readouterr().err


def test_the_presets_are_what_their_names_say():
    assert PRESETS["2x2-slow"].ranks == (2, 2) and PRESETS["2x2-slow"].rate_between(0, 1) == 100e6
    assert PRESETS["partial-3+5"].ranks == (3, 5)
    ring = PRESETS["ring-one-slow"]
    assert ring.ranks == (2, 2, 2)
    assert [ring.rate_between(0, 1), ring.rate_between(1, 2), ring.rate_between(2, 0)] == [200e6, 200e6, 50e6]


@pytest.mark.slow
@needs_namespaces
def test_links_carry_their_rates_and_down_leaves_nothing():
    """Payload rate of one TCP stream, timed at the receiver: a shaped link carries
    85-100% of its rate (TCP/IP headers take ~4% of what htb counts), an unshaped
    pair far more (a veth moves gigabits here)."""
    before = _root_links()
    testbed = netns.Testbed(TestbedSpec(ranks=(1, 2, 1), links=(LinkSpec(0, 1, 100e6), LinkSpec(0, 2, 20e6))),
                            prefix=PREFIX)
    testbed.up()
    try:
        assert netns.namespaces(PREFIX) == [f"{PREFIX}-h0", f"{PREFIX}-h1", f"{PREFIX}-h2", f"{PREFIX}-sw"]
        with pytest.raises(netns.TestbedError, match="a testbed is already up"):
            testbed.up()
        lines = netns.status(PREFIX)
        assert any("198.18.0.1/24" in line and "rate 100Mbit" in line and "rate 20Mbit" in line for line in lines)
        fast = tcp_rate_bits_per_s(testbed, 1, 0, 8 << 20)
        slow = tcp_rate_bits_per_s(testbed, 0, 2, 2 << 20)
        free = tcp_rate_bits_per_s(testbed, 1, 2, 32 << 20)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both ways at once: a full-duplex link
            both = [pool.submit(tcp_rate_bits_per_s, testbed, a, b, 16 << 20, 29600 + a) for a, b in ((0, 1), (1, 0))]
            both = [future.result() for future in both]
        assert all(0.9 * 100e6 <= rate <= 100e6 for rate in both), both
        # Payload is 1448 of every 1514 bytes on the wire (0.956 of the rate); a stream can
        # run ahead by one 64 KiB packet (probe.FIRST_PROBE_BYTES), at most 1/32 over 2 MiB:
        # so never above the rate.
        assert 0.85 * 100e6 <= fast <= 100e6
        assert 0.85 * 20e6 <= slow <= 20e6
        assert free > 5 * 100e6
        assert _root_links() == before  # nothing was made outside the testbed's namespaces
    finally:
        removed = netns.down(PREFIX)
    assert len(removed) == 4 and netns.namespaces(PREFIX) == [] and _root_links() == before
    assert not netns.state_file(PREFIX).exists()


@pytest.mark.slow
@needs_namespaces
def test_a_failure_inside_up_removes_what_it_made(monkeypatch):
    def broken(self, host):
        raise netns.TestbedError("shaping failed on purpose")

    monkeypatch.setattr(netns.Testbed, "_shape", broken)
    with pytest.raises(netns.TestbedError, match="on purpose"):
        netns.Testbed(PRESETS["2x2-slow"], prefix=PREFIX).up()
    assert netns.namespaces(PREFIX) == []


def test_the_cli_names_bad_flags(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text("")  # a script that exists: the testbed is what is missing
    assert main(["testbed", "up", "--hosts", "2", "--link", "0-1:rate=fast"]) == 2
    assert "rate 'fast' is not a rate tc takes" in capsys.readouterr().err
    assert main(["testbed", "up"]) == 2
    assert "give --preset NAME, or --hosts H" in capsys.readouterr().err
    if _NO_NAMESPACES is None and not netns.namespaces():  # no testbed of the default name up here
        assert main(["testbed", "run", "--", "job.py"]) == 2
        assert "plait testbed: error: no testbed is up: run `plait testbed up` first" in capsys.readouterr().err


JOB = os.path.join(os.path.dirname(__file__), "allreduce_job.py")
DYING_JOB = os.path.join(os.path.dirname(__file__), "dying_rank_job.py")


@pytest.mark.slow
@needs_namespaces
def test_a_job_runs_across_hosts_over_the_shaped_link(tmp_path):
    """`run`: one torchrun agent per host, 2 x 2 ranks. The world is 4, the all-reduce
    right, each rank reaches the rendezvous host from its own host's address, and 5
    MiB between hosts take the 100 Mbit link's time (>= 0.85 x 5 MiB / 100 Mbit =
    0.37 s; measured 0.44 s) while on one host they take a small fraction of it."""
    testbed = netns.Testbed(PRESETS["2x2-slow"], prefix=PREFIX)
    testbed.up()
    try:
        assert run_on_testbed(testbed, [JOB, str(tmp_path / "job.json")], timeout_s=120) == 0
        sleeper = tmp_path / "sleep.py"
        sleeper.write_text("import time\ntime.sleep(60)\n")
        started = time.monotonic()
        assert run_on_testbed(testbed, [str(sleeper)], timeout_s=3) == 124  # stopped, every agent with its ranks
        assert time.monotonic() - started < 30
    finally:
        netns.down(PREFIX)
    result = json.loads((tmp_path / "job.json").read_text())
    assert result["world"] == 4 and result["sum"] == 10.0
    assert [(entry["host"], entry["address"]) for entry in result["ranks"]] == \
        [(0, "198.18.0.1"), (0, "198.18.0.1"), (1, "198.18.0.2"), (1, "198.18.0.2")]
    seconds = result["send_5MiB_s"]
    assert seconds["other_host"] >= 0.85 * 5 * 2**20 * 8 / 100e6
    assert seconds["same_host"] < seconds["other_host"] / 5


@pytest.mark.slow
@needs_namespaces
def test_the_probe_recovers_the_given_rates_and_writes_a_topology(tmp_path):
    """Every host pair measured by TCP: the shaped pairs within 10% of their rates
    (payload, so a few percent under), the unshaped one far above; the topology file
    loads back with a device per rank and a link per host pair."""
    testbed = netns.Testbed(TestbedSpec(ranks=(1, 2, 1), links=(LinkSpec(0, 1, 100e6), LinkSpec(0, 2, 20e6))),
                            prefix=PREFIX)
    testbed.up()
    try:
        measured = {(entry.a, entry.b): entry for entry in probe(testbed)}
        path = save_topology(profiled_topology(testbed, list(measured.values())), tmp_path / "testbed.json")
    finally:
        netns.down(PREFIX)
    assert 0.9 <= measured[0, 1].bytes_per_s * 8 / 100e6 <= 1.0
    assert 0.9 <= measured[0, 2].bytes_per_s * 8 / 20e6 <= 1.0
    assert measured[1, 2].bytes_per_s * 8 > 5 * 100e6
    assert all(0 < entry.latency_s < 0.01 for entry in measured.values())
    topology = load_topology(path)
    assert [node.name for node in topology.nodes if node.kind == "device"] == ["h0.r0", "h1.r0", "h1.r1", "h2.r0"]
    between = {frozenset(link.endpoints): link.bandwidth_bytes_per_s for link in topology.links
               if all(".r" not in end for end in link.endpoints)}
    assert between[frozenset(("h0", "h1"))] == measured[0, 1].bytes_per_s


@pytest.mark.slow
@needs_namespaces
def test_a_rank_that_dies_is_named_by_its_peers_and_down_still_cleans_up(tmp_path):
    """Rank 3 (host 1) exits after a barrier; the ring all-reduce of the others fails
    well within its 20 s deadline, with an error naming peer 3; the run ends with a
    failure status and `down` leaves nothing."""
    testbed = netns.Testbed(PRESETS["2x2-slow"], prefix=PREFIX)
    testbed.up()
    try:
        started = time.monotonic()
        status = run_on_testbed(testbed, [DYING_JOB, str(tmp_path)], timeout_s=60)
        elapsed_s = time.monotonic() - started
    finally:
        removed = netns.down(PREFIX)
    assert status not in (0, 124) and elapsed_s < 40
    reports = {path.name: path.read_text() for path in tmp_path.glob("rank*.txt")}
    assert "rank3.txt" not in reports and reports, reports
    assert any("with peer 3" in text for text in reports.values()), reports
    assert all(text != "finished" for text in reports.values())
    assert len(removed) == 3 and netns.namespaces(PREFIX) == []
