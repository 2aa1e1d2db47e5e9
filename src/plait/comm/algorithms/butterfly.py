"""Butterfly algorithms: recursive doubling and halving-doubling (Rabenseifner).

Both need a power-of-two group. For any other p they fold, as MPICH does: with
p' = 2^floor(lg p) and r = p - p', each even rank 2i < 2r first hands its data to
rank 2i + 1 and sits out; the p' survivors run the butterfly as "new ranks"
(new i < r is old 2i + 1, new i >= r is old i + r); at the end the survivors hand the
result back. Folding costs two extra rounds of n.
"""

from __future__ import annotations

from plait.comm.schedule import Step, Transfer, chunk_bounds


def _fold(p: int) -> tuple[int, int]:
    p_pow2 = 1 << (p.bit_length() - 1)
    return p_pow2, p - p_pow2


def _old(new: int, extra: int) -> int:
    return 2 * new + 1 if new < extra else new + extra


def _old_ranks(new: int, extra: int) -> range:
    """Old ranks a new rank speaks for (contiguous)."""
    return range(2 * new, 2 * new + 2) if new < extra else range(new + extra, new + extra + 1)


def _span(bounds, first: int, last: int) -> tuple[int, int]:
    """(offset, numel) covering bounds[first..last] inclusive (contiguous chunks)."""
    offset = bounds[first][0]
    return offset, bounds[last][0] + bounds[last][1] - offset


def _fold_in(extra: int, n: int, reduce: bool, bounds=None) -> list[Step]:
    if extra == 0:
        return []
    transfers = []
    for i in range(extra):
        if bounds is None:
            transfers.append(Transfer(2 * i, 2 * i + 1, 0, 0, n, reduce))
        else:
            offset, size = bounds[2 * i]
            transfers.append(Transfer(2 * i, 2 * i + 1, offset, offset, size, reduce))
    return [Step(tuple(transfers))]


def _fold_out_whole(extra: int, n: int) -> list[Step]:
    if extra == 0:
        return []
    return [Step(tuple(Transfer(2 * i + 1, 2 * i, 0, 0, n, False) for i in range(extra)))]


def _fold_out_except_own(extra: int, n: int, bounds) -> list[Step]:
    """Survivor 2i+1 sends everything but old chunk 2i (which 2i already has)."""
    if extra == 0:
        return []
    transfers = []
    for i in range(extra):
        offset, size = bounds[2 * i]
        transfers.append(Transfer(2 * i + 1, 2 * i, 0, 0, offset, False))
        transfers.append(Transfer(2 * i + 1, 2 * i, offset + size, offset + size, n - offset - size, False))
    return [Step(tuple(transfers))]


def _halving_phase(p_pow2: int, extra: int, regions) -> list[Step]:
    """Recursive halving reduce-scatter among the p' new ranks; ``regions[i]`` is the
    (offset, numel) new rank i ends up owning. Distances p'/2, p'/4, ..., 1."""
    steps = []
    distance = p_pow2 // 2
    while distance >= 1:
        transfers = []
        for i in range(p_pow2):
            partner = i ^ distance
            window_lo = i & ~(2 * distance - 1)
            give_lo = window_lo + distance if (i & distance) == 0 else window_lo
            offset, size = _span(regions, give_lo, give_lo + distance - 1)
            transfers.append(Transfer(_old(i, extra), _old(partner, extra), offset, offset, size, True))
        steps.append(Step(tuple(transfers)))
        distance //= 2
    return steps


def _doubling_gather_phase(p_pow2: int, extra: int, regions) -> list[Step]:
    """Recursive doubling all-gather among the p' new ranks: at distance d each sends
    the aligned window of d regions it has to i ^ d. Distances 1, 2, ..., p'/2."""
    steps = []
    distance = 1
    while distance < p_pow2:
        transfers = []
        for i in range(p_pow2):
            window_lo = i & ~(distance - 1)
            offset, size = _span(regions, window_lo, window_lo + distance - 1)
            transfers.append(Transfer(_old(i, extra), _old(i ^ distance, extra), offset, offset, size, False))
        steps.append(Step(tuple(transfers)))
        distance *= 2
    return steps


def _new_rank_regions(p: int, n: int):
    """Region of new rank i: the chunks (of the p-way split) of the old ranks it speaks for."""
    p_pow2, extra = _fold(p)
    bounds = chunk_bounds(0, n, p)
    regions = []
    for i in range(p_pow2):
        olds = _old_ranks(i, extra)
        regions.append(_span(bounds, olds[0], olds[-1]))
    return bounds, regions


# ----- collective builders --------------------------------------------------------------
def recursive_doubling_all_reduce(p, n, root, options):
    """Recursive doubling: lg p' rounds exchanging the whole buffer (+2 fold rounds
    if p is not a power of two): T = lg p (a + n b + n g) for p = 2^k."""
    p_pow2, extra = _fold(p)
    steps = _fold_in(extra, n, True)
    distance = 1
    while distance < p_pow2:
        transfers = [
            Transfer(_old(i, extra), _old(i ^ distance, extra), 0, 0, n, True) for i in range(p_pow2)
        ]
        steps.append(Step(tuple(transfers)))
        distance *= 2
    return steps + _fold_out_whole(extra, n)


def recursive_doubling_all_gather(p, n, root, options):
    """Recursive doubling all-gather: lg p rounds, the message doubling each round:
    T = lg p a + (p-1)/p n b for p = 2^k (+2 fold rounds otherwise)."""
    p_pow2, extra = _fold(p)
    bounds, regions = _new_rank_regions(p, n)
    return (
        _fold_in(extra, n, False, bounds)
        + _doubling_gather_phase(p_pow2, extra, regions)
        + _fold_out_except_own(extra, n, bounds)
    )


def halving_doubling_all_reduce(p, n, root, options):
    """Rabenseifner: recursive-halving reduce-scatter then recursive-doubling
    all-gather: T = 2 lg p a + 2(p-1)/p n b + (p-1)/p n g for p = 2^k
    (+2 fold rounds of n otherwise)."""
    p_pow2, extra = _fold(p)
    regions = chunk_bounds(0, n, p_pow2)
    return (
        _fold_in(extra, n, True)
        + _halving_phase(p_pow2, extra, regions)
        + _doubling_gather_phase(p_pow2, extra, regions)
        + _fold_out_whole(extra, n)
    )


def halving_doubling_reduce_scatter(p, n, root, options):
    """Recursive-halving reduce-scatter: T = lg p a + (p-1)/p n (b + g) for p = 2^k
    (otherwise +1 fold round of n and +1 of n/p back)."""
    p_pow2, extra = _fold(p)
    bounds, regions = _new_rank_regions(p, n)
    steps = _fold_in(extra, n, True) + _halving_phase(p_pow2, extra, regions)
    if extra:
        # the survivor 2i+1 owns old chunks 2i and 2i+1; hand chunk 2i back
        back = []
        for i in range(extra):
            offset, size = bounds[2 * i]
            back.append(Transfer(2 * i + 1, 2 * i, offset, offset, size, False))
        steps.append(Step(tuple(back)))
    return steps


RECURSIVE_DOUBLING_BUILDERS = {
    "all_reduce": recursive_doubling_all_reduce,
    "all_gather": recursive_doubling_all_gather,
}
HALVING_DOUBLING_BUILDERS = {
    "all_reduce": halving_doubling_all_reduce,
    "reduce_scatter": halving_doubling_reduce_scatter,
}
