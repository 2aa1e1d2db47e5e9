"""The algorithm registry: name -> collective -> schedule builder.

A builder is ``build(world_size, buffer_numel, root, options) -> list[Step]``; its
docstring gives the steps, bytes and alpha-beta cost. :func:`build_schedule` turns
it into a validated, cached :class:`~plait.comm.schedule.Schedule`.
"""

from __future__ import annotations

from functools import lru_cache

from plait.comm.algorithms import bruck, butterfly, direct, hierarchical, ring, tree
from plait.comm.schedule import Schedule, make_schedule

COLLECTIVES = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "barrier",
)
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")

ALGORITHMS: dict[str, dict] = {
    "direct": direct.DIRECT_BUILDERS,
    "star": direct.STAR_BUILDERS,
    "ring": ring.BUILDERS,
    "tree": tree.BUILDERS,
    "binary_tree": tree.BINARY_BUILDERS,
    "double_binary_tree": tree.DOUBLE_BINARY_BUILDERS,
    "recursive_doubling": butterfly.RECURSIVE_DOUBLING_BUILDERS,
    "halving_doubling": butterfly.HALVING_DOUBLING_BUILDERS,
    "bruck": bruck.BUILDERS,
    "hierarchical": hierarchical.BUILDERS,
    "pairwise": direct.PAIRWISE_BUILDERS,
}
TORCH = "torch"
# Names that pick an algorithm from the default table (the tuner replaces it later).
DEFAULT_NAMES = (None, "default", "auto")


def algorithms_for(collective: str) -> list[str]:
    """plait's algorithms that implement ``collective`` ("torch" is always valid too)."""
    check_collective(collective)
    return [name for name, builders in ALGORITHMS.items() if collective in builders]


def check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")


def builder(collective: str, algorithm: str):
    """The builder for (collective, algorithm), or a ValueError listing what is valid."""
    check_collective(collective)
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; valid: {', '.join(sorted(ALGORITHMS))}, "
            f"'{TORCH}' (torch.distributed's own) or 'auto'"
        )
    builders = ALGORITHMS[algorithm]
    if collective not in builders:
        raise ValueError(
            f"algorithm {algorithm!r} does not implement {collective}; "
            f"algorithms for {collective}: {', '.join(algorithms_for(collective))}, '{TORCH}'"
        )
    return builders[collective]


def build_schedule(
    collective: str,
    algorithm: str,
    world_size: int,
    buffer_numel: int,
    root: int | None = None,
    segments: int = 1,
    hierarchy=None,
) -> Schedule:
    """The validated schedule of ``algorithm`` for ``collective`` (cached).

    ``hierarchy`` (hierarchical only) is any spec ``parse_hierarchy`` takes; it is
    validated against ``world_size`` here, so a group that leaves out a rank is
    refused instead of silently not reducing it.
    """
    if algorithm == "hierarchical":
        hierarchy = hierarchical.parse_hierarchy(hierarchy, world_size)
    else:
        hierarchy = None
    return _build_schedule(collective, algorithm, world_size, buffer_numel, root, max(1, int(segments)), hierarchy)


@lru_cache(maxsize=512)
def _build_schedule(
    collective: str,
    algorithm: str,
    world_size: int,
    buffer_numel: int,
    root: int | None = None,
    segments: int = 1,
    hierarchy: tuple | None = None,
) -> Schedule:
    build = builder(collective, algorithm)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if collective in ROOTED:
        if root is None or not 0 <= root < world_size:
            raise ValueError(f"{collective} needs a root in [0, {world_size}), got {root}")
    else:
        root = None
    if collective == "all_to_all" and buffer_numel % (2 * world_size):
        raise ValueError(
            f"all_to_all buffer of {buffer_numel} elements is not [input | output] of p={world_size} equal chunks"
        )
    options = {"segments": segments}
    if algorithm == "hierarchical":
        options["hierarchy"] = hierarchy
    steps = build(world_size, buffer_numel, root, options) if world_size > 1 else []
    return make_schedule(collective, algorithm, world_size, buffer_numel, steps, root)


def describe(collective: str, algorithm: str) -> str:
    """The builder's docstring: steps, bytes and cost."""
    doc = builder(collective, algorithm).__doc__ or ""
    return " ".join(doc.split())
