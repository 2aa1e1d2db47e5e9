"""Direct (naive), star (parameter server) and pairwise-exchange algorithms."""

from __future__ import annotations

from plait.comm.schedule import Step, Transfer, chunk_bounds


def _one_step(transfers) -> list[Step]:
    return [Step(tuple(transfers))]


# ----- direct: everything in one round ----------------------------------------------------
def direct_all_reduce(p, n, root, options):
    """Naive all-reduce: every rank sends its whole buffer to every other rank and
    reduces all p copies (in rank order, so every rank gets the same bits).
    1 round, (p-1) n bytes sent per rank: T = a + (p-1) n b + (p-1) n g."""
    return _one_step(Transfer(s, d, 0, 0, n, True) for s in range(p) for d in range(p) if s != d)


def direct_reduce_scatter(p, n, root, options):
    """Every rank sends chunk j straight to rank j: T = a + (p-1)/p n b + (p-1)/p n g."""
    bounds = chunk_bounds(0, n, p)
    return _one_step(
        Transfer(s, d, bounds[d][0], bounds[d][0], bounds[d][1], True)
        for s in range(p) for d in range(p) if s != d
    )


def direct_all_gather(p, n, root, options):
    """Every rank sends its chunk straight to every other: T = a + (p-1)/p n b."""
    bounds = chunk_bounds(0, n, p)
    return _one_step(
        Transfer(s, d, bounds[s][0], bounds[s][0], bounds[s][1], False)
        for s in range(p) for d in range(p) if s != d
    )


def direct_broadcast(p, n, root, options):
    """The root sends the buffer to each rank: T = a + (p-1) n b (root's link)."""
    return _one_step(Transfer(root, d, 0, 0, n, False) for d in range(p) if d != root)


def direct_reduce(p, n, root, options):
    """Every rank sends to the root, which reduces: T = a + (p-1) n (b + g)."""
    return _one_step(Transfer(s, root, 0, 0, n, True) for s in range(p) if s != root)


def direct_gather(p, n, root, options):
    """Every rank sends its chunk to the root: T = a + (p-1)/p n b."""
    bounds = chunk_bounds(0, n, p)
    return _one_step(
        Transfer(s, root, bounds[s][0], bounds[s][0], bounds[s][1], False) for s in range(p) if s != root
    )


def direct_scatter(p, n, root, options):
    """The root sends chunk j to rank j: T = a + (p-1)/p n b."""
    bounds = chunk_bounds(0, n, p)
    return _one_step(
        Transfer(root, d, bounds[d][0], bounds[d][0], bounds[d][1], False) for d in range(p) if d != root
    )


def direct_all_to_all(p, n, root, options):
    """All-to-all in one round. The buffer is [input | output], each p chunks of m:
    rank s sends input chunk d to output chunk s of rank d. T = a + (p-1)/p n_in b."""
    m = n // (2 * p)
    return _one_step(
        Transfer(s, d, d * m, p * m + s * m, m, False) for s in range(p) for d in range(p) if s != d
    )


def direct_barrier(p, n, root, options):
    """Every rank signals every other: 1 round, p - 1 messages per rank."""
    return _one_step(Transfer(s, d, 0, 0, n, True) for s in range(p) for d in range(p) if s != d)


# ----- star: the parameter-server pattern ------------------------------------------------
def star_all_reduce(p, n, root, options):
    """Parameter server: all push to rank 0 (which reduces), rank 0 pushes the sum
    back. 2 rounds, 2 (p-1) n bytes through the server's link:
    T = 2a + 2(p-1) n b + (p-1) n g."""
    server = 0
    return _one_step(Transfer(s, server, 0, 0, n, True) for s in range(p) if s != server) + _one_step(
        Transfer(server, d, 0, 0, n, False) for d in range(p) if d != server
    )


def star_reduce_scatter(p, n, root, options):
    """Reduce everything at rank 0, which sends chunk j to rank j:
    T = 2a + (p-1) n b + (p-1)/p n b + (p-1) n g."""
    bounds = chunk_bounds(0, n, p)
    return _one_step(Transfer(s, 0, 0, 0, n, True) for s in range(1, p)) + _one_step(
        Transfer(0, d, bounds[d][0], bounds[d][0], bounds[d][1], False) for d in range(1, p)
    )


def star_all_gather(p, n, root, options):
    """Gather the chunks at rank 0, which sends the whole buffer to everyone:
    T = 2a + (p-1)/p n b + (p-1) n b."""
    return direct_gather(p, n, 0, options) + _one_step(
        Transfer(0, d, 0, 0, n, False) for d in range(1, p)
    )


# ----- pairwise exchange --------------------------------------------------------------------
def pairwise_all_to_all(p, n, root, options):
    """Pairwise exchange: in step k (1..p-1) rank r sends to r + k and receives from
    r - k, one peer per step. T = (p-1) a + (p-1)/p n_in b."""
    m = n // (2 * p)
    steps = []
    for k in range(1, p):
        steps += _one_step(Transfer(s, (s + k) % p, ((s + k) % p) * m, p * m + s * m, m, False) for s in range(p))
    return steps


DIRECT_BUILDERS = {
    "all_reduce": direct_all_reduce,
    "reduce_scatter": direct_reduce_scatter,
    "all_gather": direct_all_gather,
    "broadcast": direct_broadcast,
    "reduce": direct_reduce,
    "gather": direct_gather,
    "scatter": direct_scatter,
    "all_to_all": direct_all_to_all,
    "barrier": direct_barrier,
}
STAR_BUILDERS = {
    "all_reduce": star_all_reduce,
    "reduce_scatter": star_reduce_scatter,
    "all_gather": star_all_gather,
}
PAIRWISE_BUILDERS = {"all_to_all": pairwise_all_to_all}
