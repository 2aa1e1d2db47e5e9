"""The algorithm registry: name -> collective -> schedule builder.

A builder is ``build(world_size, buffer_numel, root, options) -> list[Step]``; its
docstring gives the steps, bytes and alpha-beta cost. :func:`build_schedule` turns
it into a validated, cached :class:`~plait.comm.schedule.Schedule`.
"""

from __future__ import annotations

from functools import lru_cache

from plait.comm.algorithms import blink, bruck, butterfly, direct, hierarchical, ring, synth, tree
from plait.comm.schedule import Schedule, make_schedule
from plait.cost.topology import Topology
from plait.cost.topology_io import topology_fingerprint
from plait.names.collectives import COLLECTIVES, REDUCING, ROOTED

ALGORITHMS: dict[str, dict] = {
    "direct": direct.DIRECT_BUILDERS,
    "star": direct.STAR_BUILDERS,
    "ring": ring.BUILDERS,
    "tree": tree.BUILDERS,
    "binary_tree": tree.BINARY_BUILDERS,
    "double_binary_tree": tree.DOUBLE_BINARY_BUILDERS,
    "recursive_doubling": butterfly.RECURSIVE_DOUBLING_BUILDERS,
    "halving_doubling": butterfly.HALVING_DOUBLING_BUILDERS,
    "bruck": bruck.BUILDERS,
    "hierarchical": hierarchical.BUILDERS,
    "pairwise": direct.PAIRWISE_BUILDERS,
    "blink": blink.BUILDERS,
    "synth": synth.BUILDERS,
}
# Algorithms built from the cluster itself: they need the group's topology (a
# plait.cost.topology.Topology whose ranks are the group's), given to build_schedule
# or set as CommConfig(topology=...).
TOPOLOGY_ALGORITHMS = ("blink", "synth")
TORCH = "torch"
# Names that pick an algorithm from the default table (the tuner replaces it later).
DEFAULT_NAMES = (None, "default", "auto")


def algorithms_for(collective: str, *, with_topology: bool = False) -> list[str]:
    """plait's algorithms that implement ``collective`` ("torch" is always valid too);
    the TOPOLOGY_ALGORITHMS, which need the cluster's topology, only ``with_topology``."""
    check_collective(collective)
    return [name for name, builders in ALGORITHMS.items()
            if collective in builders and (with_topology or name not in TOPOLOGY_ALGORITHMS)]


def check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")


def builder(collective: str, algorithm: str):
    """The builder for (collective, algorithm), or a ValueError listing what is valid."""
    check_collective(collective)
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; valid: {', '.join(sorted(ALGORITHMS))}, "
            f"'{TORCH}' (torch.distributed's own) or 'auto'"
        )
    builders = ALGORITHMS[algorithm]
    if collective not in builders:
        raise ValueError(
            f"algorithm {algorithm!r} does not implement {collective}; "
            f"algorithms for {collective}: {', '.join(algorithms_for(collective, with_topology=True))}, '{TORCH}'"
        )
    return builders[collective]


def build_schedule(
    collective: str,
    algorithm: str,
    world_size: int,
    buffer_numel: int,
    root: int | None = None,
    segments: int = 1,
    hierarchy=None,
    topology=None,
) -> Schedule:
    """The validated schedule of ``algorithm`` for ``collective`` (cached).

    ``hierarchy`` (hierarchical only) is any spec ``parse_hierarchy`` takes; it is
    validated against ``world_size`` here, so a group that leaves out a rank is
    refused instead of silently not reducing it. ``topology`` (the algorithms of
    TOPOLOGY_ALGORITHMS only) is the group's cluster, rank i on its i-th device.
    """
    if algorithm == "hierarchical":
        hierarchy = hierarchical.parse_hierarchy(hierarchy, world_size)
    else:
        hierarchy = None
    cluster = None
    if algorithm in TOPOLOGY_ALGORITHMS:
        builder(collective, algorithm)  # an unknown pair is named before the topology is
        cluster = _Cluster.of(topology, algorithm, world_size)
    return _build_schedule(collective, algorithm, world_size, buffer_numel, root, max(1, int(segments)), hierarchy,
                           cluster)


def checked_topology_fingerprint(topology, algorithm: str, world_size: int) -> str:
    """``topology``'s fingerprint, once it is checked to be one a topology algorithm of
    ``world_size`` ranks can be built from (else the error that says what to give)."""
    return _Cluster.of(topology, algorithm, world_size).fingerprint


class _Cluster:
    """A topology as a cache key: equal when the fingerprints are."""

    def __init__(self, topology, fingerprint: str) -> None:
        self.topology, self.fingerprint = topology, fingerprint

    @staticmethod
    def of(topology, algorithm: str, world_size: int) -> "_Cluster":
        if topology is None:
            raise ValueError(f"algorithm {algorithm!r} is built from the cluster's links and needs its topology: "
                             "pass topology= (a plait.cost.topology.Topology, e.g. from `plait testbed probe`) "
                             "or set CommConfig(topology=...)")
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a plait.cost.topology.Topology, got {type(topology).__name__}")
        if topology.world_size != world_size:
            raise ValueError(f"topology {topology.name!r} places {topology.world_size} ranks but the group has "
                             f"{world_size}: give the group's own topology (allocate {world_size} devices)")
        return _Cluster(topology, topology_fingerprint(topology))

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Cluster) and other.fingerprint == self.fingerprint


@lru_cache(maxsize=512)
def _build_schedule(
    collective: str,
    algorithm: str,
    world_size: int,
    buffer_numel: int,
    root: int | None = None,
    segments: int = 1,
    hierarchy: tuple | None = None,
    cluster: _Cluster | None = None,
) -> Schedule:
    build = builder(collective, algorithm)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if collective in ROOTED:
        if root is None or not 0 <= root < world_size:
            raise ValueError(f"{collective} needs a root in [0, {world_size}), got {root}")
    else:
        root = None
    if collective == "all_to_all" and buffer_numel % (2 * world_size):
        raise ValueError(
            f"all_to_all buffer of {buffer_numel} elements is not [input | output] of p={world_size} equal chunks"
        )
    options = {"segments": segments}
    if algorithm == "hierarchical":
        options["hierarchy"] = hierarchy
    if cluster is not None:
        options["topology"] = cluster.topology
    steps = build(world_size, buffer_numel, root, options) if world_size > 1 else []
    return make_schedule(collective, algorithm, world_size, buffer_numel, steps, root)


def describe(collective: str, algorithm: str) -> str:
    """The builder's docstring: steps, bytes and cost."""
    doc = builder(collective, algorithm).__doc__ or ""
    return " ".join(doc.split())
