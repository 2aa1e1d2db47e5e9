"""A cluster for the planner: nodes of identical devices, and the price of a collective
on any process group of a (tp, dp, pp) layout.

Links come from plait.cost's topology presets (``level_link_models``: the slowest
pair within a node and between nodes, as alpha-beta-gamma models). Every device has
its own NIC in the DGX presets, so the groups that run at once in a layout (all tp
groups, or all dp groups) do not share a port; a group's collective is priced alone
with the closed forms of plait.cost.alpha_beta, taking the cheapest algorithm
plait implements (flat on the slowest link the group crosses, or hierarchical:
reduce-scatter within nodes, all-reduce between, all-gather within), as plait's
tuner would.

Ranks are laid out tp innermost, then dp, then pp (``plait.parallel.mesh``'s default
order "tp,dp,pp"): the tp group of a rank is tp consecutive ranks, its dp group
ranks tp apart, its pp group ranks tp·dp apart; rank r sits on node r // devices_per_node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from plait.cost import LinkModel
from plait.cost.alpha_beta import closed_form_algorithms, level_terms, pipeline_segments
from plait.cost.presets import preset
from plait.cost.transport_model import TransportModel
from plait.plan.device import device_preset, DeviceSpec
from plait.plan.host import HostModel

__all__ = ["Cluster", "CLUSTER_PRESETS", "cluster_preset", "GroupShape", "MAX_DEVICES", "check_count", "topology_cluster"]

# The most devices a cluster may have: 16x the largest cluster built so far, and where the
# search's divisor enumeration (O(sqrt devices)) still takes milliseconds.
MAX_DEVICES = 1 << 24

# algorithms priced for each collective: plait's own with a closed form, less the naive
# direct and star exchanges and the single binary tree (the double binary tree, as NCCL
# runs it, has the same depth at half the per-link load); all_to_all (nbytes: the input
# buffer of p chunks) is the pairwise exchange, (p-1)a + (p-1)/p n b
_CANDIDATES = {c: [a for a in closed_form_algorithms(c) if a not in ("direct", "star", "binary_tree")]
               for c in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")}
# on one host (the 'local' cluster, a handful of ranks) plait's tuner also runs the
# direct and star exchanges, and often picks star: price them there too
_LOCAL_CANDIDATES = {c: [a for a in closed_form_algorithms(c) if a != "binary_tree"]
                     for c in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")}


@dataclass(frozen=True)
class GroupShape:
    """A process group's footprint: ``size`` ranks, ``per_node`` of them on each of
    ``nodes`` nodes."""

    size: int
    per_node: int
    nodes: int


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` nodes of ``devices_per_node`` identical devices; ``intra_link`` within
    a node, ``inter_link`` between nodes (per device), ``call_overhead_s`` the fixed
    software cost of one collective call, ``p2p_call_s`` that of one pipeline message
    (None: ``call_overhead_s``; a fitted transport prices a p2p exchange ~10x below a
    collective call), ``host`` how the ranks share a host's cores (None: one device per
    rank, no time-slicing; ``plait.plan.host``).

    ``transport``: the calibration profile's fitted transport model (format 2,
    ``plait.cost.transport_model``). With one, a collective within a node costs
    call_s[K] + closed form on the link at beta(n) (``TransportModel.link_at``, the
    pricing of ``plait bench --predict``), and a message between pipeline neighbours on
    one node call_s[p2p] + n beta(n) (``TransportModel.p2p_time_s``); groups and messages
    crossing nodes keep the flat links. None (a format-1 profile, a GPU preset): the
    flat ``intra_link``/``inter_link`` and ``call_overhead_s``."""

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_link: LinkModel
    inter_link: LinkModel
    call_overhead_s: float = 0.0
    link_source: str = ""
    host: HostModel | None = None
    p2p_call_s: float | None = None
    transport: TransportModel | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("nodes", "devices_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be a whole number >= 1")
        for key in ("call_overhead_s", "p2p_call_s"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{key}={value!r} must be a finite number of seconds >= 0")
        if self.transport is not None and not isinstance(self.transport, TransportModel):
            raise TypeError(f"transport={self.transport!r} must be a plait.cost.transport_model.TransportModel or None")
        if self.world_size > MAX_DEVICES:
            raise ValueError(f"nodes({self.nodes:,}) * devices_per_node({self.devices_per_node}) = "
                             f"{self.world_size:,} devices is above the limit of {MAX_DEVICES:,}: plan a part of "
                             "the cluster (the same layout repeats over identical parts)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def describe(self) -> str:
        return (f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} {self.device.name} = "
                f"{self.world_size} devices; within a node {_link_text(self.intra_link)}, between nodes "
                f"{_link_text(self.inter_link)}")

    def group_shape(self, size: int, stride: int) -> GroupShape:
        """The footprint of the groups of ``size`` ranks ``stride`` apart that tile the
        cluster (ranks base + i·stride, the way plait.parallel.mesh builds a tp, dp or pp
        group): the group spanning the most nodes, and the fewest of its ranks on one
        node; ``per_node`` is 1 when its ranks are not spread evenly over its nodes (no
        uniform hierarchy then: it is priced flat on the slowest link).

        Moving a base by whole nodes moves every rank's node alike, so a group's
        footprint depends on its base only modulo the node size: one group per residue
        is measured (``_footprint``, O(node size) each), never all the world's ranks."""
        if size == 1:
            return GroupShape(1, 1, 1)
        key = ("shape", size, stride)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        worst = GroupShape(size, size, 1)
        world, slots = self.world_size, self.devices_per_node
        if self.nodes == 1:
            residues = [0]  # every group sits on the one node
        elif size * stride <= world and world % (size * stride) == 0:
            residues = _base_residues(world // (size * stride), size * stride, stride, slots)
        else:  # not a tiling of this cluster: the first group alone
            residues = [0]
        for base in residues:
            nodes, per_node, even = _footprint(base, size, stride, slots)
            shape = GroupShape(size, per_node if even else 1, nodes)
            if (shape.nodes, -shape.per_node) > (worst.nodes, -worst.per_node):
                worst = shape
        self._remember(key, worst)
        return worst

    def _remember(self, key, value) -> None:
        """Cache ``value``; beyond ``_CACHE_ENTRIES`` the oldest entry goes, so a long
        search holds a bounded cache (what it evicts is only recomputed)."""
        if len(self._cache) >= _CACHE_ENTRIES:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = value

    def collective_time_s(self, collective: str, nbytes: float, size: int, stride: int) -> tuple[float, str]:
        """(seconds, algorithm) of the cheapest plait algorithm for ``collective`` on
        ``nbytes`` over a group of ``size`` ranks ``stride`` apart, call overhead included."""
        if size == 1 or nbytes <= 0:
            return 0.0, "none"
        key = (collective, float(nbytes), size, stride)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        shape = self.group_shape(size, stride)
        flat_link = self.inter_link if shape.nodes > 1 else self.intra_link
        call_s = self.call_overhead_s
        if self.transport is not None and shape.nodes == 1:  # the fitted transport: beta(n), this kind's call cost
            flat_link, call_s = self.transport.link_at(nbytes), self.transport.call_overhead_s(collective)
        best = (math.inf, "none")
        segments = pipeline_segments(int(nbytes))
        for algorithm in (_LOCAL_CANDIDATES if self.name == "local" else _CANDIDATES)[collective]:
            if algorithm == "hierarchical":
                if collective != "all_reduce" or shape.nodes == 1 or shape.per_node == 1 \
                        or shape.nodes * shape.per_node != size:
                    continue
                links, hierarchy = [self.inter_link, self.intra_link], f"{shape.nodes}x{shape.per_node}"
            else:
                links, hierarchy = [flat_link], None
            seconds = sum(terms.time_s(links[level])
                          for level, terms in _unit_terms(collective, algorithm, size, segments, hierarchy, nbytes))
            if seconds < best[0]:
                best = (seconds, algorithm)
        result = (best[0] + call_s, best[1])
        self._remember(key, result)
        return result

    def sync_wait_s(self, size: int, segment_s: float) -> float:
        """The wait for the slowest of ``size`` ranks at one synchronising call after
        ``segment_s`` seconds of compute (``HostModel.wait_s``; 0 without a host model)."""
        if self.host is None or size <= 1:
            return 0.0
        return self.host.wait_s(size, segment_s)

    def p2p_time_s(self, nbytes: float, crosses_node: bool) -> float:
        """One message between pipeline neighbours on the link it takes:

        - with a ``transport`` and within a node: call_s[p2p] + n·beta(n)
          (``TransportModel.p2p_time_s``);
        - with ``p2p_call_s`` (a fitted exchange's fixed cost, latency included: no alpha):
          p2p_call_s + n·beta, plus, crossing nodes, the latency the inter-node link has
          beyond the intra-node one (inter alpha − intra alpha, >= 0);
        - else alpha + n·beta + ``call_overhead_s``."""
        if nbytes <= 0:
            return 0.0
        if self.transport is not None and not crosses_node:
            return self.transport.p2p_time_s(nbytes)
        link = self.inter_link if crosses_node else self.intra_link
        if self.p2p_call_s is None:
            return link.alpha_s + nbytes * link.beta_s_per_byte + self.call_overhead_s
        extra_latency_s = max(0.0, link.alpha_s - self.intra_link.alpha_s)
        return self.p2p_call_s + extra_latency_s + nbytes * link.beta_s_per_byte


# priced collectives and group shapes one Cluster keeps (a few hundred bytes each)
_CACHE_ENTRIES = 1 << 14


def _base_residues(blocks: int, block_ranks: int, stride: int, slots: int) -> list[int]:
    """The residues modulo ``slots`` of the group bases block·block_ranks + offset
    (block < ``blocks``, offset < ``stride``). block·block_ranks mod slots repeats
    with a period of at most ``slots`` blocks, an offset's residue is the offset's own
    below ``slots``: O(slots²) at most, whatever the world size."""
    block_residues = {block * block_ranks % slots for block in range(min(blocks, slots))}
    if stride >= slots:
        return list(range(slots))
    residues: set[int] = set()
    for first in sorted(block_residues):
        residues.update((first + offset) % slots for offset in range(stride))
        if len(residues) == slots:
            break
    return sorted(residues)


def _footprint(base: int, size: int, stride: int, slots: int) -> tuple[int, int, bool]:
    """(nodes, fewest ranks on one of them, all nodes equal?) of the ranks base +
    i·stride, i < size, on nodes of ``slots`` ranks. With stride >= slots each rank has
    a node of its own. Otherwise every node from the first to the last holds some, and
    a node n holds the i with n·slots <= base + i·stride < (n+1)·slots; between the two
    ends that count repeats every lcm(slots, stride) / slots nodes (< stride), so the
    ends and one period of the middle are all the counts there are."""
    if stride >= slots:
        return size, 1, True
    first, last = base // slots, (base + (size - 1) * stride) // slots
    span = size * stride

    def held(node: int) -> int:
        low = max(node * slots - base, 0)
        high = min((node + 1) * slots - base, span)
        return -(-high // stride) - -(-low // stride)

    period = math.lcm(slots, stride) // slots
    counts = {held(first), held(last)} | {held(node) for node in range(first + 1, min(first + period, last - 1) + 1)}
    return last - first + 1, min(counts), len(counts) == 1


@lru_cache(maxsize=4096)
def _reference_terms(collective: str, algorithm: str, size: int, segments: int, hierarchy: str | None):
    return level_terms(collective, algorithm, _REFERENCE_NBYTES, size, hierarchy=hierarchy, segments=segments)


_REFERENCE_NBYTES = float(1 << 40)
_EXACT_BELOW_NBYTES = 1 << 20


def _unit_terms(collective: str, algorithm: str, size: int, segments: int, hierarchy: str | None, nbytes: float):
    """plait.cost.alpha_beta's (level, terms) for ``nbytes``. For a fixed segment count
    every closed form's rounds are independent of n and its beta and gamma bytes are
    proportional to n, so the terms are computed once per (collective, algorithm, p,
    segments, hierarchy) at a reference size and scaled: the double binary tree's
    closed form walks every segment of every rank, which at p = 384 costs ~0.1 s a call.
    (The double binary tree splits n into whole bytes, floor(n/2) and the rest: below
    1 MiB, where that rounding is visible and the walk is short, terms are exact.)"""
    if nbytes < _EXACT_BELOW_NBYTES:
        return level_terms(collective, algorithm, nbytes, size, hierarchy=hierarchy, segments=segments)
    scale = nbytes / _REFERENCE_NBYTES
    return [(level, type(terms)(terms.rounds, terms.beta_bytes * scale, terms.gamma_bytes * scale))
            for level, terms in _reference_terms(collective, algorithm, size, segments, hierarchy)]


def _link_text(link: LinkModel) -> str:
    return f"{link.alpha_s * 1e6:.3g} us + {1e-9 / link.beta_s_per_byte:.4g} GB/s"


@lru_cache(maxsize=None)
def _preset_links(topology: str) -> tuple[LinkModel, LinkModel, str]:
    # two nodes carry every link kind of the (non-blocking) fabric: the links of a
    # 1,024-GPU cluster are the same models
    between, within = preset(topology, nodes=2).level_link_models()
    return within, between, f"plait.cost.presets {topology!r}"


CLUSTER_PRESETS = {
    "dgx-a100": ("dgx-a100", "a100-80gb"),
    "dgx-a100-40gb": ("dgx-a100", "a100-40gb"),
    "dgx-h100": ("dgx-h100", "h100-80gb"),
    "dgx-h200": ("dgx-h100", "h200-141gb"),
    "local": None,
}


def cluster_preset(name: str, *, gpus: int | None = None, nodes: int | None = None, nprocs: int | None = None,
                   device: DeviceSpec | None = None, local_link: LinkModel | None = None,
                   call_overhead_s: float = 0.0, link_source: str = "", host: HostModel | None = None,
                   p2p_call_s: float | None = None, transport: TransportModel | None = None) -> Cluster:
    """A cluster by name. DGX presets have 8 GPUs per node: give ``gpus`` (a multiple
    of 8) or ``nodes``. ``local`` is this machine: ``nprocs`` processes on one node,
    ``device`` the measured per-process DeviceSpec, ``local_link`` the calibrated link,
    ``host`` how those processes share its cores (``plait.plan.host.HostModel``; its
    ``ranks`` must be ``nprocs``), ``p2p_call_s`` a pipeline message's software cost (None:
    ``call_overhead_s``), ``transport`` the profile's fitted transport model (``Cluster``).
    A DGX preset has a device per rank: no host model, no transport model."""
    if name not in CLUSTER_PRESETS:
        raise ValueError(f"unknown cluster {name!r}; valid: {', '.join(CLUSTER_PRESETS)}")
    if name == "local":
        count = nprocs if nprocs is not None else gpus
        if count is None:
            raise ValueError("cluster 'local' needs --nprocs N (processes on this machine)")
        check_count("nprocs", count, most=MAX_DEVICES)
        if device is None or local_link is None:
            raise ValueError("cluster 'local' needs a measured device and a link (plait.plan.local_cluster builds both)")
        _check_host(host, count)
        return Cluster(name="local", nodes=1, devices_per_node=count, device=device, intra_link=local_link,
                       inter_link=local_link, call_overhead_s=call_overhead_s, link_source=link_source, host=host,
                       p2p_call_s=p2p_call_s, transport=transport)
    if transport is not None:
        raise ValueError(f"transport= is for cluster 'local' (a calibrated transport of this machine); {name!r} "
                         "prices its preset links: leave transport out")
    if host is not None:
        raise ValueError(f"host= is for cluster 'local' (ranks sharing this machine's cores); {name!r} has a "
                         "device per rank: leave host out")
    topology, device_name = CLUSTER_PRESETS[name]
    per_node = 8
    if gpus is None and nodes is None:
        raise ValueError(f"cluster {name!r} needs --gpus N (a multiple of {per_node}) or --nodes N")
    if gpus is not None:
        check_count("gpus", gpus, most=MAX_DEVICES)
        if gpus % per_node and gpus > per_node:
            raise ValueError(f"gpus={gpus} is not a whole number of {name} nodes ({per_node} GPUs each): use "
                             f"{gpus // per_node * per_node} or {(gpus // per_node + 1) * per_node}")
        if nodes is not None and nodes * per_node != gpus:
            raise ValueError(f"gpus={gpus} and nodes={nodes} disagree: {nodes} {name} nodes hold {nodes * per_node} GPUs")
    if nodes is not None:
        check_count("nodes", nodes, most=MAX_DEVICES // per_node)
    within, between, source = _preset_links(topology)
    spec = device or device_preset(device_name)
    if gpus is not None and gpus < per_node:  # part of one node
        return Cluster(name=name, nodes=1, devices_per_node=gpus, device=spec, intra_link=within, inter_link=between,
                       call_overhead_s=call_overhead_s, link_source=source, p2p_call_s=p2p_call_s)
    count = nodes if nodes is not None else gpus // per_node
    return Cluster(name=name, nodes=count, devices_per_node=per_node, device=spec, intra_link=within,
                   inter_link=between, call_overhead_s=call_overhead_s, link_source=source, p2p_call_s=p2p_call_s)


def check_count(name: str, value, most: int | None = None) -> None:
    """A count of devices, nodes or processes: a whole number in [1, ``most``]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a whole number >= 1")
    if most is not None and value > most:
        raise ValueError(f"{name}={value:,} is above the limit of {most:,} ({MAX_DEVICES:,} devices): plan a part "
                         "of the cluster (the same layout repeats over identical parts)")


def _check_host(host: HostModel | None, nprocs: int) -> None:
    """A host model for ``nprocs`` ranks: its ``ranks`` must be the cluster's."""
    if host is None:
        return
    if not isinstance(host, HostModel):
        raise TypeError(f"host={host!r} must be a plait.plan.host.HostModel or None")
    if host.ranks != nprocs:
        raise ValueError(f"host.ranks={host.ranks} != nprocs={nprocs}: the host model must describe the ranks "
                         f"the plan runs (HostModel.for_ranks({nprocs}) rescales it)")


def topology_cluster(topology, *, nprocs: int, device: DeviceSpec, local_link: LinkModel, call_overhead_s: float,
                     link_source: str, host: HostModel | None = None, p2p_call_s: float | None = None,
                     transport: TransportModel | None = None) -> Cluster:
    """This machine's ranks grouped into the hosts of ``topology`` (e.g. `plait testbed
    probe`'s, whose hosts share this machine's cores): within a host ``local_link``
    (the calibrated one), between hosts the topology's slowest host pair, its latency
    added to the local link's per-message cost; ``host`` how all ``nprocs`` ranks share
    this machine's cores (as in ``cluster_preset('local', host=...)``), ``transport`` the
    calibrated transport within a host (``Cluster``)."""
    groups = topology.hierarchy()
    sizes = {len(group) for group in groups}
    if topology.world_size != nprocs or len(sizes) != 1:
        raise ValueError(f"topology {topology.name!r} places {topology.world_size} ranks as "
                         f"{'+'.join(str(len(g)) for g in groups)} per host; the plan needs --nprocs {nprocs} ranks "
                         "in hosts of equal size")
    between, _ = topology.level_link_models()
    inter = LinkModel(local_link.alpha_s + between.alpha_s, max(between.beta_s_per_byte, local_link.beta_s_per_byte),
                      local_link.gamma_s_per_byte)
    _check_host(host, nprocs)
    return Cluster(name="local", nodes=len(groups), devices_per_node=sizes.pop(), device=device,
                   intra_link=local_link, inter_link=inter, call_overhead_s=call_overhead_s, link_source=link_source,
                   host=host, p2p_call_s=p2p_call_s, transport=transport)
