"""How a layout changes into another on a 1-D or 2-D mesh: one mesh axis at a time,
as a list of single-axis steps the executor runs (``plait.parallel.auto.reshard``)
and the planner prices (``plait.plan.auto.reshard_cost``). Torch-free.

A step ``(axis, src, dst)`` changes the placement on one axis, the other axis's kept:

    P    -> R     all-reduce                 (backward: nothing)
    P    -> S<d>  reduce-scatter of dim d    (backward: all-gather)
    S<d> -> R     all-gather of dim d        (backward: keep this rank's slice)
    R    -> S<d>  keep this rank's slice     (backward: all-gather)
    S<d> -> S<e>  all-to-all                 (backward: all-to-all back)
    R    -> P     coordinate 0 keeps the value, the others hold zeros (backward: nothing)

(S<d> -> P runs as S<d> -> R, R -> P.) A dim sharded on both axes is split as torch
DTensor splits it: over axis 0 first, each part over axis 1 (rank (i0, i1) holds
block i0·n1 + i1). So an axis-1 step always sees whole blocks of axis 0's split, but
an axis-0 step touching dim d while axis 1 holds S<d> would see interleaved blocks:
axis 1 is first taken to R. Order: steps that end in R or P (gathers, reductions)
run inner axis first (1, then 0), the others (slices, all-to-alls, scatters) outer
axis first (0, then 1), which leaves nested shards in DTensor's order.
"""

from __future__ import annotations

from plait.names.placements import PARTIAL, REPLICATE, check_placement, is_shard, shard_dim

__all__ = ["reshard_steps", "single_axis_steps"]


def single_axis_steps(src: str, dst: str) -> tuple[tuple[str, str], ...]:
    """The placement changes that take ``src`` to ``dst`` on one axis (S -> P goes through R)."""
    check_placement(src)
    check_placement(dst)
    if src == dst:
        return ()
    if dst == PARTIAL and src != REPLICATE:
        return ((src, REPLICATE), (REPLICATE, PARTIAL))
    return ((src, dst),)


def _dims(src: str, dst: str) -> set[int]:
    return {shard_dim(p) for p in (src, dst) if is_shard(p)}


def _blocked(axis: int, src: str, dst: str, current: list[str]) -> bool:
    """An axis-0 step touching a dim that axis 1 shards would see interleaved blocks."""
    if axis != 0 or len(current) < 2 or not is_shard(current[1]):
        return False
    return shard_dim(current[1]) in _dims(src, dst)


def reshard_steps(src, dst) -> tuple[tuple[int, str, str], ...]:
    """The single-axis steps ``(axis, from, to)`` that take layout ``src`` to ``dst``
    (tuples of placements, one per mesh axis), in the order they run."""
    src, dst = tuple(src), tuple(dst)
    if len(src) != len(dst) or not 1 <= len(src) <= 2:
        raise ValueError(f"reshard {src!r} -> {dst!r}: both layouts need one placement per mesh axis (1 or 2)")
    current = list(src)
    steps: list[tuple[int, str, str]] = []

    def run(axis: int, target: str) -> None:
        for before, after in single_axis_steps(current[axis], target):
            steps.append((axis, before, after))
            current[axis] = after

    for _ in range(4):  # each pass settles at least one axis; two axes need at most a few passes
        if current == list(dst):
            return tuple(steps)
        changing = [a for a in range(len(current)) if current[a] != dst[a]]
        axes_down = [a for a in reversed(changing) if dst[a] in (REPLICATE, PARTIAL)]
        axes_up = [a for a in changing if dst[a] not in (REPLICATE, PARTIAL)]
        progressed = False
        for axis in axes_down + axes_up:
            if current[axis] == dst[axis]:
                continue
            if _blocked(axis, current[axis], dst[axis], current):
                continue
            run(axis, dst[axis])
            progressed = True
        if not progressed:
            # every remaining step is an axis-0 step blocked by axis 1's shard: free axis 1 first
            run(1, REPLICATE)
    assert current == list(dst), (src, dst, steps)
    return tuple(steps)
