"""Hierarchical all-reduce (BlueConnect): reduce-scatter within, all-reduce across,
all-gather within, over any number of levels and unequal group sizes.

A hierarchy is a tree of ranks given as nested lists, e.g. ``[[0, 1, 2], [3, 4]]``
(two nodes of 3 and 2 ranks) or ``[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]`` (racks of
nodes of ranks). All leaves are at the same depth; every rank appears once.

Algorithm, for a tree whose bottom-level groups are g_1..g_m:
  1. ring reduce-scatter inside every bottom group at once (group g cuts the region
     into |g| chunks; member j ends up owning chunk j);
  2. the region splits at every group's chunk boundaries into pieces that have one
     owner per bottom group; for each piece, the owners form the same tree one level
     shorter, and step 1-3 recurse on it (at the top, a flat ring all-reduce);
  3. ring all-gather inside every bottom group.
With two levels of equal groups (k groups of size g, p = k g): the slow links carry
2(k-1)/k n/g per rank instead of the flat ring's 2(p-1)/p n over the slowest link:
T = 2(g-1) a_in + 2(g-1)/g n b_in + 2(k-1) a_out + 2(k-1)/k (n/g) b_out.
"""

from __future__ import annotations

from plait.comm.algorithms.ring import (
    ring_all_gather_phase,
    ring_all_reduce_phase,
    ring_reduce_scatter_phase,
)
from plait.comm.schedule import Step, chunk_bounds, parallel, sequential

Hierarchy = tuple  # nested tuples of ints


def _is_flat(tree) -> bool:
    return all(isinstance(x, int) for x in tree)


def _bottom_groups(tree) -> list[tuple[int, ...]]:
    if _is_flat(tree):
        return [tuple(tree)]
    groups = []
    for child in tree:
        groups += _bottom_groups(child)
    return groups


def _replace_bottom(tree, owners: dict[tuple[int, ...], int]):
    """The tree with each bottom group replaced by its owner rank (one level shorter)."""
    if _is_flat(tree):
        return owners[tuple(tree)]
    return tuple(_replace_bottom(child, owners) for child in tree)


def hierarchical_all_reduce_phase(tree, start: int, numel: int) -> list[Step]:
    """BlueConnect all-reduce of region [start, start+numel) over ``tree``."""
    if numel == 0:
        return []
    if _is_flat(tree):
        return ring_all_reduce_phase(list(tree), start, numel) if len(tree) > 1 else []
    groups = _bottom_groups(tree)
    reduce_scatter = parallel(*(ring_reduce_scatter_phase(list(g), start, numel) for g in groups))
    all_gather = parallel(*(ring_all_gather_phase(list(g), start, numel) for g in groups))
    # every group's chunk boundaries, merged: each piece between two cuts has one owner per group
    bounds = {g: chunk_bounds(start, numel, len(g)) for g in groups}
    cuts = sorted({start, start + numel} | {offset for b in bounds.values() for offset, _ in b})
    across = []
    for lo, hi in zip(cuts, cuts[1:]):
        if hi == lo:
            continue
        owners = {}
        for g in groups:
            for j, (offset, size) in enumerate(bounds[g]):
                if offset <= lo < offset + size:
                    owners[g] = g[j]
                    break
        across.append(hierarchical_all_reduce_phase(_replace_bottom(tree, owners), lo, hi - lo))
    return sequential(reduce_scatter, parallel(*across), all_gather)


# ----- hierarchy specs ---------------------------------------------------------------------
def _consecutive(sizes: list[int]) -> tuple:
    out, first = [], 0
    for size in sizes:
        out.append(tuple(range(first, first + size)))
        first += size
    return tuple(out)


def _uniform(dims: list[int], first: int = 0) -> tuple:
    if len(dims) == 1:
        return tuple(range(first, first + dims[0]))
    inner = 1
    for d in dims[1:]:
        inner *= d
    return tuple(_uniform(dims[1:], first + i * inner) for i in range(dims[0]))


def _freeze(tree):
    if isinstance(tree, int):
        return tree
    return tuple(_freeze(x) for x in tree)


def _depths(tree) -> set[int]:
    if isinstance(tree, int):
        return {0}
    if len(tree) == 0:
        raise ValueError("hierarchy has an empty group; every group needs at least one rank")
    return {d + 1 for child in tree for d in _depths(child)}


def _leaves(tree) -> list[int]:
    if isinstance(tree, int):
        return [tree]
    return [r for child in tree for r in _leaves(child)]


def parse_hierarchy(spec, world_size: int, local_world_size: int | None = None) -> tuple:
    """A hierarchy from a spec, validated against ``world_size``.

    ``spec`` may be nested lists of ranks; a string of sizes: ``"2x4"`` (2 groups of 4
    consecutive ranks; more ``x`` for more levels) or ``"3+5"`` (groups of 3 and 5
    consecutive ranks); or None: groups of ``local_world_size`` consecutive ranks (the
    ranks per host, which the caller passes: the CLI reads the launcher's
    LOCAL_WORLD_SIZE into ``CommConfig.local_world_size``) when it divides the world,
    else one flat group.
    """
    if spec is None:
        if local_world_size and 1 < local_world_size < world_size and world_size % local_world_size == 0:
            return _uniform([world_size // local_world_size, local_world_size])
        return tuple(range(world_size))
    if isinstance(spec, str):
        text = spec.replace(" ", "")
        try:
            if "+" in text:
                tree = _consecutive([int(x) for x in text.split("+")])
            else:
                tree = _uniform([int(x) for x in text.split("x")])
        except ValueError:
            raise ValueError(
                f"hierarchy {spec!r} is not understood; write sizes like '2x4' (2 groups of 4), "
                "'3+5' (groups of 3 and 5) or give nested lists of ranks"
            ) from None
    else:
        tree = _freeze(spec)
    if isinstance(tree, int):
        tree = (tree,)
    if len(_depths(tree)) != 1:
        raise ValueError(f"hierarchy {spec!r} has leaves at different depths; nest every rank equally deep")
    ranks = _leaves(tree)
    if sorted(ranks) != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(ranks))
        extra = sorted(r for r in set(ranks) if not 0 <= r < world_size or ranks.count(r) > 1)
        raise ValueError(
            f"hierarchy {spec!r} must name every rank 0..{world_size - 1} exactly once "
            f"(missing {missing}, out of range or repeated {extra})"
        )
    return tree


def all_reduce(p, n, root, options):
    """Hierarchical (BlueConnect) all-reduce over options['hierarchy']; see module doc."""
    tree = options.get("hierarchy") or tuple(range(p))
    return hierarchical_all_reduce_phase(tree, 0, n)


BUILDERS = {"all_reduce": all_reduce}
