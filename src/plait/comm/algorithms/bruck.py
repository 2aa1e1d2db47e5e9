"""Bruck's algorithms: all-gather and the dissemination barrier, any p, ceil(lg p) rounds."""

from __future__ import annotations

from plait.comm.schedule import Step, Transfer, chunk_bounds, wrapped_run


def all_gather(p, n, root, options):
    """Bruck all-gather. Before round k rank r holds the 2^k chunks r, r+1, ...
    (mod p); it sends them to r - 2^k and receives r + 2^k's. The last round sends
    only the p - 2^k chunks still missing. ceil(lg p) rounds, (p-1)/p n bytes per rank:
    T = ceil(lg p) a + (p-1)/p n b. Chunks stay at their own offsets, so no final
    rotation is needed; a wrapped run of chunks travels as two messages.
    """
    bounds = chunk_bounds(0, n, p)
    steps = []
    have = 1
    while have < p:
        count = min(have, p - have)
        transfers = []
        for r in range(p):
            transfers += wrapped_run(bounds, r, count, r, (r - have) % p)
        steps.append(Step(tuple(transfers)))
        have += count
    return steps


def barrier(p, n, root, options):
    """Dissemination barrier: in round k rank r signals r + 2^k. After ceil(lg p)
    rounds every rank has heard, directly or not, from every other: T = ceil(lg p) a."""
    steps = []
    distance = 1
    while distance < p:
        steps.append(Step(tuple(Transfer(r, (r + distance) % p, 0, 0, n, True) for r in range(p))))
        distance *= 2
    return steps


BUILDERS = {"all_gather": all_gather, "barrier": barrier}
