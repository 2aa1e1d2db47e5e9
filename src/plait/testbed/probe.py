"""`plait testbed probe`: every pair of hosts' bandwidth and latency, and every host's
own (ranks on one host talk through the kernel's local delivery), measured with TCP
(``plait.testbed.measure``), written as a plait topology (Blink's "profiled
topology"): per host a ``host`` node with its ranks as devices, each device linked to
it at the host's own rate and latency, and one link between every two hosts at the
measured rate and latency. Every rank pair on two given hosts shares their link, so
measuring host pairs measures every rank pair."""

from __future__ import annotations

from dataclasses import dataclass

from plait.cost.topology import Link, Node, Topology
from plait.testbed.measure import tcp_latency_s, tcp_rate_bits_per_s
from plait.testbed.netns import Testbed

# htb sends a packet whenever its bucket is not empty, so a stream can run ahead of the
# rate by one packet: 64 KiB with the veth's segmentation offload. Over at least 2 MiB
# that is at most 1/32 of the bytes, which keeps the payload rate (1448 of every 1514
# bytes on the wire) under the link's rate.
FIRST_PROBE_BYTES = 2 << 20
TARGET_SECONDS = 0.5  # each rate is measured over about this long
MAX_PROBE_BYTES = 256 << 20


@dataclass(frozen=True)
class Measured:
    """One host pair (a == b: a host with itself)."""

    a: int
    b: int
    bytes_per_s: float
    latency_s: float


def _rate_bytes_per_s(testbed: Testbed, a: int, b: int) -> float:
    """A first short stream sizes a second one to last about TARGET_SECONDS."""
    first = tcp_rate_bits_per_s(testbed, a, b, FIRST_PROBE_BYTES) / 8
    nbytes = int(min(max(first * TARGET_SECONDS, FIRST_PROBE_BYTES), MAX_PROBE_BYTES))
    return tcp_rate_bits_per_s(testbed, a, b, nbytes) / 8


def probe(testbed: Testbed) -> list[Measured]:
    """Every host with itself and every pair of hosts (one direction: the links are
    shaped alike both ways)."""
    count = len(testbed.hosts)
    return [Measured(a, b, _rate_bytes_per_s(testbed, a, b), tcp_latency_s(testbed, a, b))
            for a in range(count) for b in range(a, count)]


def profiled_topology(testbed: Testbed, measured: list[Measured]) -> Topology:
    nodes, links = [], []
    for host in testbed.hosts:
        name = f"h{host.index}"
        nodes.append(Node(name=name, kind="host", host=name))
        nodes += [Node(name=f"{name}.r{rank}", kind="device", host=name) for rank in range(host.ranks)]
    for entry in measured:
        if entry.a == entry.b:
            links += [Link(endpoints=(f"h{entry.a}.r{rank}", f"h{entry.a}"), bandwidth_bytes_per_s=entry.bytes_per_s,
                           latency_s=entry.latency_s / 2) for rank in range(testbed.hosts[entry.a].ranks)]
        else:
            links.append(Link(endpoints=(f"h{entry.a}", f"h{entry.b}"), bandwidth_bytes_per_s=entry.bytes_per_s,
                              latency_s=entry.latency_s))
    return Topology(nodes=nodes, links=links, name=f"testbed-{testbed.prefix}")
