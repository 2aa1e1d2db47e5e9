"""Synthesised collectives (TACCL-style): a MILP picks chunk routes and rounds for a topology.

From a :class:`~plait.cost.topology.Topology` and a :class:`Sketch` (which rank pairs
may talk, how finely each rank's data is cut, how many rounds), ``synth_milp`` solves
an all-gather as a MILP: binary x[c, e, t] says chunk c crosses rank pair e in round
t; each round costs its slowest route's latency plus its busiest physical link's bytes
over that link's bandwidth, and the sum over rounds is minimised (see that module for
the whole formulation and its size). Round t of the solution becomes step t of the
schedule.

    all_gather  = the solved rounds, copies of chunk regions         T = sum_t tau_t
    all_reduce  = reduce-scatter + all-gather, where reduce-scatter is the all-gather
                  reversed in time and direction with reduce=True: every chunk's
                  route is a tree rooted at its owner (each rank receives each chunk
                  once), so run backwards it sums the chunk at its owner, leaves
                  first.                                             T ~ 2 sum_t tau_t

Layouts. all_reduce: the n elements are cut into K = p C contiguous chunks
(``chunk_bounds``), rank r owns chunks rC .. rC + C - 1. all_gather: the buffer is
p regions of m = n / p, rank r's region cut into C chunks, chunk rC + j its j-th.

The routes depend on the chunk size (latency-bound small chunks want few rounds,
bandwidth-bound large ones want to spare slow links), so one MILP is solved per size
bucket (the chunk's bytes rounded up to a power of two) and cached in memory per
(topology fingerprint, bucket, sketch, solver limits), optionally also as JSON under
``cache_dir``; both collectives read the same all-gather routes. Every rank builds
its schedule on its own, so the result must not depend on the clock: the solver
stops on work limits (``node_limit``, ``mip_rel_gap``), and a solve that finds no
solution, is refused by the sketch, or hits the wall-clock backstop falls back,
with a warning, to the ring algorithm.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from plait.comm.algorithms import ring
from plait.comm.algorithms.synth_milp import RouteProblem, solve_routes, unreachable
from plait.comm.schedule import Step, Transfer, chunk_bounds
from plait.cost.topology_io import topology_fingerprint

__all__ = ["Sketch", "Synthesis", "synthesize", "model_time_s", "clear_cache",
           "BUILDERS", "NODE_LIMIT", "MIP_REL_GAP", "BACKSTOP_TIME_LIMIT_S"]

NODE_LIMIT = 200  # branch-and-bound nodes: a deterministic amount of work
MIP_REL_GAP = 5e-2  # stop once within 5% of the best bound
BACKSTOP_TIME_LIMIT_S = 60.0  # only against a runaway solve; hitting it means fallback
INTER_HOST = ("all", "matching")
_FORMAT = "plait-synth-routes/1"
_MAX_CACHED = 256
_ROUTES: dict[str, dict] = {}  # cache key (JSON) -> {"rounds", "objective_s", "solve_s", "reason"}


@dataclass(frozen=True, kw_only=True)
class Sketch:
    """What the MILP may choose from.

    ``chunks_per_rank``: each rank's data is cut into this many chunks (more chunks:
    finer load balance, a bigger MILP). ``inter_host``: every pair of ranks on one host
    may exchange data; between hosts either every pair may (``"all"``) or only rank k
    of one host with rank k of the other (``"matching"``, k the rank's index within
    its host). ``rounds``: synchronous rounds; None picks
    ceil(log2 hosts) + ceil(log2 largest host) + 1, enough for a doubling tree over
    the hosts and a doubling fan-out inside each, plus one round of slack to detour
    around a slow link or, with "matching", to reach a rank that has a partner.
    ``symmetry``: local rank k's chunks follow local rank 0's routes with every host's
    local indices shifted by k, and, where a permutation of the hosts keeps every
    route's latency and bandwidths, one host's chunks follow another's through it
    (TACCL's symmetry offsets): the MILP shrinks by the host size (up to p), at no
    loss where ranks and hosts are interchangeable.
    """

    chunks_per_rank: int = 1
    inter_host: str = "all"
    rounds: int | None = None
    symmetry: bool = True

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.chunks_per_rank, bool) or not isinstance(self.chunks_per_rank, int) \
                or self.chunks_per_rank < 1:
            problems.append(f"chunks_per_rank={self.chunks_per_rank!r} must be an int >= 1")
        if self.inter_host not in INTER_HOST:
            problems.append(f"inter_host={self.inter_host!r} must be one of {', '.join(map(repr, INTER_HOST))}")
        if self.rounds is not None and (isinstance(self.rounds, bool) or not isinstance(self.rounds, int)
                                        or self.rounds < 1):
            problems.append(f"rounds={self.rounds!r} must be an int >= 1 or None (automatic)")
        if not isinstance(self.symmetry, bool):
            problems.append(f"symmetry={self.symmetry!r} must be True or False")
        if problems:
            raise ValueError("Sketch: " + "; ".join(problems))

    def edges(self, topology) -> tuple[tuple[int, int], ...]:
        """Allowed directed rank pairs (u, v), in (u, v) order."""
        hosts = [topology.host_of(r) for r in range(topology.world_size)]
        local = [hosts[:r].count(hosts[r]) for r in range(len(hosts))]
        return tuple((u, v) for u in range(len(hosts)) for v in range(len(hosts))
                     if u != v and (hosts[u] == hosts[v] or self.inter_host == "all" or local[u] == local[v]))

    def rounds_for(self, topology) -> int:
        if self.rounds is not None:
            return self.rounds
        groups = topology.hierarchy()
        return math.ceil(math.log2(len(groups))) + math.ceil(math.log2(max(map(len, groups)))) + 1


@dataclass(frozen=True, kw_only=True)
class Synthesis:
    """A synthesised schedule: its steps, which algorithm they are (``"synth"`` or
    ``"ring (fallback: <why>)"``), their time under the MILP's cost model at the
    actual chunk sizes (``model_time_s``), the solver's wall time, whether the routes
    came from a cache, the size bucket and the MILP's own objective for an all-gather
    of chunks of exactly ``bucket_bytes`` (nan after a fallback)."""

    steps: tuple[Step, ...]
    used: str
    objective_s: float
    solve_s: float
    from_cache: bool = False
    bucket_bytes: int = 0
    milp_objective_s: float = math.nan


def clear_cache() -> None:
    """Forget every route solved in this process (the disk cache stays)."""
    _ROUTES.clear()


# ----- chunks and the cost model ---------------------------------------------------------------
def _chunk_regions(collective: str, world_size: int, buffer_numel: int, chunks_per_rank: int):
    """(offset, numel) of each chunk in the buffer; chunk c is owned by rank c // C."""
    if collective == "all_reduce":
        return chunk_bounds(0, buffer_numel, world_size * chunks_per_rank)
    if buffer_numel % world_size:
        raise ValueError(f"synth all_gather: buffer of {buffer_numel} elements is not p={world_size} "
                         "equal regions (it must be world_size * input numel)")
    per_rank = buffer_numel // world_size
    return [region for r in range(world_size) for region in chunk_bounds(r * per_rank, per_rank, chunks_per_rank)]


def _bucket_bytes(chunk_bytes: int) -> int:
    """The power of two at or above ``chunk_bytes``: one MILP serves the whole bucket."""
    return 1 << max(0, math.ceil(math.log2(max(1, chunk_bytes))))


def model_time_s(steps, topology, itemsize: int) -> float:
    """Any schedule priced the way the MILP prices a round: per step, the slowest
    route's latency plus the busiest directed link's bytes / bandwidth, summed."""
    capacity, latency = topology.capacity_bytes_per_s, topology.latency_s
    total = 0.0
    for step in steps:
        load_bytes: dict[int, float] = {}
        step_latency_s = 0.0
        for t in step.transfers:
            route = topology.route(t.src, t.dst)
            step_latency_s = max(step_latency_s, float(sum(latency[link] for link in route)))
            for link in route:
                load_bytes[link] = load_bytes.get(link, 0.0) + t.numel * itemsize
        if step.transfers:
            total += step_latency_s + max((b / capacity[link] for link, b in load_bytes.items()), default=0.0)
    return total


def _route_problem(topology, sketch: Sketch, chunk_bytes: int) -> RouteProblem:
    edges = sketch.edges(topology)
    routes = [topology.route(u, v) for u, v in edges]
    latency = topology.latency_s
    p, pieces = topology.world_size, sketch.chunks_per_rank
    groups = topology.hierarchy()
    return RouteProblem(
        world_size=p, owners=tuple(c // pieces for c in range(p * pieces)), edges=edges,
        edge_links=tuple(tuple(route) for route in routes),
        edge_latency_s=tuple(float(sum(latency[link] for link in route)) for route in routes),
        capacity_bytes_per_s=tuple(float(b) for b in topology.capacity_bytes_per_s),
        chunk_bytes=chunk_bytes, rounds=sketch.rounds_for(topology), groups=groups,
        orbits=_orbits(topology, groups, pieces, sketch))


def _orbits(topology, groups, pieces: int, sketch: Sketch):
    """Chunk orbits (see ``synth_milp``). With symmetry, local rank 0's j-th chunk on a
    host stands for local rank k's, through the map shifting every host's local
    indices by k; where a permutation of the hosts keeps the costs
    (``_host_symmetries``), one host's chunks also stand for those of the hosts it is
    mapped to. Without symmetry, or under "matching" with hosts of different sizes
    (where the shift breaks the k-to-k pairing), every chunk stands alone."""
    p = sum(map(len, groups))
    if not sketch.symmetry or (sketch.inter_host == "matching" and len(set(map(len, groups))) > 1):
        return tuple((c, ((c, tuple(range(p))),)) for c in range(p * pieces))

    def rank_map(host_perm, k: int) -> tuple[int, ...]:
        image = [0] * p
        for i, group in enumerate(groups):
            target = groups[host_perm[i]]
            for j, rank in enumerate(group):
                image[rank] = target[(j + k) % len(target)]
        return tuple(image)

    orbits, covered = [], set()
    for i, group in enumerate(groups):
        if i in covered:
            continue
        reached = {}  # image host -> the first host permutation (in a fixed order) reaching it
        for host_perm in _host_symmetries(topology, groups, rank_map):
            reached.setdefault(host_perm[i], host_perm)
        covered.update(reached)
        for j in range(pieces):
            members = tuple((groups[h][k] * pieces + j, rank_map(perm, k))
                            for h, perm in sorted(reached.items()) for k in range(len(groups[h])))
            orbits.append((group[0] * pieces + j, members))
    return tuple(orbits)


def _host_symmetries(topology, groups, rank_map) -> list[tuple[int, ...]]:
    """Host permutations that keep every rank pair's route latency and link bandwidths,
    identity first: all of them for up to 7 equal hosts (a uniform mesh: all; a ring
    with one slow link: the reflection across it), cyclic shifts beyond, none for
    hosts of different sizes."""
    count = len(groups)
    identity = tuple(range(count))
    if count < 2 or len(set(map(len, groups))) > 1:
        return [identity]
    capacity, latency = topology.capacity_bytes_per_s, topology.latency_s
    signatures: dict[tuple[int, int], tuple] = {}

    def signature(u: int, v: int) -> tuple:
        if (u, v) not in signatures:
            route = topology.route(u, v)
            signatures[u, v] = (round(float(sum(latency[link] for link in route)), 15),
                                tuple(sorted(float(capacity[link]) for link in route)))
        return signatures[u, v]

    p = topology.world_size
    pairs = [(u, v) for u in range(p) for v in range(p) if u != v]
    candidates = (itertools.permutations(range(count)) if count <= 7
                  else (tuple((i + s) % count for i in range(count)) for s in range(count)))
    kept = []
    for host_perm in candidates:
        image = rank_map(host_perm, 0)
        if all(signature(u, v) == signature(image[u], image[v]) for u, v in pairs):
            kept.append(host_perm)
    return kept


# ----- solving, with the caches ----------------------------------------------------------------------
def _routes(topology, sketch: Sketch, bucket_bytes: int, *, cache_dir, node_limit: int,
            mip_rel_gap: float, time_limit_s: float) -> tuple[dict, bool]:
    """The all-gather rounds for this bucket (or the reason there are none), and
    whether they came from a cache."""
    problem = _route_problem(topology, sketch, bucket_bytes)
    key = {"format": _FORMAT, "topology": topology_fingerprint(topology), "bucket_bytes": bucket_bytes,
           "sketch": asdict(sketch), "rounds": problem.rounds, "node_limit": node_limit, "mip_rel_gap": mip_rel_gap}
    memory_key = json.dumps(key, sort_keys=True)
    if memory_key in _ROUTES:
        return _ROUTES[memory_key], True
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"synth-{hashlib.sha256(memory_key.encode()).hexdigest()[:32]}.json"
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):  # absent, unreadable or half-written by an old version: solve
            stored = {}
        if isinstance(stored, dict) and stored.get("key") == key:
            entry = {"rounds": [[tuple(send) for send in sends] for sends in stored["rounds"]],
                     "objective_s": stored["objective_s"], "solve_s": stored["solve_s"], "reason": None}
            _ROUTES[memory_key] = entry
            return entry, True
    reason = unreachable(problem)
    if reason is not None:
        entry = {"rounds": None, "objective_s": math.nan, "solve_s": 0.0, "reason": reason}
    else:
        result = solve_routes(problem, node_limit=node_limit, mip_rel_gap=mip_rel_gap, time_limit_s=time_limit_s)
        entry = {"rounds": None if result.sends is None else [list(sends) for sends in result.sends],
                 "objective_s": result.objective_s, "solve_s": result.solve_s,
                 "reason": None if result.sends is not None else result.reason}
    if len(_ROUTES) >= _MAX_CACHED:
        _ROUTES.pop(next(iter(_ROUTES)))
    _ROUTES[memory_key] = entry
    if path is not None and entry["rounds"] is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps({"key": key, "rounds": entry["rounds"], "objective_s": entry["objective_s"],
                                       "solve_s": entry["solve_s"]}))
        os.replace(scratch, path)  # atomic: a rank reading it never sees half a file
    return entry, False


def _gather_steps(rounds, regions) -> list[Step]:
    """Round t -> a step copying each sent chunk's region; a rank's contiguous chunks
    to one peer travel as one message."""
    steps = []
    for sends in rounds:
        merged: list[list[int]] = []  # [src, dst, offset, numel]
        for chunk, src, dst in sorted(sends, key=lambda s: (s[1], s[2], regions[s[0]][0])):
            offset, numel = regions[chunk]
            last = merged[-1] if merged else None
            if last and last[:2] == [src, dst] and last[2] + last[3] == offset:
                last[3] += numel
            else:
                merged.append([src, dst, offset, numel])
        steps.append(Step(tuple(Transfer(src, dst, offset, offset, numel, False)
                                for src, dst, offset, numel in merged)))
    return steps


def _reduce_scatter_steps(rounds, regions) -> list[Step]:
    """The all-gather reversed: its last round first, every send turned round into a
    reducing one. Chunks are not merged: two children reducing into one rank in the
    same step must cover identical ranges."""
    return [Step(tuple(Transfer(dst, src, regions[chunk][0], regions[chunk][0], regions[chunk][1], True)
                       for chunk, src, dst in sorted(sends, key=lambda s: (s[2], s[1], s[0]))))
            for sends in reversed(rounds)]


def synthesize(topology, collective: str, buffer_numel: int, itemsize: int = 4, sketch: Sketch | None = None, *,
               cache_dir=None, node_limit: int = NODE_LIMIT, mip_rel_gap: float = MIP_REL_GAP,
               time_limit_s: float = BACKSTOP_TIME_LIMIT_S) -> Synthesis:
    """The synthesised schedule of ``collective`` ("all_gather" or "all_reduce") for a
    buffer of ``buffer_numel`` elements of ``itemsize`` bytes on ``topology``'s ranks,
    or the ring's with a warning when synthesis fails (``Synthesis.used`` says which)."""
    sketch = Sketch() if sketch is None else sketch
    if not isinstance(sketch, Sketch):
        raise TypeError(f"synth: sketch must be a plait.comm.algorithms.synth.Sketch, got {type(sketch).__name__}")
    if collective not in BUILDERS:
        raise ValueError(f"synth implements {', '.join(BUILDERS)}, not {collective!r}")
    p = topology.world_size
    if p == 1 or buffer_numel == 0:
        return Synthesis(steps=(), used="synth", objective_s=0.0, solve_s=0.0)
    regions = _chunk_regions(collective, p, buffer_numel, sketch.chunks_per_rank)
    bucket_bytes = _bucket_bytes(max(numel for _, numel in regions) * itemsize)
    entry, from_cache = _routes(topology, sketch, bucket_bytes, cache_dir=cache_dir,
                                node_limit=node_limit, mip_rel_gap=mip_rel_gap, time_limit_s=time_limit_s)
    if entry["rounds"] is None:
        used = f"ring (fallback: {entry['reason']})"
        warnings.warn(f"synth {collective} on {p} ranks: using {used}", RuntimeWarning, stacklevel=2)
        steps = ring.BUILDERS[collective](p, buffer_numel, None, {})
    else:
        steps = _gather_steps(entry["rounds"], regions)
        if collective == "all_reduce":
            steps = _reduce_scatter_steps(entry["rounds"], regions) + steps
        used = "synth"
    return Synthesis(steps=tuple(steps), used=used, objective_s=model_time_s(steps, topology, itemsize),
                     solve_s=entry["solve_s"], from_cache=from_cache, bucket_bytes=bucket_bytes,
                     milp_objective_s=entry["objective_s"])


def _checked_topology(world_size: int, options: dict):
    topology = options.get("topology")
    if topology is None:
        raise ValueError(f'algorithm "synth" needs a topology: pass options["topology"], a '
                         f"plait.cost.topology.Topology allocating {world_size} ranks")
    if topology.world_size != world_size:
        raise ValueError(f"synth: topology {topology.name!r} allocates {topology.world_size} ranks but the "
                         f"collective runs on {world_size}; pass a topology with {world_size} ranks "
                         f"(topology.with_allocation(...)) or run on {topology.world_size}")
    return topology


def all_gather(p: int, n: int, root, options) -> list[Step]:
    """Synthesised all-gather: the MILP's rounds on options["topology"]; every rank
    receives each of the p C chunks once: T = sum over rounds of (slowest latency +
    busiest link bytes / bandwidth), minimised."""
    topology = _checked_topology(p, options)
    return list(synthesize(topology, "all_gather", n, options.get("itemsize", 4), options.get("sketch"),
                           cache_dir=options.get("cache_dir")).steps)


def all_reduce(p: int, n: int, root, options) -> list[Step]:
    """Synthesised all-reduce: the all-gather routes reversed (reduce-scatter, each chunk
    summed along its tree at its owner) then the all-gather: 2R steps,
    T ~ 2 sum over rounds of (latency + busiest link bytes / bandwidth)."""
    topology = _checked_topology(p, options)
    return list(synthesize(topology, "all_reduce", n, options.get("itemsize", 4), options.get("sketch"),
                           cache_dir=options.get("cache_dir")).steps)


BUILDERS = {"all_gather": all_gather, "all_reduce": all_reduce}
