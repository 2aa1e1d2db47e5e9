"""Ring algorithms: reduce-scatter, all-gather, all-reduce, and pipelined chains.

The phase builders take an ordered list of global ranks and a buffer region, so the
hierarchical algorithm reuses them on sub-groups and sub-regions.
"""

from __future__ import annotations

from plait.comm.schedule import Step, Transfer, chunk_bounds, sequential


def ring_reduce_scatter_phase(ranks: list[int], start: int, numel: int) -> list[Step]:
    """Ring reduce-scatter of region [start, start+numel) over ``ranks``.

    The region is cut into q = len(ranks) chunks; at step s, position i sends chunk
    (i - s - 1) mod q to position i + 1, which adds it to its own copy. After q - 1
    steps position i holds chunk i fully reduced. Each rank sends (q-1)/q of the
    region: T = (q-1) a + (q-1)/q n b + (q-1)/q n g.
    """
    q = len(ranks)
    chunks = chunk_bounds(start, numel, q)
    steps = []
    for s in range(q - 1):
        transfers = []
        for i in range(q):
            offset, size = chunks[(i - s - 1) % q]
            transfers.append(Transfer(ranks[i], ranks[(i + 1) % q], offset, offset, size, True))
        steps.append(Step(tuple(transfers)))
    return steps


def ring_all_gather_phase(ranks: list[int], start: int, numel: int) -> list[Step]:
    """Ring all-gather of region [start, start+numel) over ``ranks``.

    Position i starts with chunk i of q; at step s it forwards chunk (i - s) mod q to
    position i + 1. q - 1 steps, (q-1)/q n bytes sent per rank:
    T = (q-1) a + (q-1)/q n b.
    """
    q = len(ranks)
    chunks = chunk_bounds(start, numel, q)
    steps = []
    for s in range(q - 1):
        transfers = []
        for i in range(q):
            offset, size = chunks[(i - s) % q]
            transfers.append(Transfer(ranks[i], ranks[(i + 1) % q], offset, offset, size, False))
        steps.append(Step(tuple(transfers)))
    return steps


def ring_all_reduce_phase(ranks: list[int], start: int, numel: int) -> list[Step]:
    """Ring all-reduce: reduce-scatter then all-gather. 2(q-1) steps of n/q each:
    T = 2(q-1) a + 2(q-1)/q n b + (q-1)/q n g."""
    return sequential(
        ring_reduce_scatter_phase(ranks, start, numel), ring_all_gather_phase(ranks, start, numel)
    )


def chain_broadcast_phase(ranks: list[int], start: int, numel: int, segments: int) -> list[Step]:
    """Pipelined chain broadcast from ranks[0] down the list, in ``segments`` pieces.

    Segment k leaves position j at step j + k, so the chain streams:
    q - 1 + S - 1 steps of n/S each: T = (q + S - 2)(a + n/S b).
    """
    q = len(ranks)
    segs = chunk_bounds(start, numel, max(1, segments))
    steps = []
    for t in range(q - 1 + len(segs) - 1):
        transfers = []
        for j in range(q - 1):
            k = t - j
            if 0 <= k < len(segs):
                offset, size = segs[k]
                transfers.append(Transfer(ranks[j], ranks[j + 1], offset, offset, size, False))
        steps.append(Step(tuple(transfers)))
    return steps


def chain_reduce_phase(ranks: list[int], start: int, numel: int, segments: int) -> list[Step]:
    """Pipelined chain reduce towards ranks[0]: the last position starts, each
    position adds its contribution and forwards. (q + S - 2)(a + n/S b) + n g."""
    q = len(ranks)
    segs = chunk_bounds(start, numel, max(1, segments))
    steps = []
    for t in range(q - 1 + len(segs) - 1):
        transfers = []
        for hop in range(q - 1):  # hop 0: position q-1 -> q-2
            k = t - hop
            if 0 <= k < len(segs):
                offset, size = segs[k]
                src = ranks[q - 1 - hop]
                dst = ranks[q - 2 - hop]
                transfers.append(Transfer(src, dst, offset, offset, size, True))
        steps.append(Step(tuple(transfers)))
    return steps


def rotated(world_size: int, root: int) -> list[int]:
    """Ranks in ring order starting at ``root``."""
    return [(root + i) % world_size for i in range(world_size)]


# ----- collective builders: (world_size, numel, root, options) -> steps ------------
def all_reduce(p: int, n: int, root, options) -> list[Step]:
    """Ring all-reduce: reduce-scatter then all-gather. 2(p-1) steps of n/p:
    T = 2(p-1) a + 2(p-1)/p n b + (p-1)/p n g."""
    return ring_all_reduce_phase(list(range(p)), 0, n)


def reduce_scatter(p: int, n: int, root, options) -> list[Step]:
    """Ring reduce-scatter: p-1 steps of n/p: T = (p-1) a + (p-1)/p n b + (p-1)/p n g."""
    return ring_reduce_scatter_phase(list(range(p)), 0, n)


def all_gather(p: int, n: int, root, options) -> list[Step]:
    """Ring all-gather: p-1 steps of n/p: T = (p-1) a + (p-1)/p n b."""
    return ring_all_gather_phase(list(range(p)), 0, n)


def broadcast(p: int, n: int, root, options) -> list[Step]:
    """Pipelined chain broadcast from root in S segments: T = (p + S - 2)(a + n/S b)."""
    return chain_broadcast_phase(rotated(p, root), 0, n, options.get("segments", 1))


def reduce(p: int, n: int, root, options) -> list[Step]:
    """Pipelined chain reduce to root in S segments: T = (p + S - 2)(a + n/S b) + n g."""
    return chain_reduce_phase(rotated(p, root), 0, n, options.get("segments", 1))


BUILDERS = {
    "all_reduce": all_reduce,
    "reduce_scatter": reduce_scatter,
    "all_gather": all_gather,
    "broadcast": broadcast,
    "reduce": reduce,
}
