"""A cluster as a graph: devices, NICs, hosts and switches joined by full-duplex links.

Every link has a bandwidth (bytes/s, in each direction on its own: a 25 GB/s cable
moves 25 GB/s each way at once) and a latency (s). Ranks map to devices: rank i is
the i-th device of the allocation (by default every device, in declaration order).
A message from rank a to rank b follows the ECMP shortest path of
``plait.cost.routing``; priced alone it costs

    T(n) = alpha + n beta,   alpha = sum of the path's latencies,
                             beta  = 1 / (the path's smallest bandwidth),

and a device that reduces what it receives spends gamma = 1 / reduce_bytes_per_s per
byte. ``plait.cost.simulator`` replays whole schedules with contention on top of this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from plait.cost.link import LinkModel
from plait.cost.routing import Router

__all__ = ["NODE_KINDS", "Node", "Link", "Topology", "node_problems", "link_problems"]

NODE_KINDS = ("device", "nic", "host", "switch")


def _positive_finite(name: str, value, *, allow_none: bool = False, allow_zero: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}={value!r} is not a number"
    if not math.isfinite(value):
        return f"{name}={value!r} is not finite"
    if value < 0 or (value == 0 and not allow_zero):
        return f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}"
    return None


def node_problems(name, kind, host, reduce_bytes_per_s) -> list[str]:
    """What is wrong with a node's fields, each as 'field=value reason' (empty if fine)."""
    problems = []
    if not isinstance(name, str) or not name:
        problems.append(f"name={name!r} must be a non-empty string")
    if kind not in NODE_KINDS:
        problems.append(f"kind={kind!r} is not one of {', '.join(NODE_KINDS)}")
    if host is not None and (not isinstance(host, str) or not host):
        problems.append(f"host={host!r} must be a non-empty string or absent")
    problem = _positive_finite("reduce_bytes_per_s", reduce_bytes_per_s, allow_none=True)
    if problem:
        problems.append(problem + " (bytes a device can reduce per second; leave it out for no cost)")
    elif reduce_bytes_per_s is not None and kind != "device":
        problems.append(f"reduce_bytes_per_s is set on a {kind!r}; only devices reduce")
    return problems


def link_problems(endpoints, bandwidth_bytes_per_s, latency_s) -> list[str]:
    """What is wrong with a link's fields (empty if fine)."""
    problems = []
    if (not isinstance(endpoints, (tuple, list)) or len(endpoints) != 2
            or not all(isinstance(e, str) and e for e in endpoints)):
        problems.append(f"endpoints={endpoints!r} must be two node names")
    elif endpoints[0] == endpoints[1]:
        problems.append(f"endpoints={list(endpoints)!r} join a node to itself")
    problem = _positive_finite("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    if problem:
        problems.append(problem + " (bytes per second in each direction, e.g. 25e9 for 200 Gb/s)")
    problem = _positive_finite("latency_s", latency_s, allow_zero=True)
    if problem:
        problems.append(problem + " (seconds, e.g. 5e-7)")
    return problems


@dataclass(frozen=True, kw_only=True)
class Node:
    """A vertex: a ``device`` (a rank runs on it), a ``nic``, a ``host`` bridge or a
    ``switch``. ``host`` names the machine a device or NIC sits in (ranks on one host
    form one group of ``Topology.hierarchy``); ``reduce_bytes_per_s`` is a device's
    reduction throughput (gamma = 1 / it), None for free reductions."""

    name: str
    kind: str
    host: str | None = None
    reduce_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        problems = node_problems(self.name, self.kind, self.host, self.reduce_bytes_per_s)
        if problems:
            raise ValueError(f"node {self.name!r}: " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class Link:
    """A full-duplex cable: each direction carries ``bandwidth_bytes_per_s`` on its own
    and delays a message by ``latency_s``."""

    endpoints: tuple[str, str]
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, list):
            object.__setattr__(self, "endpoints", tuple(self.endpoints))
        problems = link_problems(self.endpoints, self.bandwidth_bytes_per_s, self.latency_s)
        if problems:
            raise ValueError(f"link {self.endpoints!r}: " + "; ".join(problems))


def _parse_allocation(spec, devices: list[Node], host_order: list[str]) -> tuple[str, ...]:
    """Device names in rank order from None (all), '3+5' (per-host counts, hosts in
    declaration order, first devices of each) or a sequence (or comma list) of names."""
    if spec is None:
        return tuple(d.name for d in devices)
    by_host: dict[str, list[str]] = {}
    for d in devices:
        by_host.setdefault(d.host or d.name, []).append(d.name)
    if isinstance(spec, str):
        text = spec.replace(" ", "")
        if text and all(part.isdigit() for part in text.split("+")):
            counts = [int(part) for part in text.split("+")]
            if len(counts) > len(host_order):
                raise ValueError(
                    f"allocation {spec!r} asks for {len(counts)} hosts but the topology has "
                    f"{len(host_order)} ({', '.join(host_order[:8])}{', ...' if len(host_order) > 8 else ''}); "
                    "give at most one count per host or use more nodes")
            names: list[str] = []
            problems = []
            for index, (count, host) in enumerate(zip(counts, host_order)):
                have = by_host[host]
                if count > len(have):
                    problems.append(f"item {index} asks for {count} devices of host {host!r}, which has {len(have)}")
                names += have[:count]
            if problems:
                raise ValueError(f"allocation {spec!r}: " + "; ".join(problems)
                                 + "; ask for at most as many devices as each host has")
            if not names:
                raise ValueError(f"allocation {spec!r} allocates no device; ask for at least one")
            return tuple(names)
        spec = [part for part in text.split(",") if part]
    names = list(spec)
    known = {d.name for d in devices}
    unknown = [n for n in names if n not in known]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if unknown or repeated or not names:
        raise ValueError(
            f"allocation {names!r}: " + "; ".join(filter(None, [
                f"not devices of this topology: {unknown}" if unknown else "",
                f"named more than once: {repeated}" if repeated else "",
                "empty" if not names else ""]))
            + "; list each device at most once (devices look like "
            + ", ".join(repr(d.name) for d in devices[:3]) + ")")
    return tuple(names)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Nodes, full-duplex links and the devices the ranks run on (in rank order).

    Directed link ``2i`` is ``links[i]`` from ``endpoints[0]`` to ``endpoints[1]`` and
    ``2i+1`` the other way; ``capacity_bytes_per_s`` and ``latency_s`` are indexed by it.
    ``allocation`` may be None (every device), per-host counts like ``"3+5"`` or device
    names; it is stored resolved, as names.
    """

    nodes: tuple[Node, ...]
    links: tuple[Link, ...]
    allocation: tuple[str, ...] | str | None = None
    name: str = "custom"
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _routes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "links", tuple(self.links))
        index: dict[str, int] = {}
        repeated = []
        for i, node in enumerate(self.nodes):
            if not isinstance(node, Node):
                raise TypeError(f"nodes[{i}] is a {type(node).__name__}, not a Node")
            if node.name in index:
                repeated.append(f"nodes[{i}].name={node.name!r} (also nodes[{index[node.name]}])")
            index[node.name] = i
        unknown = []
        for i, link in enumerate(self.links):
            if not isinstance(link, Link):
                raise TypeError(f"links[{i}] is a {type(link).__name__}, not a Link")
            unknown += [f"links[{i}].endpoints[{j}]={end!r}" for j, end in enumerate(link.endpoints)
                        if end not in index]
        if repeated or unknown:
            raise ValueError("topology: " + "; ".join(
                ([f"node names repeat: {', '.join(repeated)}; give every node its own name"] if repeated else [])
                + ([f"links reference unknown nodes: {', '.join(unknown[:10])}"
                    f"{f' and {len(unknown) - 10} more' if len(unknown) > 10 else ''}; "
                    "declare those nodes or fix the names"] if unknown else [])))
        devices = [n for n in self.nodes if n.kind == "device"]
        if not devices:
            raise ValueError("topology has no node of kind 'device'; ranks need devices to run on")
        host_order = list(dict.fromkeys(d.host or d.name for d in devices))
        allocation = _parse_allocation(self.allocation, devices, host_order)
        object.__setattr__(self, "allocation", allocation)
        ends = [(index[l.endpoints[0]], index[l.endpoints[1]]) for l in self.links]
        self._check_connected(devices, index, ends)
        capacity = np.repeat([l.bandwidth_bytes_per_s for l in self.links], 2).astype(np.float64)
        latency = np.repeat([l.latency_s for l in self.links], 2).astype(np.float64)
        rank_nodes = [self.nodes[index[name]] for name in allocation]
        self._index.update(
            node=index, router=Router(len(self.nodes), ends), ends=ends, host_order=host_order,
            capacity=capacity, latency=latency, rank_node=[index[name] for name in allocation],
            rank_host=[n.host or n.name for n in rank_nodes],
            rank_gamma=[0.0 if n.reduce_bytes_per_s is None else 1.0 / n.reduce_bytes_per_s
                        for n in rank_nodes])

    def _check_connected(self, devices, index, ends) -> None:
        parent = list(range(len(self.nodes)))

        def root(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for a, b in ends:
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[ra] = rb
        components: dict[int, list[str]] = {}
        for d in devices:
            components.setdefault(root(index[d.name]), []).append(d.name)
        if len(components) > 1:
            parts = list(components.values())
            shown = "; ".join(
                "{" + ", ".join(p[:4]) + (f", ... ({len(p)} devices)" if len(p) > 4 else "") + "}"
                for p in parts[:4])
            raise ValueError(
                f"topology {self.name!r} is disconnected: devices {parts[0][0]!r} and {parts[1][0]!r} "
                f"cannot reach each other ({len(parts)} separate groups: {shown}"
                f"{' ...' if len(parts) > 4 else ''}); add links that join them")

    # ----- ranks and groups --------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.allocation)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Host names in declaration order (a device without a host is its own host)."""
        return tuple(self._index["host_order"])

    def device(self, rank: int) -> Node:
        return self.nodes[self._index["rank_node"][self._check_rank(rank)]]

    def host_of(self, rank: int) -> str:
        return self._index["rank_host"][self._check_rank(rank)]

    def gamma_s_per_byte(self, rank: int) -> float:
        """1 / the rank's device reduction throughput (0 when it reduces for free)."""
        return self._index["rank_gamma"][self._check_rank(rank)]

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size}) of topology {self.name!r}; "
                             "allocate more devices or use a smaller world")
        return rank

    def with_allocation(self, allocation) -> "Topology":
        """The same cluster with other devices allocated (see the class docstring)."""
        return replace(self, allocation=allocation)

    def hierarchy(self) -> tuple[tuple[int, ...], ...]:
        """Ranks grouped by host, hosts in order of their first rank: the spec
        ``build_schedule(..., "hierarchical", hierarchy=...)`` takes."""
        groups: dict[str, list[int]] = {}
        for rank, host in enumerate(self._index["rank_host"]):
            groups.setdefault(host, []).append(rank)
        return tuple(tuple(g) for g in groups.values())

    # ----- paths -----------------------------------------------------------------------------
    @property
    def num_directed_links(self) -> int:
        return 2 * len(self.links)

    @property
    def capacity_bytes_per_s(self) -> np.ndarray:
        """Bandwidth of each directed link (read-only view)."""
        view = self._index["capacity"].view()
        view.flags.writeable = False
        return view

    @property
    def latency_s(self) -> np.ndarray:
        view = self._index["latency"].view()
        view.flags.writeable = False
        return view

    def link_name(self, link_id: int) -> str:
        """'a -> b' for a directed link id."""
        a, b = self.links[link_id // 2].endpoints
        return f"{a} -> {b}" if link_id % 2 == 0 else f"{b} -> {a}"

    def route(self, src_rank: int, dst_rank: int) -> tuple[int, ...]:
        """Directed link ids from ``src_rank``'s device to ``dst_rank``'s (shortest by hops,
        ECMP among equals; cached)."""
        key = (src_rank, dst_rank)
        path = self._routes.get(key)
        if path is None:
            nodes = self._index["rank_node"]
            path = self._index["router"].path(nodes[self._check_rank(src_rank)], nodes[self._check_rank(dst_rank)])
            self._routes[key] = path
        return path

    def link_model(self, src_rank: int, dst_rank: int) -> LinkModel:
        """alpha = sum of latencies on the route, beta = 1 / its bottleneck bandwidth,
        gamma = the receiving device's 1 / reduce_bytes_per_s."""
        path = self.route(src_rank, dst_rank)
        if not path:
            raise ValueError(f"ranks {src_rank} and {dst_rank} are the same device; a link model needs two")
        ids = np.asarray(path)
        return LinkModel(float(self._index["latency"][ids].sum()),
                         1.0 / float(self._index["capacity"][ids].min()),
                         self.gamma_s_per_byte(dst_rank))

    def level_link_models(self) -> tuple[LinkModel, LinkModel]:
        """(between hosts, within a host): the slowest pair of each level, outermost first,
        as ``predict_time_s("all_reduce", "hierarchical", ..., link=[...])`` takes them.

        Within: consecutive ranks of each host. Between: ranks with the same local index
        on consecutive hosts (the pairs the hierarchical all-reduce's outer rings use).
        With one host both are the within-host link; with one rank per host both are
        the between-host link. "Slowest" is the largest alpha, beta and gamma separately.
        """
        groups = self.hierarchy()
        inner = [(g[i], g[i + 1]) for g in groups for i in range(len(g) - 1)]
        outer = [(a[j], b[j]) for a, b in zip(groups, groups[1:]) for j in range(min(len(a), len(b)))]

        def worst(pairs) -> LinkModel | None:
            if not pairs:
                return None
            models = [self.link_model(a, b) for a, b in pairs]
            return LinkModel(max(m.alpha_s for m in models), max(m.beta_s_per_byte for m in models),
                             max(m.gamma_s_per_byte for m in models))

        within, between = worst(inner), worst(outer)
        if within is None and between is None:
            raise ValueError(f"topology {self.name!r} allocates a single rank; levels need two")
        return (between or within, within or between)

    def summary(self) -> str:
        """One line: name, counts, ranks per host."""
        kinds = {k: sum(1 for n in self.nodes if n.kind == k) for k in NODE_KINDS}
        sizes = [len(g) for g in self.hierarchy()]
        per_host = f"{sizes[0]} per host" if len(set(sizes)) == 1 else "+".join(map(str, sizes))
        return (f"{self.name}: {self.world_size} ranks on {len(sizes)} hosts ({per_host}); "
                + ", ".join(f"{v} {k}{'es' if k == 'switch' else 's'}" for k, v in kinds.items() if v)
                + f", {len(self.links)} links")
