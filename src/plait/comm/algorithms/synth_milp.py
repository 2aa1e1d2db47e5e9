"""The routing MILP behind ``synth``: which chunk crosses which rank pair in which round.

Collective synthesis in the manner of TACCL (Shah et al., NSDI 2023): an all-gather is
written as a mixed-integer program over a topology and solved with HiGHS
(``scipy.optimize.milp``). Inputs: p ranks, K chunks (chunk c starts at rank
``owner(c)``), the allowed directed rank pairs ("edges", from the sketch), the
physical directed links each edge's route crosses, and R synchronous rounds.

Variables (t = 1..R is a round, round 0 is the start):

    x[c, e, t] in {0, 1}   chunk c crosses edge e = (u, v) in round t
    h[c, v, t] in {0, 1}   rank v holds chunk c after round t (t = 0..R);
                           h[c, v, 0] = 1 only at owner(c), h[c, v, R] = 1 everywhere
    lat_t >= 0             the latency part of round t (s)
    tau_t >= 0             the duration of round t (s)

Constraints:

    sum_v x[c, (u, v), t] <= deg(u) h[c, u, t-1]       a rank sends only what it held at
                                                       the end of the previous round
    h[c, v, t] = h[c, v, t-1] + sum_u x[c, (u, v), t]  holding grows by what arrives; as h
                                                       is binary and starts at 0 off the
                                                       owner, each rank receives each
                                                       chunk at most once (exactly once,
                                                       with h[., ., R] = 1): every
                                                       chunk's route is a tree rooted at
                                                       its owner, which reduce-scatter
                                                       reverses
    sum_{t, e enters host H} x[c, e, t] >= 1           for each host H without owner(c):
                                                       implied by the above for integers,
                                                       but without it the LP relaxation
                                                       lets a fraction of a chunk that
                                                       crossed to a host be copied to all
                                                       its ranks, and its bound is ~0
    sum_u latency(u, v) x[c, (u, v), t] <= lat_t       (one term at most is 1)
    lat_t + sum_{c, e crossing l} x[c, e, t] chunk_bytes / capacity(l) <= tau_t
                                                       for every physical directed link l

Objective: minimise sum_t tau_t. A round thus costs its slowest route's latency plus
its busiest link's bytes over that link's bandwidth (``round_time_s``); an unused
round costs nothing. Because every non-owner receives every chunk exactly once, the
number of sends is fixed at K (p - 1): no redundant send can be chosen, so no extra
weight on sum x is needed to discourage them.

Symmetry (TACCL's "symmetry offsets"). Chunks fall into orbits: a representative and
the chunks that follow its routes through a rank permutation (``synth`` maps local
rank 0's chunk to local rank k's by shifting every host's local indices by k). Only
representatives get variables; a representative may use an edge only if every image
of it is allowed, its latency row uses the slowest image, and each link row counts
every image crossing the link. Routes stay trees, costs stay exact; the restriction
may only lose optimality where ranks of a host are not interchangeable.

Size: x has at most (representatives) |E| R binaries, pruned to sends a rank can make
(u holds chunk c before round t only if it is within t - 1 hops of the owner); h has
(representatives) p (R + 1). p = 16 with all 240 pairs allowed and R = 5 is
16 x 240 x 5 = 19,200 binaries without symmetry; 4 x 240 x 5 = 4,800 on 4 hosts of 4
told apart by a slow link; 1,200 on alike hosts (one representative). Branch and bound stops
after ``node_limit`` nodes or at ``mip_rel_gap``: both are amounts of work, not of
time, so every rank that builds the model gets the same answer; the wall-clock limit
is only a backstop, and a solve that hits it (or finds no solution) is reported as a
failure the caller turns into a deterministic fallback.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix

__all__ = ["RouteProblem", "RouteResult", "solve_routes", "unreachable", "round_time_s"]

# (chunk, src rank, dst rank): one chunk crossing one edge
Send = tuple[int, int, int]


@dataclass(frozen=True, kw_only=True)
class RouteProblem:
    """Plain data the MILP is built from (no topology object: easy to test and cache).

    ``edges[i] = (u, v)`` is an allowed directed rank pair; ``edge_links[i]`` the
    physical directed link ids its route crosses and ``edge_latency_s[i]`` the sum of
    their latencies; ``capacity_bytes_per_s[l]`` is link l's bandwidth. ``groups``
    are the ranks of each host. ``orbits`` lists, per representative chunk, the
    (chunk, rank map) pairs that follow its routes (``rank_map[r]`` is r's image;
    the representative itself appears with the identity).
    """

    world_size: int
    owners: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]
    edge_links: tuple[tuple[int, ...], ...]
    edge_latency_s: tuple[float, ...]
    capacity_bytes_per_s: tuple[float, ...]
    chunk_bytes: int
    rounds: int
    groups: tuple[tuple[int, ...], ...]
    orbits: tuple[tuple[int, tuple[tuple[int, tuple[int, ...]], ...]], ...]

    def edge_index(self) -> dict[tuple[int, int], int]:
        return {edge: e for e, edge in enumerate(self.edges)}

    def representative_edges(self, chunk: int) -> list[int]:
        """Edges the representative ``chunk`` may use: those all of whose images are allowed."""
        index = self.edge_index()
        maps = [rank_map for rep, members in self.orbits if rep == chunk for _, rank_map in members]
        return [e for e, (u, v) in enumerate(self.edges) if all((m[u], m[v]) in index for m in maps)]


@dataclass(frozen=True, kw_only=True)
class RouteResult:
    """``sends[t]`` lists the (chunk, src, dst) of round t + 1, sorted; None when the
    solve failed, and ``reason`` then says why."""

    sends: tuple[tuple[Send, ...], ...] | None
    objective_s: float
    reason: str
    solve_s: float
    nodes: int


def _hop_distances(world_size: int, edges, source: int) -> list[float]:
    """Fewest edges from ``source`` to each rank (inf where unreachable)."""
    out_edges: dict[int, list[int]] = {}
    for u, v in edges:
        out_edges.setdefault(u, []).append(v)
    distance = [math.inf] * world_size
    distance[source] = 0
    queue = deque([source])
    while queue:
        u = queue.popleft()
        for v in out_edges.get(u, ()):
            if distance[v] == math.inf:
                distance[v] = distance[u] + 1
                queue.append(v)
    return distance


def unreachable(problem: RouteProblem) -> str | None:
    """Why some chunk cannot reach every rank in the rounds allowed (None if all can)."""
    for rep, _ in problem.orbits:
        owner = problem.owners[rep]
        distance = _hop_distances(problem.world_size,
                                  [problem.edges[e] for e in problem.representative_edges(rep)], owner)
        far = max(range(problem.world_size), key=lambda v: distance[v])
        if distance[far] > problem.rounds:
            hops = "there is no path" if distance[far] == math.inf else f"it takes {distance[far]} rounds"
            return f"from rank {owner} to rank {far} {hops}, but the sketch allows rounds={problem.rounds}"
    return None


def round_time_s(sends, chunk_bytes, problem: RouteProblem) -> float:
    """The MILP's price of one round: slowest route latency + busiest link's bytes /
    bandwidth. ``chunk_bytes(chunk)`` is a chunk's size in bytes."""
    index = problem.edge_index()
    load_bytes: dict[int, float] = {}
    latency_s = 0.0
    for chunk, src, dst in sends:
        edge = index[src, dst]
        latency_s = max(latency_s, problem.edge_latency_s[edge])
        for link in problem.edge_links[edge]:
            load_bytes[link] = load_bytes.get(link, 0.0) + chunk_bytes(chunk)
    if not sends:
        return 0.0
    return latency_s + max(nbytes / problem.capacity_bytes_per_s[link] for link, nbytes in load_bytes.items())


class _Model:
    """Columns and rows in creation order, so the model is identical on every rank."""

    def __init__(self) -> None:
        self.col: dict[tuple, int] = {}
        self.col_lower: list[float] = []
        self.col_upper: list[float] = []
        self.integral: list[int] = []
        self.data: list[float] = []
        self.indices: list[int] = []
        self.ptr: list[int] = [0]
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []

    def add_col(self, key: tuple, lower: float, upper: float, integral: bool) -> None:
        self.col[key] = len(self.col_lower)
        self.col_lower.append(lower)
        self.col_upper.append(upper)
        self.integral.append(1 if integral else 0)

    def add_row(self, terms: dict[int, float], lower: float, upper: float) -> None:
        for col in sorted(terms):
            self.indices.append(col)
            self.data.append(terms[col])
        self.ptr.append(len(self.indices))
        self.row_lower.append(lower)
        self.row_upper.append(upper)


def _build(problem: RouteProblem) -> tuple[_Model, dict, float]:
    """The model of the module docstring; returns it, the x columns and the time unit."""
    p, rounds, owners, edges = problem.world_size, problem.rounds, problem.owners, problem.edges
    # Times are in units of the largest coefficient, so HiGHS sees numbers <= 1.
    chunk_s = [problem.chunk_bytes / capacity for capacity in problem.capacity_bytes_per_s]
    unit_s = max([*(chunk_s[link] for links in problem.edge_links for link in links),
                  *problem.edge_latency_s, 1e-12])
    index = problem.edge_index()
    model = _Model()
    x: dict[tuple[int, int, int], int] = {}  # (chunk, edge, round) -> column
    for rep, _ in problem.orbits:
        owner = owners[rep]
        for t in range(rounds + 1):
            for v in range(p):
                if v == owner or t == rounds > 0:
                    bounds = (1.0, 1.0)  # the owner always holds it; everyone does at the end
                else:
                    bounds = (0.0, 0.0) if t == 0 else (0.0, 1.0)
                model.add_col(("h", rep, v, t), *bounds, True)
        usable = problem.representative_edges(rep)
        distance = _hop_distances(p, [edges[e] for e in usable], owner)
        for t in range(1, rounds + 1):
            for e in usable:
                u, v = edges[e]
                if v != owner and distance[u] <= t - 1:
                    model.add_col(("x", rep, e, t), 0.0, 1.0, True)
                    x[rep, e, t] = model.col["x", rep, e, t]
    for t in range(1, rounds + 1):
        model.add_col(("lat", t), 0.0, math.inf, False)
        model.add_col(("tau", t), 0.0, math.inf, False)
    h = model.col

    sends_from: dict[tuple[int, int, int], list[int]] = {}
    arrivals: dict[tuple[int, int, int], list[tuple[int, int]]] = {}  # -> [(edge, column)]
    for (rep, e, t), col in x.items():
        u, v = edges[e]
        sends_from.setdefault((rep, u, t), []).append(col)
        arrivals.setdefault((rep, v, t), []).append((e, col))
    for (rep, u, t), cols in sends_from.items():  # send only what was held before the round
        if u != owners[rep]:
            model.add_row({**{col: 1.0 for col in cols}, h["h", rep, u, t - 1]: -float(len(cols))}, -math.inf, 0.0)
    for rep, members in problem.orbits:
        for t in range(1, rounds + 1):
            for v in range(p):
                if v == owners[rep]:
                    continue
                into = arrivals.get((rep, v, t), [])
                model.add_row({h["h", rep, v, t]: 1.0, h["h", rep, v, t - 1]: -1.0, **{col: -1.0 for _, col in into}},
                              0.0, 0.0)
                latency = {}
                for e, col in into:
                    u = edges[e][0]
                    worst_s = max(problem.edge_latency_s[index[m[u], m[v]]] for _, m in members)
                    if worst_s > 0:
                        latency[col] = worst_s / unit_s
                if latency:
                    model.add_row({**latency, model.col["lat", t]: -1.0}, -math.inf, 0.0)
    group_of = {rank: g for g, group in enumerate(problem.groups) for rank in group}
    entering: dict[tuple[int, int], dict[int, float]] = {}  # (chunk, host) -> sends into the host
    for (rep, e, t), col in x.items():
        u, v = edges[e]
        if group_of[u] != group_of[v]:
            entering.setdefault((rep, group_of[v]), {})[col] = 1.0
    for rep, _ in problem.orbits:  # every host without the owner is entered at least once
        for g in range(len(problem.groups)):
            if g != group_of[owners[rep]]:
                model.add_row(entering.get((rep, g), {}), 1.0, math.inf)
    link_rows: dict[tuple[int, int], dict[int, float]] = {}
    members_of = dict(problem.orbits)
    for (rep, e, t), col in x.items():
        u, v = edges[e]
        for _, rank_map in members_of[rep]:
            for link in problem.edge_links[index[rank_map[u], rank_map[v]]]:
                row = link_rows.setdefault((t, link), {})
                row[col] = row.get(col, 0.0) + chunk_s[link] / unit_s
    for (t, link) in sorted(link_rows):
        model.add_row({**link_rows[t, link], model.col["lat", t]: 1.0, model.col["tau", t]: -1.0}, -math.inf, 0.0)
    return model, x, unit_s


def solve_routes(problem: RouteProblem, *, node_limit: int, mip_rel_gap: float,
                 time_limit_s: float) -> RouteResult:
    """Build and solve the MILP of the module docstring."""
    model, x, unit_s = _build(problem)
    objective = np.zeros(len(model.col_lower))
    for t in range(1, problem.rounds + 1):
        objective[model.col["tau", t]] = 1.0
    matrix = csr_matrix((model.data, model.indices, model.ptr), shape=(len(model.row_lower), len(model.col_lower)))
    started = time.perf_counter()
    result = milp(objective, integrality=np.array(model.integral), bounds=Bounds(model.col_lower, model.col_upper),
                  constraints=LinearConstraint(matrix, model.row_lower, model.row_upper),
                  options={"node_limit": node_limit, "mip_rel_gap": mip_rel_gap, "presolve": True,
                           "time_limit": time_limit_s, "disp": False})
    solve_s = time.perf_counter() - started
    nodes = int(getattr(result, "mip_node_count", 0) or 0)
    message = str(result.message).split(". (")[0].strip()
    if result.x is None:
        return RouteResult(sends=None, objective_s=math.nan, reason=f"HiGHS: {message}", solve_s=solve_s, nodes=nodes)
    if "time limit" in message.lower():
        # what was found by then depends on the machine's speed: not deterministic
        return RouteResult(sends=None, objective_s=math.nan, solve_s=solve_s, nodes=nodes,
                           reason=f"HiGHS hit the {time_limit_s:g} s backstop before its node limit")
    members_of = dict(problem.orbits)
    rounds: list[list[Send]] = [[] for _ in range(problem.rounds)]
    for (rep, e, t), col in x.items():
        if result.x[col] > 0.5:
            u, v = problem.edges[e]
            rounds[t - 1] += [(chunk, rank_map[u], rank_map[v]) for chunk, rank_map in members_of[rep]]
    return RouteResult(sends=tuple(tuple(sorted(sends)) for sends in rounds), objective_s=float(result.fun) * unit_s,
                       reason=message, solve_s=solve_s, nodes=nodes)
