"""Topologies the tests of the topology algorithms share: the testbed's profiled shape."""

from plait.cost.topology import Link, Node, Topology

SLOW_BYTES_PER_S = 12.5e6  # 100 Mbit/s between hosts
LOCAL_BYTES_PER_S = 1e9


def hosts(ranks_per_host, between, *, latency_s=1e-4, local_bytes_per_s=LOCAL_BYTES_PER_S):
    """The testbed's profiled shape: host node h<i>, its ranks h<i>.r<k> on fast local
    links, and the given links {(host a, host b): bytes/s} between hosts."""
    nodes, links = [], []
    for h, count in enumerate(ranks_per_host):
        nodes.append(Node(name=f"h{h}", kind="host", host=f"h{h}"))
        for r in range(count):
            nodes.append(Node(name=f"h{h}.r{r}", kind="device", host=f"h{h}"))
            links.append(Link(endpoints=(f"h{h}.r{r}", f"h{h}"), bandwidth_bytes_per_s=local_bytes_per_s,
                              latency_s=latency_s / 2))
    links += [Link(endpoints=(f"h{a}", f"h{b}"), bandwidth_bytes_per_s=rate, latency_s=latency_s)
              for (a, b), rate in between.items()]
    return Topology(nodes=nodes, links=links, name="hosts" + "+".join(map(str, ranks_per_host)))
