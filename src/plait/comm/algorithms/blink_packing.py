"""Blink's spanning-tree packing: which trees of ranks carry a collective, at what rates.

The idea (Wang et al., "Blink: Fast and Generic Collectives for Distributed ML",
MLSys 2020). Cut a broadcast into parts and send part k down its own spanning
arborescence T_k (rooted at the root, over ranks: only ranks relay; a host or switch
node is not a process) at rate x_k bytes/s. Every rank then receives sum_k x_k bytes/s.
Tree edge (u, v) crosses every directed link of ``topology.route(u, v)``, so the rates
are feasible when, for every directed link l,

    sum_k x_k * (edges of T_k routed over l) <= capacity_bytes_per_s(l).

Maximising sum_k x_k over all (exponentially many) trees is a linear program, solved
by column generation:

1. master: the LP over the trees found so far (scipy's HiGHS); y_l >= 0 are the
   duals of the capacity rows (per unit of rate);
2. pricing: the column with the most negative reduced cost is the minimum-weight
   spanning arborescence rooted at the root with edge weight w(u, v) = sum of y_l over
   the links of the edge's route (Chu-Liu/Edmonds, :func:`min_arborescence`);
3. if its weight is < 1 it improves the LP: add it and repeat; otherwise no tree does
   and the master's optimum is the optimum over all trees (LP duality).

Variants use the same loop. Reduce sends child -> parent, so an edge uses
``route(v, u)``; all-reduce reduces up and broadcasts down the same trees, so an edge
uses both routes. All-gather has p roots (each rank broadcasts its own chunk):
maximise lambda subject to sum of root r's tree rates >= lambda for every r, all trees
sharing the capacities; the duals mu_r of those rows replace the 1 of step 3.

Rounding. An LP vertex has at most (#links + #roots) trees with a positive rate,
usually far fewer. We keep at most 2p per root (the fastest), drop rates below 1e-9
of the total, and scale the kept rates up until the tightest link is full again.

Independent check. Whatever relays, a broadcast from the root cannot beat
min over ranks v of maxflow(root's device -> v's device) in the physical graph
(every node may relay there): :func:`broadcast_upper_bound_bytes_per_s`.

Cost. Each iteration is one LP (rows = directed links in use, columns = trees so
far) plus one O(p^3) Chu-Liu/Edmonds per root; for p <= 16 a packing takes
milliseconds to a few tenths of a second. Packings are cached per (topology
fingerprint, collective, root).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import scipy.sparse as sparse
from scipy.optimize import linprog
from scipy.sparse.csgraph import maximum_flow

from plait.cost.topology_io import topology_fingerprint

__all__ = ["Tree", "Packing", "min_arborescence", "pack_trees", "pack_all_gather",
           "max_flow_bytes_per_s", "broadcast_upper_bound_bytes_per_s"]

DIRECTIONS = {"broadcast": "down", "reduce": "up", "all_reduce": "both"}
_MAX_ITERATIONS = 2000
_TOLERANCE = 1e-9
_CACHE: dict[tuple, "Packing"] = {}
_CACHE_SIZE = 256
# maximum_flow works in int32 (larger int64 values overflow silently): capacities are
# rounded up to whole units with every capacity and the flow itself <= 2**29 units.
_FLOW_UNITS = 1 << 29


class Tree(NamedTuple):
    """A spanning arborescence over ranks carrying ``rate_bytes_per_s``;
    ``parent[v]`` is v's parent, -1 at the root."""

    rate_bytes_per_s: float
    parent: tuple[int, ...]

    @property
    def root(self) -> int:
        return self.parent.index(-1)

    def depths(self) -> tuple[int, ...]:
        """Edges from the root to each rank."""
        depth = []
        for v in range(len(self.parent)):
            d = 0
            while self.parent[v] != -1:
                v, d = self.parent[v], d + 1
                assert d < len(self.parent), f"parent array {self.parent} has a cycle"
            depth.append(d)
        return tuple(depth)

    @property
    def height(self) -> int:
        return max(self.depths())


@dataclass(frozen=True)
class Packing:
    """Trees for ``collective`` on a topology. ``rate_bytes_per_s`` is what each root
    gets after rounding (all-gather: the smallest over roots), ``lp_rate_bytes_per_s``
    the LP optimum before it, ``bound_bytes_per_s`` an upper bound from max-flow."""

    collective: str
    roots: tuple[int, ...]
    trees: tuple[Tree, ...]
    rate_bytes_per_s: float
    lp_rate_bytes_per_s: float
    bound_bytes_per_s: float

    def trees_of(self, root: int) -> tuple[Tree, ...]:
        return tuple(tree for tree in self.trees if tree.root == root)


# ----- minimum-weight spanning arborescence (Chu-Liu/Edmonds) ----------------------------
def _find_cycle(parent) -> list[int] | None:
    """A cycle of the parent pointers (the root's parent is -1), or None."""
    seen_by = [-1] * len(parent)
    for start in range(len(parent)):
        v, path = start, []
        while v != -1 and seen_by[v] == -1:
            seen_by[v] = start
            path.append(v)
            v = parent[v]
        if v != -1 and seen_by[v] == start:
            return path[path.index(v):]
    return None


def min_arborescence(weight: np.ndarray, root: int) -> tuple[int, ...]:
    """Parent array of a minimum-weight spanning arborescence rooted at ``root``.

    ``weight[u, v]`` is the weight of edge u -> v (inf: no edge). Chu-Liu/Edmonds:
    every node takes its cheapest incoming edge; a cycle among those is contracted
    into one node (edges into it cost w(u, v) - w(best edge into v)), the smaller
    problem is solved recursively and the cycle is reopened where the chosen edge
    enters it. O(p^3) for p nodes. Raises ValueError if a node cannot be reached.
    """
    w = np.array(weight, dtype=np.float64)
    n = w.shape[0]
    np.fill_diagonal(w, np.inf)
    w[:, root] = np.inf
    parent = np.argmin(w, axis=0)
    best = w[parent, np.arange(n)]
    best[root] = 0.0
    unreachable = [v for v in range(n) if v != root and not np.isfinite(best[v])]
    if unreachable:
        raise ValueError(f"no edge into nodes {unreachable}")
    parent[root] = -1
    cycle = _find_cycle(parent.tolist())
    if cycle is None:
        return tuple(int(u) for u in parent)
    cyc = np.array(cycle)
    outside = [v for v in range(n) if v not in set(cycle)]
    k = len(outside)  # the contracted cycle is node k of the smaller problem
    small = np.full((k + 1, k + 1), np.inf)
    small[:k, :k] = w[np.ix_(outside, outside)]
    into = w[np.ix_(outside, cyc)] - best[cyc][None, :]  # (k, |cycle|)
    enters_at = np.argmin(into, axis=1)
    small[:k, k] = into[np.arange(k), enters_at]
    out_of = w[np.ix_(cyc, outside)]  # (|cycle|, k)
    leaves_from = np.argmin(out_of, axis=0)
    small[k, :k] = out_of[leaves_from, np.arange(k)]
    small_parent = min_arborescence(small, outside.index(root))
    result = parent.copy()  # cycle nodes keep their cycle parents but one
    for i, v in enumerate(outside):
        if v != root:
            u = small_parent[i]
            result[v] = cyc[leaves_from[i]] if u == k else outside[u]
    entry_source = small_parent[k]
    result[cyc[enters_at[entry_source]]] = outside[entry_source]
    return tuple(int(u) for u in result)


# ----- link usage of rank edges ---------------------------------------------------------------
def _edge_usage(topology, direction: str) -> np.ndarray:
    """(p, p, L): how often tree edge parent u -> child v crosses each directed link."""
    p = topology.world_size
    down = np.zeros((p, p, topology.num_directed_links))
    for u in range(p):
        for v in range(p):
            if u != v:
                np.add.at(down[u, v], list(topology.route(u, v)), 1.0)
    up = down.transpose(1, 0, 2)  # the child sends to its parent over route(v, u)
    return {"down": down, "up": up, "both": down + up}[direction]


def _usable_edges(usage: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """(p, p) bool: the edge crosses only links with positive capacity."""
    blocked = (usage > 0) & (capacity <= 0)[None, None, :]
    usable = ~blocked.any(axis=2)
    np.fill_diagonal(usable, False)
    return usable


def _check_reachable(usable: np.ndarray, roots, topology) -> None:
    p = usable.shape[0]
    for root in roots:
        reached, frontier = {root}, [root]
        while frontier:
            u = frontier.pop()
            for v in np.flatnonzero(usable[u]).tolist():
                if v not in reached:
                    reached.add(v)
                    frontier.append(v)
        missing = sorted(set(range(p)) - reached)
        if missing:
            raise ValueError(
                f"blink: ranks {missing} cannot be reached from rank {root} on topology {topology.name!r} "
                "(every route to them crosses a link of zero capacity); give those links bandwidth")


# ----- column generation ------------------------------------------------------------------------
def _tree_usage(usage: np.ndarray, parent: tuple[int, ...]) -> np.ndarray:
    children = [v for v, u in enumerate(parent) if u >= 0]
    return usage[[parent[v] for v in children], children].sum(axis=0)


def _solve_master(columns, capacity, roots):
    """max lambda s.t. sum_k x_k a_k <= capacity, lambda <= sum of root r's x_k for every r.
    Returns (lambda, x, y (capacity duals), mu (root duals))."""
    count, links, root_index = len(columns), capacity.shape[0], {r: i for i, r in enumerate(roots)}
    a_cap = np.zeros((links, count + 1))
    a_root = np.zeros((len(roots), count + 1))
    a_root[:, 0] = 1.0  # variable 0 is lambda
    for k, (root, parent, column_usage) in enumerate(columns):
        a_cap[:, k + 1] = column_usage
        a_root[root_index[root], k + 1] = -1.0
    objective = np.zeros(count + 1)
    objective[0] = -1.0
    result = linprog(objective, A_ub=np.vstack([a_cap, a_root]), b_ub=np.concatenate([capacity, np.zeros(len(roots))]),
                     bounds=(0, None), method="highs")
    assert result.status == 0, result.message
    duals = -result.ineqlin.marginals
    return -result.fun, result.x[1:], duals[:links], duals[links:]


def _column_generation(usage: np.ndarray, capacity: np.ndarray, roots: list[int]):
    """Trees and LP rates maximising the rate every root gets; capacities are
    rescaled to about 1 so HiGHS's tolerances fit."""
    used = np.flatnonzero(usage.sum(axis=(0, 1)) > 0)
    usage, scale = usage[:, :, used], float(capacity[used].max())
    capacity = capacity[used] / scale
    edge_cost = np.where(_usable_edges(usage, capacity), 0.0, np.inf)
    columns, seen = [], set()
    price = np.divide(1.0, capacity, out=np.zeros_like(capacity), where=capacity > 0)
    for root in roots:  # start from each root's tree of cheapest bottleneck-weighted edges
        parent = min_arborescence(usage @ price + edge_cost, root)
        columns.append((root, parent, _tree_usage(usage, parent)))
        seen.add(parent)
    for _ in range(_MAX_ITERATIONS):
        rate, x, y, mu = _solve_master(columns, capacity, roots)
        weight = usage @ y + edge_cost
        added = False
        for root, mu_r in zip(roots, mu):
            parent = min_arborescence(weight, root)
            column_usage = _tree_usage(usage, parent)
            if column_usage @ y < mu_r - _TOLERANCE * max(1.0, mu_r) and parent not in seen:
                columns.append((root, parent, column_usage))
                seen.add(parent)
                added = True
        if not added:
            break
    return rate * scale, [(root, parent, x_k * scale) for (root, parent, _), x_k in zip(columns, x)]


def _round(trees, usage: np.ndarray, capacity: np.ndarray, roots: list[int]) -> tuple[Tree, ...]:
    """At most 2p trees per root, the fastest; then scale up until a link is full."""
    p = usage.shape[0]
    total = sum(rate for _, _, rate in trees)
    kept = []
    for root in roots:
        mine = sorted((t for t in trees if t[0] == root and t[2] > _TOLERANCE * total), key=lambda t: -t[2])
        kept += mine[: 2 * p]
    load = sum(rate * _tree_usage(usage, parent) for _, parent, rate in kept)
    loaded = load > 0
    factor = float(np.min(capacity[loaded] / load[loaded])) if loaded.any() else 1.0
    return tuple(Tree(rate * factor, parent) for _, parent, rate in kept)


def _pack(topology, collective: str, direction: str, roots: list[int], bound_bytes_per_s: float) -> Packing:
    usage = _edge_usage(topology, direction)
    capacity = np.asarray(topology.capacity_bytes_per_s, dtype=np.float64)
    _check_reachable(_usable_edges(usage, capacity), roots, topology)
    lp_rate, trees = _column_generation(usage, capacity, roots)
    kept = _round(trees, usage, capacity, roots)
    rate = min(sum(t.rate_bytes_per_s for t in kept if t.root == r) for r in roots)
    return Packing(collective, tuple(roots), kept, rate, lp_rate, bound_bytes_per_s)


def _cached(key, make):
    packing = _CACHE.get(key)
    if packing is None:
        packing = make()
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = packing
    return packing


def pack_trees(topology, root: int, collective: str = "broadcast") -> Packing:
    """Trees rooted at ``root`` and their rates for "broadcast" (edges send down),
    "reduce" (up) or "all_reduce" (up then down the same trees); cached."""
    if collective not in DIRECTIONS:
        raise ValueError(f"pack_trees: collective={collective!r} is not one of {', '.join(DIRECTIONS)}")
    if not 0 <= root < topology.world_size:
        raise ValueError(f"root {root} is outside [0, {topology.world_size}) of topology {topology.name!r}")

    def make() -> Packing:
        down = broadcast_upper_bound_bytes_per_s(topology, root)
        up = min((max_flow_bytes_per_s(topology, v, root) for v in range(topology.world_size) if v != root),
                 default=np.inf)
        bound = {"broadcast": down, "reduce": up, "all_reduce": min(down, up)}[collective]
        return _pack(topology, collective, DIRECTIONS[collective], [root], bound)

    return _cached((topology_fingerprint(topology), collective, root), make)


def pack_all_gather(topology) -> Packing:
    """Trees for every rank's chunk: maximises the rate lambda that every root gets;
    cached. The bound is min(each root's broadcast bound, each rank's incoming
    capacity / (p - 1)), since a rank receives p - 1 chunks."""
    def make() -> Packing:
        p = topology.world_size
        capacity = np.asarray(topology.capacity_bytes_per_s)
        ends = topology._index["ends"]
        incoming = np.zeros(len(topology.nodes))
        for link, (a, b) in enumerate(ends):  # directed 2i: a -> b, 2i+1: b -> a
            incoming[b] += capacity[2 * link]
            incoming[a] += capacity[2 * link + 1]
        rank_node = topology._index["rank_node"]
        bound = min(min(broadcast_upper_bound_bytes_per_s(topology, r) for r in range(p)),
                    min(incoming[rank_node[v]] for v in range(p)) / max(1, p - 1))
        return _pack(topology, "all_gather", "down", list(range(p)), bound)

    return _cached((topology_fingerprint(topology), "all_gather", None), make)


# ----- the independent optimum: max-flow in the physical graph ------------------------------
def max_flow_bytes_per_s(topology, src_rank: int, dst_rank: int) -> float:
    """Max-flow from ``src_rank``'s device to ``dst_rank``'s over every node and directed
    link. scipy's maximum_flow needs int32 capacities: each is rounded up to whole
    units of max(largest capacity, capacity out of the source) / 2**29, so the result
    errs high by at most one unit (~2e-9 of that) per link of the minimum cut."""
    capacity = np.asarray(topology.capacity_bytes_per_s, dtype=np.float64)
    ends = np.asarray(topology._index["ends"], dtype=np.int64).reshape(-1, 2)
    tails = np.empty(2 * len(ends), dtype=np.int64)
    heads = np.empty(2 * len(ends), dtype=np.int64)
    tails[0::2], heads[0::2] = ends[:, 0], ends[:, 1]
    tails[1::2], heads[1::2] = ends[:, 1], ends[:, 0]
    source, sink = (topology._index["rank_node"][r] for r in (src_rank, dst_rank))
    unit = max(float(capacity.max()), float(capacity[tails == source].sum())) / _FLOW_UNITS
    units = np.ceil(capacity / unit).astype(np.int32)
    n = len(topology.nodes)
    graph = sparse.coo_matrix((units, (tails, heads)), shape=(n, n)).tocsr()  # parallel links add up
    return float(maximum_flow(graph, source, sink).flow_value) * unit


def broadcast_upper_bound_bytes_per_s(topology, root: int) -> float:
    """min over ranks v != root of the physical max-flow root -> v: no broadcast, with
    any relays, delivers faster to every rank (inf for a single rank)."""
    return min((max_flow_bytes_per_s(topology, root, v) for v in range(topology.world_size) if v != root),
               default=float("inf"))
