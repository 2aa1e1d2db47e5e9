"""Closed-form alpha-beta-gamma costs of every plait collective algorithm.

The model (Hockney; Thakur, Rabenseifner & Gropp 2005) prices a schedule step by
step: every rank has one full-duplex port, the transfers of a step run at once, and
the next step starts when all have landed. A step costs

    alpha + beta * (bytes the busiest port sends or receives in the step)
          + gamma * (bytes the busiest rank reduces in the step),

so a whole algorithm costs T = R alpha + B beta + G gamma with R its rounds and B, G
summed over steps. :func:`schedule_terms` reads R, B, G off any schedule;
:func:`cost_terms` gives them in closed form, from (collective, algorithm, nbytes,
p) alone, in microseconds even for p = 10^6. The two agree exactly whenever the
chunks divide evenly (a test checks p = 2..64); with uneven chunks the schedule's
largest chunk is at most one element bigger than n/p, so they differ by less than
one element per round.

``nbytes`` is the size of the tensor the user passes: all_reduce, broadcast and
reduce the tensor; all_gather the output (p chunks); reduce_scatter, gather, scatter
and all_to_all the p-chunk buffer (all_to_all: the input).

Pipelined algorithms (ring broadcast/reduce chains and the binary trees) cut the
buffer into S segments; :func:`pipeline_segments` is the rule plait's executor uses.
"""

from __future__ import annotations

import math
from typing import Sequence

from plait.cost.link import CostTerms, LinkModel

__all__ = [
    "PIPELINE_SEGMENT_BYTES",
    "MAX_PIPELINE_SEGMENTS",
    "pipeline_segments",
    "cost_terms",
    "level_terms",
    "predict_time_s",
    "schedule_terms",
    "schedule_time_s",
    "shared_host_terms",
    "closed_form_algorithms",
    "uniform_hierarchy_dims",
]

PIPELINE_SEGMENT_BYTES = 256 << 10
MAX_PIPELINE_SEGMENTS = 64
# Sizes beyond this are refused: float64 keeps bytes exact only below 2^53.
MAX_NBYTES = 1 << 53


def pipeline_segments(nbytes: int, segment_bytes: int = PIPELINE_SEGMENT_BYTES) -> int:
    """Segments S of a pipelined algorithm: one per ``segment_bytes``, 1 <= S <= 64."""
    return max(1, min(MAX_PIPELINE_SEGMENTS, int(nbytes) // int(segment_bytes)))


def _ceil_lg(p: int) -> int:
    return max(0, (p - 1).bit_length())


def _fold(p: int) -> tuple[int, int]:
    """(p', r): the largest power of two p' <= p and the r = p - p' ranks folded in."""
    p_pow2 = 1 << (p.bit_length() - 1)
    return p_pow2, p - p_pow2


def _terms(rounds, beta_bytes, gamma_bytes=0.0) -> CostTerms:
    return CostTerms(float(rounds), float(beta_bytes), float(gamma_bytes))


ZERO = CostTerms(0.0, 0.0, 0.0)


# ----- direct, star, pairwise ---------------------------------------------------------------
def _direct(collective: str, p: int, n: float, segments: int) -> CostTerms:
    """One round; the busiest port carries what the formula says (see direct.py)."""
    chunk = n / p
    table = {
        "all_reduce": ((p - 1) * n, (p - 1) * n),
        "reduce_scatter": ((p - 1) * chunk, (p - 1) * chunk),
        "all_gather": ((p - 1) * chunk, 0.0),
        "broadcast": ((p - 1) * n, 0.0),
        "reduce": ((p - 1) * n, (p - 1) * n),
        "gather": ((p - 1) * chunk, 0.0),
        "scatter": ((p - 1) * chunk, 0.0),
        "all_to_all": ((p - 1) * chunk, 0.0),
        "barrier": ((p - 1) * n, (p - 1) * n),
    }
    beta_bytes, gamma_bytes = table[collective]
    return _terms(1, beta_bytes, gamma_bytes)


def _star(collective: str, p: int, n: float, segments: int) -> CostTerms:
    """Parameter server at rank 0: two rounds through the server's port."""
    chunk = n / p
    if collective == "all_reduce":  # push n from each, reduce (p-1) n, pull n to each
        return _terms(2, 2 * (p - 1) * n, (p - 1) * n)
    if collective == "reduce_scatter":  # push everything, send chunk j to rank j
        return _terms(2, (p - 1) * n + (p - 1) * chunk, (p - 1) * n)
    return _terms(2, (p - 1) * chunk + (p - 1) * n)  # all_gather: gather, then broadcast


def _pairwise(collective: str, p: int, n: float, segments: int) -> CostTerms:
    """p - 1 rounds, one chunk each."""
    return _terms(p - 1, (p - 1) * n / p)


# ----- ring ------------------------------------------------------------------------------------
def _ring(collective: str, p: int, n: float, segments: int) -> CostTerms:
    chunk = n / p
    if collective == "all_reduce":
        return _terms(2 * (p - 1), 2 * (p - 1) * chunk, (p - 1) * chunk)
    if collective == "reduce_scatter":
        return _terms(p - 1, (p - 1) * chunk, (p - 1) * chunk)
    if collective == "all_gather":
        return _terms(p - 1, (p - 1) * chunk)
    # pipelined chains: p + S - 2 steps of one segment; a reduce adds each segment it gets
    steps = p + segments - 2
    if collective == "broadcast":
        return _terms(steps, steps * n / segments)
    return _terms(steps, steps * n / segments, steps * n / segments)  # reduce


# ----- binomial trees ----------------------------------------------------------------------------
def _binomial_spread(p: int) -> int:
    """Chunks the busiest port moves over a binomial gather or scatter:
    sum over rounds k of min(2^k, p - 2^k) (= p - 1 when p is a power of two)."""
    return sum(min(1 << k, p - (1 << k)) for k in range(_ceil_lg(p)))


def _tree(collective: str, p: int, n: float, segments: int) -> CostTerms:
    rounds = _ceil_lg(p)
    whole = _terms(rounds, rounds * n)  # broadcast: lg p rounds of the whole buffer
    reduce = _terms(rounds, rounds * n, rounds * n)
    spread = _terms(rounds, _binomial_spread(p) * n / p)  # gather or scatter
    return {
        "all_reduce": reduce + whole,
        "reduce_scatter": reduce + spread,
        "all_gather": spread + whole,
        "broadcast": whole,
        "reduce": reduce,
        "gather": spread,
        "scatter": spread,
        "barrier": reduce + whole,
    }[collective]


# ----- pipelined binary trees ------------------------------------------------------------------
def _heap_roles(q: int, position: int) -> tuple[int, int]:
    """(depth, number of children) of a heap-ordered tree node."""
    depth = (position + 1).bit_length() - 1
    children = sum(1 for c in (2 * position + 1, 2 * position + 2) if c < q)
    return depth, children


def _binary_tree_activity(q: int, position: int, segments: int) -> dict[int, list[int]]:
    """Step -> [segments sent, received, reduced] by one node of the pipelined
    binary tree (plait.comm.algorithms.tree): depth-d nodes send segment s up at
    step (D - d) + s, and down to their children at step D + d + s."""
    depth_max = (q).bit_length() - 1
    depth, children = _heap_roles(q, position)
    steps: dict[int, list[int]] = {}

    def add(step: int, sent: int, received: int, reduced: int) -> None:
        entry = steps.setdefault(step, [0, 0, 0])
        entry[0] += sent
        entry[1] += received
        entry[2] += reduced

    for s in range(segments):
        if depth >= 1:
            add(depth_max - depth + s, 1, 0, 0)  # reduce: up to the parent
            add(depth_max + depth - 1 + s, 0, 1, 0)  # broadcast: from the parent
        if children:
            add(depth_max - depth - 1 + s, 0, children, children)  # reduce: from the children
            add(depth_max + depth + s, children, 0, 0)  # broadcast: to the children
    return steps


def _role_starts(q: int) -> list[int]:
    """Heap positions where a node's (depth, children) may change: 2^d - 1 (a new
    depth) and q//2 - 1, q//2 (the last node with two children, with one, the first
    leaf). Between two consecutive starts every position has the same role."""
    starts = {0, max(0, q // 2 - 1), q // 2}
    power = 1
    while power - 1 < q:
        starts.add(power - 1)
        power <<= 1
    return sorted(s for s in starts if s < q)


def _representative_ranks(p: int, trees: list[tuple[bool, float]]) -> list[int]:
    """The first rank of each run of ranks with the same role in every tree (tree
    positions are r, or p - 1 - r when reversed): O(lg p) ranks whose activities are
    all the activities the p ranks have."""
    starts = {0}
    for reversed_order, _ in trees:
        for position in _role_starts(p):
            # positions [a, b) map to ranks (p - b, p - a] when reversed: a run starts at p - b
            starts.add(p - position if reversed_order and position > 0 else position)
    return sorted(s for s in starts if s < p)


def _pipelined_trees_terms(p: int, trees: list[tuple[bool, float]], segments: int) -> CostTerms:
    """Sum over steps of the busiest port, for binary trees run side by side.

    Each tree is (rank order reversed?, bytes it carries): rank r sits at heap position
    r, or p - 1 - r. A rank's traffic per step depends only on its (depth, children)
    in each tree, which is constant on O(lg p) runs of consecutive ranks, so only the
    first rank of each run is walked: O(lg p (lg p + S)) for any p (walking all p
    ranks took O(p (lg p + S)) time and memory). The walk visits ranks in increasing
    order, so steps are summed in the order a walk over every rank would meet them.
    """
    ranks = _representative_ranks(p, trees)
    per_step: dict[int, dict[int, list[float]]] = {}
    for reversed_order, nbytes in trees:
        segment = nbytes / segments
        for rank in ranks:
            position = p - 1 - rank if reversed_order else rank
            for step, (sent, received, reduced) in _binary_tree_activity(p, position, segments).items():
                entry = per_step.setdefault(step, {}).setdefault(rank, [0.0, 0.0, 0.0])
                entry[0] += sent * segment
                entry[1] += received * segment
                entry[2] += reduced * segment
    rounds = beta_bytes = gamma_bytes = 0.0
    for by_rank in per_step.values():
        rounds += 1
        beta_bytes += max(max(sent, received) for sent, received, _ in by_rank.values())
        gamma_bytes += max(reduced for _, _, reduced in by_rank.values())
    return CostTerms(rounds, beta_bytes, gamma_bytes)


def _binary_tree(collective: str, p: int, n: float, segments: int) -> CostTerms:
    """Pipelined binary tree: 2 floor(lg p) + S - 1 steps of n/S, interior nodes
    moving two segments per step (one per child)."""
    return _pipelined_trees_terms(p, [(False, n)], segments)


def _double_binary_tree(collective: str, p: int, n: float, segments: int) -> CostTerms:
    """Two binary trees carrying n/2 each, the second in reverse rank order."""
    half = math.floor(n / 2)
    return _pipelined_trees_terms(p, [(False, half), (True, n - half)], segments)


# ----- butterflies and Bruck --------------------------------------------------------------------
def _recursive_doubling(collective: str, p: int, n: float, segments: int) -> CostTerms:
    p_pow2, extra = _fold(p)
    rounds = p_pow2.bit_length() - 1
    folded = 1 if extra else 0
    if collective == "all_reduce":
        # fold in (n, reduced), lg p' exchanges of n, fold out (n)
        return _terms(rounds + 2 * folded, (rounds + 2 * folded) * n, (rounds + folded) * n)
    # all_gather: at distance d the busiest window holds d + min(d, r) old chunks
    chunk = n / p
    beta_chunks = sum((1 << k) + min(1 << k, extra) for k in range(rounds))
    beta_bytes = beta_chunks * chunk + folded * (chunk + (p - 1) * chunk)
    return _terms(rounds + 2 * folded, beta_bytes)


def _halving_doubling(collective: str, p: int, n: float, segments: int) -> CostTerms:
    p_pow2, extra = _fold(p)
    rounds = p_pow2.bit_length() - 1
    folded = 1 if extra else 0
    if collective == "all_reduce":
        # fold in n; halving and doubling each move (p'-1)/p' n; fold out n
        half = (p_pow2 - 1) * n / p_pow2
        return _terms(2 * rounds + 2 * folded, 2 * half + 2 * folded * n, half + folded * n)
    # reduce_scatter: fold in n; halving windows of d + min(d, r) chunks of n/p; chunk back
    chunk = n / p
    window_bytes = sum((1 << k) + min(1 << k, extra) for k in range(rounds)) * chunk
    return _terms(rounds + 2 * folded, folded * (n + chunk) + window_bytes, folded * n + window_bytes)


def _bruck(collective: str, p: int, n: float, segments: int) -> CostTerms:
    rounds = _ceil_lg(p)
    if collective == "barrier":
        return _terms(rounds, rounds * n, rounds * n)
    return _terms(rounds, (p - 1) * n / p)


# ----- hierarchical -----------------------------------------------------------------------------
def uniform_hierarchy_dims(hierarchy) -> tuple[int, ...] | None:
    """Group sizes per level, outermost first, of a hierarchy with equal groups at
    every level and consecutive ranks (``"2x4"`` -> (2, 4)); None when it is not."""
    if hierarchy is None:
        return None
    if isinstance(hierarchy, str):
        try:
            dims = tuple(int(x) for x in hierarchy.replace(" ", "").split("x"))
        except ValueError:
            return None
        return dims if all(d >= 1 for d in dims) else None
    dims = []
    level = hierarchy
    while not isinstance(level, int):
        sizes = {len(child) if not isinstance(child, int) else None for child in level} if level else {0}
        dims.append(len(level))
        if None in sizes:
            break
        if len(sizes) != 1:
            return None
        level = level[0]
    leaves = []

    def walk(node):
        if isinstance(node, int):
            leaves.append(node)
        else:
            for child in node:
                walk(child)

    walk(hierarchy)
    if leaves != list(range(len(leaves))):
        return None
    total = 1
    for d in dims:
        total *= d
    return tuple(dims) if total == len(leaves) else None


def _hierarchical_levels(p: int, n: float, dims: tuple[int, ...]) -> list[tuple[int, CostTerms]]:
    """BlueConnect on uniform groups: ring reduce-scatter in the bottom groups (size
    g), the same algorithm one level up on n/g, then ring all-gather in the groups.
    Returns (level, terms) with level 0 the outermost."""
    dims = tuple(d for d in dims if d > 1) or (1,)
    if len(dims) == 1:
        return [(0, _ring("all_reduce", dims[0], n, 1) if dims[0] > 1 else ZERO)]
    g = dims[-1]
    level = len(dims) - 1
    down = _ring("reduce_scatter", g, n, 1)
    up = _ring("all_gather", g, n, 1)
    inner = _hierarchical_levels(p // g, n / g, dims[:-1])
    return [(level, down)] + inner + [(level, up)]


# ----- the registry ------------------------------------------------------------------------------
_FLAT = {
    "direct": _direct,
    "star": _star,
    "pairwise": _pairwise,
    "ring": _ring,
    "tree": _tree,
    "binary_tree": _binary_tree,
    "double_binary_tree": _double_binary_tree,
    "recursive_doubling": _recursive_doubling,
    "halving_doubling": _halving_doubling,
    "bruck": _bruck,
}
_SUPPORTED = {
    "direct": ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
               "scatter", "all_to_all", "barrier"),
    "star": ("all_reduce", "reduce_scatter", "all_gather"),
    "pairwise": ("all_to_all",),
    "ring": ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"),
    "tree": ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
             "scatter", "barrier"),
    "binary_tree": ("all_reduce",),
    "double_binary_tree": ("all_reduce",),
    "recursive_doubling": ("all_reduce", "all_gather"),
    "halving_doubling": ("all_reduce", "reduce_scatter"),
    "bruck": ("all_gather", "barrier"),
    "hierarchical": ("all_reduce",),
}


def closed_form_algorithms(collective: str) -> list[str]:
    """Algorithms with a closed form for ``collective``."""
    return [name for name, collectives in _SUPPORTED.items() if collective in collectives]


def _check(collective: str, algorithm: str, nbytes, world_size, segments) -> None:
    if algorithm not in _SUPPORTED:
        raise ValueError(f"no cost model for algorithm {algorithm!r}; known: {', '.join(_SUPPORTED)}")
    if collective not in _SUPPORTED[algorithm]:
        raise ValueError(
            f"algorithm {algorithm!r} does not implement {collective!r}; algorithms for "
            f"{collective}: {', '.join(closed_form_algorithms(collective)) or 'none'}"
        )
    problems = []
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        problems.append(f"world_size={world_size!r} must be an integer >= 1")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        problems.append(f"nbytes={nbytes!r} must be a finite number >= 0")
    elif nbytes > MAX_NBYTES:
        problems.append(f"nbytes={nbytes!r} is above 2^53 bytes (8 PiB); sizes that large overflow exact counting")
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        problems.append(f"segments={segments!r} must be an integer >= 1")
    if problems:
        raise ValueError("; ".join(problems))


def level_terms(
    collective: str,
    algorithm: str,
    nbytes: float,
    world_size: int,
    *,
    hierarchy=None,
    segments: int | None = None,
) -> list[tuple[int, CostTerms]]:
    """Closed-form (level, terms) pairs; level 0 is the outermost (slowest) link.

    Flat algorithms have one level. ``hierarchical`` needs ``hierarchy`` with equal
    groups at each level (``"4x8"`` or nested lists of consecutive ranks); other
    hierarchies have no closed form: price their schedule with :func:`schedule_terms`.
    ``segments`` defaults to :func:`pipeline_segments` of ``nbytes``.
    """
    if segments is None:
        segments = pipeline_segments(int(nbytes))
    _check(collective, algorithm, nbytes, world_size, segments)
    p, n = world_size, float(nbytes)
    if p == 1 or (n == 0 and collective != "barrier"):
        return [(0, ZERO)]
    if algorithm == "hierarchical":
        dims = (p,) if hierarchy is None else uniform_hierarchy_dims(hierarchy)
        if dims is None or math.prod(dims) != p:
            raise ValueError(
                f"hierarchy {hierarchy!r} has no closed form for p={p}: the model covers equal "
                "groups of consecutive ranks ('4x8'); price other hierarchies from their "
                "schedule with plait.cost.alpha_beta.schedule_terms"
            )
        return _hierarchical_levels(p, n, dims)
    return [(0, _FLAT[algorithm](collective, p, n, segments))]


def cost_terms(collective: str, algorithm: str, nbytes: float, world_size: int, *,
               hierarchy=None, segments: int | None = None) -> CostTerms:
    """Closed-form (rounds, beta bytes, gamma bytes), all levels summed."""
    total = ZERO
    for _, terms in level_terms(collective, algorithm, nbytes, world_size,
                                hierarchy=hierarchy, segments=segments):
        total = total + terms
    return total


def _links(link, levels: int) -> list[LinkModel]:
    """One link model per level: a single LinkModel serves every level; a sequence
    must give one per level, outermost first (a one-level cost takes the first)."""
    if isinstance(link, LinkModel):
        return [link] * levels
    if isinstance(link, (str, bytes)) or not hasattr(link, "__iter__"):
        raise TypeError(f"link must be a LinkModel or a sequence of LinkModels, got {link!r}")
    links = list(link)
    if not links or not all(isinstance(x, LinkModel) for x in links):
        raise TypeError(f"link must be a LinkModel or a sequence of LinkModels, got {link!r}")
    if levels == 1:
        return links[:1]
    if len(links) != levels:
        raise ValueError(
            f"{len(links)} link model(s) for a {levels}-level hierarchy; give one per level, outermost first"
        )
    return links


def predict_time_s(
    collective: str,
    algorithm: str,
    nbytes: float,
    world_size: int,
    link: LinkModel | Sequence[LinkModel],
    *,
    hierarchy=None,
    segments: int | None = None,
) -> float:
    """Predicted seconds of ``algorithm``'s ``collective`` on ``nbytes`` over p ranks.

    ``link`` is one LinkModel, or one per hierarchy level (outermost first) for
    ``hierarchical``; a flat algorithm given several is priced on the first, the
    slowest level, which a flat ring or butterfly crosses in every step.
    """
    terms = level_terms(collective, algorithm, nbytes, world_size, hierarchy=hierarchy, segments=segments)
    links = _links(link, 1 + max(level for level, _ in terms))
    return sum(t.time_s(links[level]) for level, t in terms)


# ----- schedule-derived ---------------------------------------------------------------------------
def schedule_terms(schedule, itemsize: int) -> CostTerms:
    """(rounds, beta bytes, gamma bytes) read off a schedule: per step, the busiest
    port's bytes sent or received and the busiest rank's bytes reduced.

    ``schedule`` is anything with ``.steps`` whose items have ``.transfers`` of
    objects with ``src, dst, numel, reduce`` (a plait.comm Schedule).
    """
    rounds = beta_numel = gamma_numel = 0
    for step in schedule.steps:
        if not step.transfers:
            continue
        rounds += 1
        sent: dict[int, int] = {}
        received: dict[int, int] = {}
        reduced: dict[int, int] = {}
        for t in step.transfers:
            sent[t.src] = sent.get(t.src, 0) + t.numel
            received[t.dst] = received.get(t.dst, 0) + t.numel
            if t.reduce:
                reduced[t.dst] = reduced.get(t.dst, 0) + t.numel
        beta_numel += max(max(sent.values()), max(received.values()))
        gamma_numel += max(reduced.values(), default=0)
    return CostTerms(float(rounds), float(beta_numel * itemsize), float(gamma_numel * itemsize))


def schedule_time_s(schedule, link: LinkModel, itemsize: int) -> float:
    """T = R alpha + B beta + G gamma of a schedule on one link model."""
    return schedule_terms(schedule, itemsize).time_s(link)


def shared_host_terms(schedule, itemsize: int, ranks_sharing: int) -> CostTerms:
    """The cost on one host whose ranks share its cores and memory: every message,
    byte and reduction is work for the same CPUs, so a schedule costs its total work
    divided by the ``ranks_sharing`` ranks a calibration ran busy at once:

        T = (alpha * messages + beta * bytes sent + gamma * bytes reduced) / ranks_sharing.

    alpha, beta and gamma are per-rank prices measured with ``ranks_sharing`` ranks
    all busy (plait calibrate's ring shift), where this equals the one-port model.
    It is the right model when ranks outnumber cores (4 gloo ranks on 2 cores): there
    a step in which one rank receives three messages costs about what three ranks
    receiving one each cost, which the one-port model prices three times higher.
    """
    if isinstance(ranks_sharing, bool) or not isinstance(ranks_sharing, int) or ranks_sharing < 1:
        raise ValueError(f"ranks_sharing={ranks_sharing!r} must be an integer >= 1")
    messages = sent = reduced = 0
    for step in schedule.steps:
        for t in step.transfers:
            messages += 1
            sent += t.numel
            if t.reduce:
                reduced += t.numel
    return CostTerms(messages / ranks_sharing, sent * itemsize / ranks_sharing,
                     reduced * itemsize / ranks_sharing)
