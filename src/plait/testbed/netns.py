"""A testbed built from Linux network namespaces (see ``plait.testbed.spec``).

Namespaces, all named ``<prefix>-...``: ``<prefix>-sw`` holds the bridge (the switch),
``<prefix>-h<i>`` is host i. Each host gets one veth pair, created directly inside the
two namespaces (its ``eth0`` in the host, ``p<i>`` in the switch, a bridge port), and
its address; nothing is ever created in the namespace plait runs in. A link spec
between hosts a and b shapes both directions at each host's egress: an htb qdisc
whose class for the peer's address has the link's rate (u32 filter on the
destination), every other destination unshaped. Inside that class, packets under
128 bytes (TCP's acknowledgements) have a queue of their own served first: with one
queue they wait behind up to 1,000 full packets of the other direction's stream (120
ms at 100 Mbit), which cut a stream's rate by up to 15% whenever both directions were
busy, as every all-reduce keeps them. The link's rate caps both queues together.

Deleting a namespace deletes its veths (and so their peers) and their qdiscs, so
``down`` removes everything by deleting every namespace with the prefix; ``up``
removes what it made when any step fails (and refuses to start while a namespace
with the prefix exists)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from plait.errors import PlaitError
from plait.testbed.spec import LinkSpec, TestbedSpec, host_address

PREFIX = "plait-tb"
STATE_DIR = Path("/run/plait-testbed")  # what `up` built, for `run` and `status`; removed by `down`
UNSHAPED = "10gbit"  # htb's default class: far above what a veth moves here
SMALL_SHARE = 0.05  # of a link's rate promised to its small packets; either queue may use all of it


class TestbedError(PlaitError, RuntimeError):
    """A testbed command failed: the command and what it printed (a user error: one line)."""


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    address: str
    ranks: int


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as error:
        raise TestbedError(f"{command[0]} is not installed (iproute2 provides ip and tc): {error}") from None
    if done.returncode:
        raise TestbedError(f"`{' '.join(command)}` failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return done.stdout


def namespaces(prefix: str = PREFIX) -> list[str]:
    """This machine's network namespaces that belong to a testbed with ``prefix``."""
    names = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    return sorted(name for name in names if name == f"{prefix}-sw" or name.startswith(f"{prefix}-h"))


def check_privileges() -> None:
    """Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)."""
    if os.geteuid() != 0:
        raise TestbedError("plait testbed creates network namespaces, veths and qdiscs, which needs root "
                           "(CAP_SYS_ADMIN and CAP_NET_ADMIN): run it as root")


class Testbed:
    """``spec`` built under ``prefix`` (tests use a prefix of their own)."""

    def __init__(self, spec: TestbedSpec, prefix: str = PREFIX):
        problems = spec.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.spec, self.prefix = spec, prefix
        self.switch = f"{prefix}-sw"
        self.hosts = [Host(i, f"{prefix}-h{i}", host_address(i), count) for i, count in enumerate(spec.ranks)]

    def up(self) -> None:
        """Create every namespace, veth, address and qdisc; on any failure remove
        what was made and raise."""
        check_privileges()
        existing = namespaces(self.prefix)
        if existing:
            raise TestbedError(f"a testbed is already up ({', '.join(existing)}): run `plait testbed down` first")
        try:
            self._build()
            STATE_DIR.mkdir(parents=True, exist_ok=True)
            state_file(self.prefix).write_text(json.dumps(
                {"ranks": list(self.spec.ranks),
                 "links": [[link.a, link.b, link.rate_bits_per_s] for link in self.spec.links]}))
        except BaseException:
            down(self.prefix)
            raise

    @staticmethod
    def current(prefix: str = PREFIX) -> Testbed:
        """The testbed ``up`` built under ``prefix`` (read back from its state file)."""
        path = state_file(prefix)
        if not namespaces(prefix) or not path.exists():
            raise TestbedError("no testbed is up: run `plait testbed up` first")
        state = json.loads(path.read_text())
        return Testbed(TestbedSpec(ranks=tuple(state["ranks"]),
                                   links=tuple(LinkSpec(a, b, rate) for a, b, rate in state["links"])), prefix)

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            _ip("netns", "add", host.namespace)
            _ip("link", "add", "eth0", "netns", host.namespace, "type", "veth",
                "peer", "name", f"p{host.index}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{host.index}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{host.index}", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
        for host in self.hosts:
            self._shape(host)

    def _shape(self, host: Host) -> None:
        peers = [(peer, self.spec.rate_between(host.index, peer.index)) for peer in self.hosts if peer is not host]
        shaped = [(peer, rate) for peer, rate in peers if rate is not None]
        if not shaped:
            return
        tc = ["ip", "netns", "exec", host.namespace, "tc"]
        _run([*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1"])
        _run([*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", UNSHAPED])
        for peer, rate in shaped:
            link, data, small = (f"1:{peer.index + offset}" for offset in (10, 110, 210))  # tc reads them as hex
            _run([*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", link, "htb", "rate", f"{int(rate)}bit"])
            for classid, share, priority in ((small, SMALL_SHARE, "0"), (data, 1 - SMALL_SHARE, "1")):
                _run([*tc, "class", "add", "dev", "eth0", "parent", link, "classid", classid, "htb",
                      "rate", f"{int(rate * share)}bit", "ceil", f"{int(rate)}bit", "prio", priority])
            destination = ["match", "ip", "dst", f"{peer.address}/32"]
            _run([*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                  *destination, "match", "u16", "0", "0xff80", "at", "2", "flowid", small])  # IP length < 128
            _run([*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "2", "u32",
                  *destination, "flowid", data])

    def command_in(self, host: int, command: list[str]) -> list[str]:
        """``command`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *command]


def state_file(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}.json"


def down(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace of the testbed ``prefix`` (their veths and qdiscs go with
    them) and its state file; returns the namespaces' names."""
    removed = []
    for name in namespaces(prefix):
        _ip("netns", "delete", name)
        removed.append(name)
    state_file(prefix).unlink(missing_ok=True)
    try:
        STATE_DIR.rmdir()  # the last testbed gone: its directory too
    except OSError:
        pass
    return removed


def status(prefix: str = PREFIX) -> list[str]:
    """One line per namespace of the testbed: its addresses and its qdiscs' classes."""
    lines = []
    for name in namespaces(prefix):
        addresses = [line.split()[3] for line in _ip("-n", name, "-o", "-4", "addr", "show").splitlines()
                     if " lo " not in line]
        classes = _run(["ip", "netns", "exec", name, "tc", "class", "show", "dev", "eth0"]) \
            if name != f"{prefix}-sw" else ""
        rates = []
        for line in classes.splitlines():
            words = line.split()
            if "root" in words and "rate" in words:  # a link's class (its two queues are its children)
                rates.append(f"{words[2]} rate {words[words.index('rate') + 1]}")
        lines.append(f"{name}: {', '.join(addresses) or 'bridge br0'}" + (f"; htb {'; '.join(rates)}" if rates else ""))
    return lines
