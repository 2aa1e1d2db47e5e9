"""Tree algorithms: binomial trees (any p), pipelined binary trees, and the double
binary tree NCCL uses.

Binomial trees work on ranks relative to the root, v = (r - root) mod p. In round
k (k = 0 .. ceil(lg p) - 1) of a reduce, every v with v mod 2^(k+1) == 2^k sends to
v - 2^k; a broadcast runs the same rounds in reverse. So a binomial reduce or
broadcast is ceil(lg p) rounds of the whole buffer: T = ceil(lg p)(a + n b).
"""

from __future__ import annotations

from plait.comm.schedule import Step, Transfer, chunk_bounds, parallel, sequential, wrapped_run


def _rounds(p: int) -> int:
    return max(0, (p - 1).bit_length())


def binomial_reduce_phase(p: int, root: int, start: int, numel: int) -> list[Step]:
    """Binomial-tree reduce to ``root``: ceil(lg p) rounds of n: T = ceil(lg p)(a + n b + n g)."""
    steps = []
    for k in range(_rounds(p)):
        transfers = []
        for v in range(p):
            if v % (2 << k) == (1 << k):
                src, dst = (v + root) % p, (v - (1 << k) + root) % p
                transfers.append(Transfer(src, dst, start, start, numel, True))
        steps.append(Step(tuple(transfers)))
    return steps


def binomial_broadcast_phase(p: int, root: int, start: int, numel: int) -> list[Step]:
    """Binomial-tree broadcast from ``root``: ceil(lg p) rounds of n: T = ceil(lg p)(a + n b)."""
    steps = []
    for k in reversed(range(_rounds(p))):
        transfers = []
        for v in range(0, p, 2 << k):
            if v + (1 << k) < p:
                src, dst = (v + root) % p, (v + (1 << k) + root) % p
                transfers.append(Transfer(src, dst, start, start, numel, False))
        steps.append(Step(tuple(transfers)))
    return steps


def _relative_range(p: int, root: int, lo: int, hi: int, chunks, src: int, dst: int):
    """Transfers moving the chunks of relative ranks [lo, hi) from src to dst."""
    return wrapped_run(chunks, (lo + root) % p, hi - lo, src, dst)


def binomial_gather_phase(p: int, root: int, numel: int) -> list[Step]:
    """Binomial gather of p chunks to ``root``. Round k moves 2^k chunks per sender:
    ceil(lg p) rounds, (p-1)/p n bytes into the root: T = lg p a + (p-1)/p n b."""
    chunks = chunk_bounds(0, numel, p)
    steps = []
    for k in range(_rounds(p)):
        transfers = []
        for v in range(p):
            if v % (2 << k) == (1 << k):
                hi = min(v + (1 << k), p)
                src, dst = (v + root) % p, (v - (1 << k) + root) % p
                transfers += _relative_range(p, root, v, hi, chunks, src, dst)
        steps.append(Step(tuple(transfers)))
    return steps


def binomial_scatter_phase(p: int, root: int, numel: int) -> list[Step]:
    """Binomial scatter of p chunks from ``root`` (the gather reversed):
    T = ceil(lg p) a + (p-1)/p n b."""
    chunks = chunk_bounds(0, numel, p)
    steps = []
    for k in reversed(range(_rounds(p))):
        transfers = []
        for v in range(0, p, 2 << k):
            w = v + (1 << k)
            if w < p:
                hi = min(w + (1 << k), p)
                src, dst = (v + root) % p, (w + root) % p
                transfers += _relative_range(p, root, w, hi, chunks, src, dst)
        steps.append(Step(tuple(transfers)))
    return steps


# ----- pipelined binary trees ---------------------------------------------------------
def _heap_depths(q: int) -> list[int]:
    return [(i + 1).bit_length() - 1 for i in range(q)]


def binary_tree_all_reduce_phase(ranks: list[int], start: int, numel: int, segments: int) -> list[Step]:
    """Pipelined binary-tree all-reduce over ``ranks`` (heap order: position i has
    children 2i+1, 2i+2; ranks[0] is the root).

    The region is cut into S segments. Reduce: the node at depth d >= 1 sends segment
    s to its parent at step (D - d) + s. Broadcast: the node at depth d sends segment s
    to its children at step D + s + d. With depth D = floor(lg q):
    2D + S - 1 steps of n/S: T = (2D + S - 1)(a + n/S b), each node receiving up to
    two segments per step.
    """
    q = len(ranks)
    if q == 1:
        return []
    depth = _heap_depths(q)
    max_depth = depth[-1]
    segs = chunk_bounds(start, numel, max(1, segments))
    events: dict[int, list[Transfer]] = {}
    for i in range(1, q):
        parent = (i - 1) // 2
        for s, (offset, size) in enumerate(segs):
            up = (max_depth - depth[i]) + s
            events.setdefault(up, []).append(Transfer(ranks[i], ranks[parent], offset, offset, size, True))
            down = max_depth + s + depth[parent]
            events.setdefault(down, []).append(Transfer(ranks[parent], ranks[i], offset, offset, size, False))
    last = max(events) if events else -1
    return [Step(tuple(events.get(t, ()))) for t in range(last + 1)]


# ----- collective builders --------------------------------------------------------------
def all_reduce(p, n, root, options):
    """Binomial reduce to rank 0, then binomial broadcast: T = 2 ceil(lg p)(a + n b) + ceil(lg p) n g."""
    return sequential(binomial_reduce_phase(p, 0, 0, n), binomial_broadcast_phase(p, 0, 0, n))


def reduce_scatter(p, n, root, options):
    """Binomial reduce to rank 0, then binomial scatter:
    T = 2 ceil(lg p) a + (ceil(lg p) + (p-1)/p) n b."""
    return sequential(binomial_reduce_phase(p, 0, 0, n), binomial_scatter_phase(p, 0, n))


def all_gather(p, n, root, options):
    """Binomial gather to rank 0, then binomial broadcast:
    T = 2 ceil(lg p) a + ((p-1)/p + ceil(lg p)) n b."""
    return sequential(binomial_gather_phase(p, 0, n), binomial_broadcast_phase(p, 0, 0, n))


def broadcast(p, n, root, options):
    """Binomial broadcast: T = ceil(lg p)(a + n b)."""
    return binomial_broadcast_phase(p, root, 0, n)


def reduce(p, n, root, options):
    """Binomial reduce: T = ceil(lg p)(a + n b + n g)."""
    return binomial_reduce_phase(p, root, 0, n)


def gather(p, n, root, options):
    """Binomial gather: T = ceil(lg p) a + (p-1)/p n b."""
    return binomial_gather_phase(p, root, n)


def scatter(p, n, root, options):
    """Binomial scatter: T = ceil(lg p) a + (p-1)/p n b."""
    return binomial_scatter_phase(p, root, n)


def barrier(p, n, root, options):
    """Binomial gather of one element to rank 0 and broadcast back: 2 ceil(lg p) rounds."""
    return sequential(binomial_reduce_phase(p, 0, 0, n), binomial_broadcast_phase(p, 0, 0, n))


def binary_tree_all_reduce(p, n, root, options):
    """Pipelined binary tree (see binary_tree_all_reduce_phase): T = (2 floor(lg p) + S - 1)(a + n/S b)."""
    return binary_tree_all_reduce_phase(list(range(p)), 0, n, options.get("segments", 1))


def double_binary_tree_all_reduce(p, n, root, options):
    """Two pipelined binary trees, each carrying half the buffer: tree A in rank order,
    tree B in reverse rank order, so (for even p) every interior node of one is a leaf of
    the other and each rank sends and receives about n per direction in total:
    T = (2 floor(lg p) + S - 1)(a + n/(2S) b) with both trees sharing each link."""
    segments = options.get("segments", 1)
    half = n // 2
    tree_a = binary_tree_all_reduce_phase(list(range(p)), 0, half, segments)
    tree_b = binary_tree_all_reduce_phase(list(reversed(range(p))), half, n - half, segments)
    return parallel(tree_a, tree_b)


BUILDERS = {
    "all_reduce": all_reduce,
    "reduce_scatter": reduce_scatter,
    "all_gather": all_gather,
    "broadcast": broadcast,
    "reduce": reduce,
    "gather": gather,
    "scatter": scatter,
    "barrier": barrier,
}
BINARY_BUILDERS = {"all_reduce": binary_tree_all_reduce}
DOUBLE_BINARY_BUILDERS = {"all_reduce": double_binary_tree_all_reduce}
