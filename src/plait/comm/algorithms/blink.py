"""Blink collectives: pipelined broadcasts and reductions down packed spanning trees.

``blink_packing`` finds spanning trees of ranks and rates x_k whose traffic fits every
link of a :class:`~plait.cost.topology.Topology` (Wang et al., MLSys 2020). Here the
trees become schedules:

* the buffer is cut into one part per tree, sized in proportion to x_k (largest
  remainder, so equal rates give ``chunk_sizes``'s split), and each part into S
  pipeline segments (``options["segments"]``);
* broadcast: the edge into a child at depth d sends segment j at step j + d - 1;
* reduce: a node at depth d sends its accumulated segment j to its parent (reducing)
  at step j + H - d, H the tree's height, so its children's segment j landed a step
  before;
* all-reduce: that reduce, then the broadcast of segment j from step j + H on;
* all-gather: every rank's chunk is broadcast down its own trees.

All trees run in the same steps. A step moves part_k / S over every edge of tree k,
so a link carries sum_k x_k (edges of k on it) n / (S R) <= capacity x n / (S R)
bytes, R = sum_k x_k: every step takes n / (S R) plus the path latency alpha, and

    T ~ n / R + (S + H - 1) alpha          (broadcast, reduce; H = largest height)
    T ~ n / R + (S + 2H - 1) alpha         (all-reduce; R from the up+down packing)

where the (H - 1) fill steps also cost about n / (S R) each (the simulator prices
them; the formula drops that (H - 1) / S share).
"""

from __future__ import annotations

from plait.comm.algorithms.blink_packing import Packing, Tree, pack_all_gather, pack_trees
from plait.comm.schedule import Step, Transfer, chunk_bounds

__all__ = ["proportional_sizes", "best_all_reduce_packing", "BUILDERS",
           "broadcast", "reduce", "all_reduce", "all_gather"]


def _topology(world_size: int, options: dict):
    topology = options.get("topology")
    if topology is None:
        raise ValueError('algorithm "blink" needs a topology: pass topology=... (a plait.cost.topology.Topology, '
                         "e.g. from plait.cost.presets or the testbed's profiled topology) or set it in CommConfig")
    if topology.world_size != world_size:
        raise ValueError(
            f'algorithm "blink": the topology {topology.name!r} allocates {topology.world_size} ranks but the '
            f"collective runs on world_size={world_size}; allocate {world_size} devices "
            f"(topology.with_allocation(...)) or run on {topology.world_size} ranks")
    return topology


def _segments(options: dict) -> int:
    return max(1, int(options.get("segments", 1)))


def proportional_sizes(numel: int, rates: list[float]) -> list[int]:
    """Split ``numel`` elements in proportion to ``rates`` (largest remainder: the sizes
    sum to ``numel``, each within one of its exact share; ties go to the first)."""
    total = sum(rates)
    shares = [numel * rate / total for rate in rates]
    sizes = [int(share) for share in shares]
    by_remainder = sorted(range(len(rates)), key=lambda k: (-(shares[k] - sizes[k]), k))
    for k in by_remainder[: numel - sum(sizes)]:
        sizes[k] += 1
    return sizes


def _parts(start: int, numel: int, trees: tuple[Tree, ...]) -> list[tuple[Tree, int, int]]:
    """(tree, offset, numel) of each tree's contiguous part of [start, start + numel)."""
    parts, offset = [], start
    for tree, size in zip(trees, proportional_sizes(numel, [t.rate_bytes_per_s for t in trees])):
        parts.append((tree, offset, size))
        offset += size
    return parts


def _down(tree: Tree, start: int, numel: int, segments: int, first_step: int, events: dict) -> None:
    """Pipelined broadcast of [start, start + numel) down ``tree``: the edge into a child
    at depth d sends segment j at step first_step + j + d - 1."""
    depth = tree.depths()
    for j, (offset, size) in enumerate(chunk_bounds(start, numel, segments)):
        for child, parent in enumerate(tree.parent):
            if parent >= 0:
                events.setdefault(first_step + j + depth[child] - 1, []).append(
                    Transfer(parent, child, offset, offset, size, False))


def _up(tree: Tree, start: int, numel: int, segments: int, events: dict) -> None:
    """Pipelined reduce of [start, start + numel) up ``tree``: a node at depth d sends
    its accumulated segment j to its parent at step j + H - d (children at d + 1 sent
    theirs a step earlier, and same-step siblings reduce identical ranges)."""
    depth, height = tree.depths(), tree.height
    for j, (offset, size) in enumerate(chunk_bounds(start, numel, segments)):
        for child, parent in enumerate(tree.parent):
            if parent >= 0:
                events.setdefault(j + height - depth[child], []).append(
                    Transfer(child, parent, offset, offset, size, True))


def _steps(events: dict) -> list[Step]:
    last = max(events, default=-1)
    return [Step(tuple(events.get(index, ()))) for index in range(last + 1)]


def best_all_reduce_packing(topology, root: int | None = None) -> Packing:
    """The up+down packing rooted at ``root``; without one, at the rank whose packing
    has the highest rate (ties: the lowest rank). Trying all p roots costs p packings
    once per topology (cached): ~0.7 s at p = 16 on one switch, ~4 s on a 16-GPU fat
    tree; pass options["root"] to skip the search."""
    if root is not None:
        return pack_trees(topology, root, "all_reduce")
    packings = [pack_trees(topology, r, "all_reduce") for r in range(topology.world_size)]
    best = max(packing.rate_bytes_per_s for packing in packings)
    return next(pk for pk in packings if pk.rate_bytes_per_s >= best * (1 - 1e-9))


# ----- collective builders ---------------------------------------------------------------------
def broadcast(p, n, root, options):
    """Blink broadcast: the buffer split over the packed trees in proportion to their
    rates, each part pipelined down its tree in S segments; S + H - 1 steps (H the
    largest tree height), tree k's edges each carry its part n_k = n x_k / R, and a link
    carries at most its capacity x n / R seconds' worth: T ~ n / R + (S + H - 1) a,
    R = the packing rate."""
    topology = _topology(p, options)
    if p == 1:
        return []
    events: dict = {}
    for tree, offset, size in _parts(0, n, pack_trees(topology, root, "broadcast").trees):
        _down(tree, offset, size, _segments(options), 0, events)
    return _steps(events)


def reduce(p, n, root, options):
    """Blink reduce: the broadcast reversed on the reduce packing (edges send child ->
    parent, reducing); S + H - 1 steps, each node sends n_k once per tree and reduces
    what its children send: T ~ n / R + (S + H - 1) a (+ gamma x bytes reduced)."""
    topology = _topology(p, options)
    if p == 1:
        return []
    events: dict = {}
    for tree, offset, size in _parts(0, n, pack_trees(topology, root, "reduce").trees):
        _up(tree, offset, size, _segments(options), events)
    return _steps(events)


def all_reduce(p, n, root, options):
    """Blink all-reduce: reduce up each tree, then broadcast down the same tree; segment
    j leaves the root at step j + H, so the phases overlap. S + 2H - 1 steps; each edge
    carries n_k up and n_k down; the packing (root ``options["root"]``, else the rank
    with the best rate) counts both: T ~ n / R + (S + 2H - 1) a. On a uniform switch
    of port bandwidth B, R = p B / (2(p - 1)): the ring's 2(p-1)/p n / B."""
    topology = _topology(p, options)
    if p == 1:
        return []
    segments = _segments(options)
    events: dict = {}
    for tree, offset, size in _parts(0, n, best_all_reduce_packing(topology, options.get("root")).trees):
        _up(tree, offset, size, segments, events)
        _down(tree, offset, size, segments, tree.height, events)
    return _steps(events)


def all_gather(p, n, root, options):
    """Blink all-gather: rank r's chunk [r m, (r+1) m), m = n / p, is broadcast down r's
    trees of the multi-root packing, all roots at once; S + H - 1 steps, every rank
    receives (p - 1) m: T ~ m / lambda + (S + H - 1) a, lambda the rate every root gets
    (B / (p - 1) on a uniform switch: the ring's (p-1) m / B)."""
    topology = _topology(p, options)
    if p == 1:
        return []
    if n % p:
        raise ValueError(f"blink all_gather: buffer of {n} elements is not p={p} equal chunks; "
                         f"pass world_size x the input size")
    chunk_numel = n // p
    packing = pack_all_gather(topology)
    events: dict = {}
    for r in range(p):
        for tree, offset, size in _parts(r * chunk_numel, chunk_numel, packing.trees_of(r)):
            _down(tree, offset, size, _segments(options), 0, events)
    return _steps(events)


BUILDERS = {"broadcast": broadcast, "reduce": reduce, "all_reduce": all_reduce, "all_gather": all_gather}
