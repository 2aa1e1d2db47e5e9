"""What a testbed is made of: hosts (network namespaces), how many ranks each runs,
and the rate of the link between each pair of hosts.

Every host has one address, ``198.18.0.<host + 1>`` (198.18.0.0/15 is reserved for
benchmarking, RFC 2544), on a veth whose other end is a port of one bridge (the
switch, in a namespace of its own). A pair of hosts without a link spec talks at the
veth's own speed; a ``LinkSpec`` caps the rate between two hosts in both directions.
Delay is not offered: it needs the kernel's netem qdisc, and this machine's kernel
has none (``tc qdisc add ... netem`` answers "Specified qdisc kind is unknown").
"""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass
from pathlib import Path

# torchrun's c10d rendezvous numbers the agents in the order of their addresses as
# strings; up to 9 hosts (198.18.0.1 .. 198.18.0.9) that is host order, so host h runs
# a consecutive block of ranks, which the probed topology's devices follow.
MAX_HOSTS = 9
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
# tc keeps a rate as bytes per second in 64 bits: `tc class add ... rate 147573952589676412920bit`
# (8 * (2**64 - 1)) answers '"rate" is required', one below is taken
MAX_RATE_BITS_PER_S = 8 * (2**64 - 1)


def parse_rate(text: str) -> float:
    """'100mbit' -> 1e8 bits per second (tc's decimal units)."""
    match = _RATE.match(text.strip().lower())
    rate = float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
    if not 0 < rate < MAX_RATE_BITS_PER_S:
        raise ValueError(f"rate {text!r} is not a rate tc takes: give a positive number below "
                         f"{MAX_RATE_BITS_PER_S:.4g} bit/s and one of {', '.join(_UNITS)}, e.g. 100mbit")
    return rate


@dataclass(frozen=True)
class LinkSpec:
    """The rate between hosts ``a`` and ``b`` (each direction), in bits per second."""

    a: int
    b: int
    rate_bits_per_s: float

    @staticmethod
    def parse(text: str) -> LinkSpec:
        """'0-1:rate=100mbit' (hosts by index)."""
        match = re.match(r"^(\d+)-(\d+):(.*)$", text.strip())
        if not match:
            raise ValueError(f"--link {text!r}: write A-B:rate=RATE with host indices, e.g. 0-1:rate=100mbit")
        options = dict(part.split("=", 1) for part in match.group(3).split(",") if "=" in part)
        unknown = sorted(set(options) - {"rate"})
        if unknown or "rate" not in options:
            extra = ("; delay needs the kernel's netem qdisc, which this kernel lacks" if "delay" in unknown else "")
            raise ValueError(f"--link {text!r}: give rate=RATE only (unknown: {', '.join(unknown) or 'none'}; "
                             f"rate {'missing' if 'rate' not in options else 'given'}){extra}")
        return LinkSpec(int(match.group(1)), int(match.group(2)), parse_rate(options["rate"]))


@dataclass(frozen=True)
class TestbedSpec:
    """Hosts with ``ranks[i]`` ranks each, and the shaped links between them."""

    __test__ = False  # not a pytest test class, whatever its name

    ranks: tuple[int, ...]
    links: tuple[LinkSpec, ...] = ()

    @property
    def hosts(self) -> int:
        return len(self.ranks)

    def problems(self) -> list[str]:
        found = []
        if not 2 <= self.hosts <= MAX_HOSTS:
            found.append(f"{self.hosts} hosts: a testbed has 2 to {MAX_HOSTS}")
        if any(count < 1 for count in self.ranks):
            found.append(f"ranks per host {list(self.ranks)}: every host runs at least one rank")
        pairs = set()
        for link in self.links:
            if not (0 <= link.a < self.hosts and 0 <= link.b < self.hosts) or link.a == link.b:
                found.append(f"link {link.a}-{link.b}: hosts are numbered 0 to {self.hosts - 1}, and a link joins "
                             "two different ones")
            pair = frozenset((link.a, link.b))
            if pair in pairs:
                found.append(f"link {link.a}-{link.b} is given twice")
            pairs.add(pair)
        return found

    def rate_between(self, a: int, b: int) -> float | None:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link.rate_bits_per_s
        return None


def host_address(host: int) -> str:
    return f"198.18.0.{host + 1}"


PRESETS = {
    # 2 hosts x 2 ranks, 100 Mbit between them (loopback inside each)
    "2x2-slow": TestbedSpec(ranks=(2, 2), links=(LinkSpec(0, 1, 100e6),)),
    # Blink's partial allocation: 3 ranks on one server, 5 on another, a slow link between
    "partial-3+5": TestbedSpec(ranks=(3, 5), links=(LinkSpec(0, 1, 200e6),)),
    # a ring of 3 hosts x 2 ranks, one of its links 4x slower: h0-h1 and h1-h2 at 200
    # Mbit, h2-h0 at 50 Mbit. Three hosts are each other's neighbours, so every pair has
    # its own link and no host forwards (a bridge with per-destination shaping is exact).
    "ring-one-slow": TestbedSpec(ranks=(2, 2, 2), links=(LinkSpec(0, 1, 200e6), LinkSpec(1, 2, 200e6),
                                                         LinkSpec(0, 2, 50e6))),
}


def spec_from(preset: str | None, hosts: int | None, ranks_per_host: int | None, links: list[str]) -> TestbedSpec:
    """The spec the flags of `plait testbed up` describe (a preset, or hosts and links)."""
    if preset is not None:
        if hosts is not None or ranks_per_host is not None or links:
            raise ValueError("--preset names the whole testbed: leave out --hosts, --ranks-per-host and --link")
        if preset not in PRESETS:
            raise ValueError(f"--preset {preset!r} is unknown; presets: {', '.join(PRESETS)}")
        return PRESETS[preset]
    if hosts is None:
        raise ValueError("give --preset NAME, or --hosts H [--ranks-per-host R] [--link A-B:rate=RATE ...]")
    if not 2 <= hosts <= MAX_HOSTS:  # before the ranks tuple is built from it
        raise ValueError(f"--hosts {hosts}: a testbed has 2 to {MAX_HOSTS} hosts")
    ranks = 1 if ranks_per_host is None else ranks_per_host  # 0 is a value to refuse, not "unset"
    limit = max_processes()
    if ranks < 1 or ranks * hosts > limit:
        raise ValueError(f"--ranks-per-host {ranks}: every host runs 1 to {limit // hosts} ranks ({hosts} hosts; "
                         f"each rank is a process, and this machine starts at most {limit:,}: "
                         "kernel.pid_max and RLIMIT_NPROC)")
    spec = TestbedSpec(ranks=(ranks,) * hosts, links=tuple(LinkSpec.parse(text) for text in links))
    problems = spec.problems()
    if problems:
        raise ValueError("; ".join(problems))
    return spec


def max_processes() -> int:
    """How many processes this machine can run at once, at most: the kernel's pid_max,
    lowered by this user's RLIMIT_NPROC (a testbed's ranks are processes of it)."""
    try:
        limit = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        limit = 32768  # the kernel's default pid_max
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    return limit if soft == resource.RLIM_INFINITY else min(limit, soft)
