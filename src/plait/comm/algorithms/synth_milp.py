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

    x[c, (u, v), t] <= h[c, u, t-1]                    a rank sends only what it held
                                                       at the end of the previous round
    h[c, v, t] = h[c, v, t-1] + sum_u x[c, (u, v), t]  holding grows by what arrives; as h
                                                       is binary and starts at 0 off the
                                                       owner, each rank receives each
                                                       chunk at most once (exactly once,
                                                       with h[., ., R] = 1): every
                                                       chunk's route is a tree rooted
                                                       at its owner, which reduce-scatter
                                                       reverses
    sum_u latency(u, v) x[c, (u, v), t] <= lat_t       (one term at most is 1)
    lat_t + sum_{c, e crossing l} x[c, e, t] chunk_bytes / capacity(l) <= tau_t
                                                       for every physical directed link l

Objective: minimise sum_t tau_t. A round thus costs its slowest route's latency plus
its busiest link's bytes over that link's bandwidth (``round_time_s``); an unused
round costs nothing. Because every non-owner receives every chunk exactly once, the
number of sends is fixed at K (p - 1): no redundant send can be chosen, so no extra
weight on sum x is needed to discourage them.

Size: x has at most K |E| R binaries (pruned to sends a rank can make: a rank u can
hold chunk c in round t only if it is within t - 1 hops of the owner), h has
K p (R + 1); rows are one per x, one per (c, v, t) twice, and one per (round, link
some edge crosses). For p = 16, K = 16, all pairs allowed and R = 5 that is about
19,000 binaries. Branch and bound stops after ``node_limit`` nodes or at
``mip_rel_gap``: both are amounts of work, not of time, so every rank that builds the
model gets the same answer; the wall-clock limit is only a backstop, and a solve
that hits it (or finds no solution) is reported as a failure the caller turns into
a deterministic fallback.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix

__all__ = ["RouteProblem", "RouteResult", "hop_distances", "solve_routes", "round_time_s"]

# (chunk, src rank, dst rank): one chunk crossing one edge
Send = tuple[int, int, int]
AGGREGATE = False
CUTS = True


@dataclass(frozen=True, kw_only=True)
class RouteProblem:
    """Plain data the MILP is built from (no topology object: easy to test and cache).

    ``edges[i] = (u, v)`` is an allowed directed rank pair; ``edge_links[i]`` the
    physical directed link ids its route crosses and ``edge_latency_s[i]`` the sum of
    their latencies; ``capacity_bytes_per_s[l]`` is link l's bandwidth.
    """

    world_size: int
    owners: tuple[int, ...]  # owner rank of each chunk
    edges: tuple[tuple[int, int], ...]
    edge_links: tuple[tuple[int, ...], ...]
    edge_latency_s: tuple[float, ...]
    capacity_bytes_per_s: tuple[float, ...]
    chunk_bytes: int
    rounds: int
    groups: tuple[tuple[int, ...], ...] = ()  # ranks of each host, for the cut rows


@dataclass(frozen=True, kw_only=True)
class RouteResult:
    """``sends[t]`` lists the (chunk, src, dst) of round t + 1, sorted; None when the
    solve failed, and ``reason`` then says why."""

    sends: tuple[tuple[Send, ...], ...] | None
    objective_s: float
    reason: str
    solve_s: float
    nodes: int


def hop_distances(world_size: int, edges, source: int) -> list[float]:
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


def round_time_s(sends, chunk_bytes, edge_index: dict, problem: RouteProblem) -> float:
    """The MILP's price of one round: slowest route latency + busiest link's bytes /
    bandwidth. ``chunk_bytes`` maps a chunk to its size in bytes."""
    if not sends:
        return 0.0
    load_bytes: dict[int, float] = {}
    latency_s = 0.0
    for chunk, src, dst in sends:
        edge = edge_index[(src, dst)]
        latency_s = max(latency_s, problem.edge_latency_s[edge])
        for link in problem.edge_links[edge]:
            load_bytes[link] = load_bytes.get(link, 0.0) + chunk_bytes(chunk)
    return latency_s + max(
        (nbytes / problem.capacity_bytes_per_s[link] for link, nbytes in load_bytes.items()), default=0.0)


class _Columns:
    """Variable numbering: names in creation order, so the model is the same every time."""

    def __init__(self) -> None:
        self.index: dict[tuple, int] = {}
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integral: list[int] = []

    def add(self, key: tuple, lower: float, upper: float, integral: bool) -> int:
        self.index[key] = len(self.lower)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integral.append(1 if integral else 0)
        return self.index[key]


class _Rows:
    def __init__(self) -> None:
        self.data: list[float] = []
        self.cols: list[int] = []
        self.ptr: list[int] = [0]
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        for col, coefficient in terms:
            self.cols.append(col)
            self.data.append(coefficient)
        self.ptr.append(len(self.cols))
        self.lower.append(lower)
        self.upper.append(upper)


def solve_routes(problem: RouteProblem, *, node_limit: int, mip_rel_gap: float,
                 time_limit_s: float) -> RouteResult:
    """Build and solve the MILP of the module docstring."""
    p, rounds = problem.world_size, problem.rounds
    owners, edges = problem.owners, problem.edges
    # Times are scaled so the largest coefficient is 1 (HiGHS prefers O(1) numbers).
    chunk_s = {link: problem.chunk_bytes / problem.capacity_bytes_per_s[link]
               for links in problem.edge_links for link in links}
    unit_s = max([*chunk_s.values(), *problem.edge_latency_s, 1e-12])
    into: dict[int, list[int]] = {}
    for e, (u, v) in enumerate(edges):
        into.setdefault(v, []).append(e)

    cols = _Columns()
    for t in range(rounds + 1):
        for c, owner in enumerate(owners):
            for v in range(p):
                if v == owner or (t == rounds and t > 0):
                    lower = upper = 1.0  # the owner always holds it; everyone does at the end
                elif t == 0:
                    lower = upper = 0.0
                else:
                    lower, upper = 0.0, 1.0
                cols.add(("h", c, v, t), lower, upper, True)
    for c, owner in enumerate(owners):
        distance = hop_distances(p, edges, owner)
        for t in range(1, rounds + 1):
            for e, (u, v) in enumerate(edges):
                if v != owner and distance[u] <= t - 1:
                    cols.add(("x", c, e, t), 0.0, 1.0, True)
    for t in range(1, rounds + 1):
        cols.add(("lat", t), 0.0, math.inf, False)
        cols.add(("tau", t), 0.0, math.inf, False)
    x = {key[1:]: col for key, col in cols.index.items() if key[0] == "x"}
    h = {key[1:]: col for key, col in cols.index.items() if key[0] == "h"}

    rows = _Rows()
    if AGGREGATE:
        out_of: dict[tuple, list[int]] = {}
        for (c, e, t), col in x.items():
            u = edges[e][0]
            if u != owners[c]:
                out_of.setdefault((c, u, t), []).append(col)
        for (c, u, t), out in out_of.items():
            rows.add([(col, 1.0) for col in out] + [(h[c, u, t - 1], -float(len(out)))], -math.inf, 0.0)
    else:
      for (c, e, t), col in x.items():  # send only what was held at the end of round t-1
        u = edges[e][0]
        if u != owners[c]:
            rows.add([(col, 1.0), (h[c, u, t - 1], -1.0)], -math.inf, 0.0)
    if CUTS:
        for c, owner in enumerate(owners):
            for group in problem.groups:
                if owner in group:
                    continue
                inside = set(group)
                entering = [(col, 1.0) for (c2, e, t), col in x.items()
                            if c2 == c and edges[e][1] in inside and edges[e][0] not in inside]
                rows.add(entering, 1.0, math.inf)
    link_terms: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for (c, e, t), col in x.items():
        for link in problem.edge_links[e]:
            link_terms.setdefault((t, link), []).append((col, chunk_s[link] / unit_s))
    for t in range(1, rounds + 1):
        lat, tau = cols.index["lat", t], cols.index["tau", t]
        for c, owner in enumerate(owners):
            for v in range(p):
                if v == owner:
                    continue
                arriving = [(x[c, e, t], 1.0) for e in into.get(v, ()) if (c, e, t) in x]
                # holding grows by exactly what arrives
                rows.add([(h[c, v, t], 1.0), (h[c, v, t - 1], -1.0)] + [(col, -1.0) for col, _ in arriving], 0.0, 0.0)
                latency = [(x[c, e, t], problem.edge_latency_s[e] / unit_s)
                           for e in into.get(v, ()) if (c, e, t) in x and problem.edge_latency_s[e] > 0]
                if latency:
                    rows.add(latency + [(lat, -1.0)], -math.inf, 0.0)
        for link in sorted(link for (t_link, link) in link_terms if t_link == t):
            rows.add(link_terms[t, link] + [(lat, 1.0), (tau, -1.0)], -math.inf, 0.0)

    objective = np.zeros(len(cols.lower))
    for t in range(1, rounds + 1):
        objective[cols.index["tau", t]] = 1.0
    matrix = csr_matrix((rows.data, rows.cols, rows.ptr), shape=(len(rows.lower), len(cols.lower)))
    started = time.perf_counter()
    result = milp(objective, integrality=np.array(cols.integral), bounds=Bounds(cols.lower, cols.upper),
                  constraints=LinearConstraint(matrix, rows.lower, rows.upper),
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
    sends = tuple(
        tuple(sorted((c, *edges[e]) for (c, e, t_send), col in x.items() if t_send == t and result.x[col] > 0.5))
        for t in range(1, rounds + 1))
    return RouteResult(sends=sends, objective_s=float(result.fun) * unit_s, reason=message, solve_s=solve_s,
                       nodes=nodes)
