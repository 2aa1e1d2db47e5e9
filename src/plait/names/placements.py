"""How a tensor lies on a device mesh: one placement per mesh axis (torch DTensor's
vocabulary, as plain strings so the planner and the executor share them torch-free).

- ``"R"`` replicate: every rank along the axis holds the whole tensor;
- ``"S<d>"`` shard on tensor dim ``d`` (>= 0): the ranks along the axis hold
  consecutive equal slices of dim ``d`` (its size must divide by the axis size);
- ``"P"`` partial: each rank holds a summand; the tensor is their sum.

A ``Layout`` is a tuple of placements, one per mesh axis (axis 0 first), e.g.
``("S0", "S1")`` on a 2x2 mesh: dim 0 split over axis 0, dim 1 over axis 1. Gradients
follow the dual convention the executor keeps: a replicated tensor's gradient is whole
and equal on every rank of the axis, a sharded tensor's gradient is sharded alike, and a
partial tensor's gradient is replicated.
"""

from __future__ import annotations

__all__ = ["REPLICATE", "PARTIAL", "shard", "shard_dim", "is_shard", "check_placement", "replicated", "layout_text",
           "parse_layout", "local_shape"]

REPLICATE = "R"
PARTIAL = "P"
_SHARD_PREFIX = "S"


def shard(dim: int) -> str:
    """The placement that splits tensor dim ``dim`` (>= 0) over a mesh axis."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"shard dim={dim!r} must be a whole number >= 0 (normalise negative dims first)")
    return f"{_SHARD_PREFIX}{dim}"


def is_shard(placement: str) -> bool:
    return placement.startswith(_SHARD_PREFIX)


def shard_dim(placement: str) -> int | None:
    """The tensor dim a ``"S<d>"`` placement splits, else None."""
    return int(placement[len(_SHARD_PREFIX):]) if is_shard(placement) else None


def check_placement(placement, ndim: int | None = None) -> str:
    """``placement`` if it is "R", "P" or "S<d>" (with d < ``ndim`` when given), else ValueError."""
    ok = placement in (REPLICATE, PARTIAL) or (
        isinstance(placement, str) and is_shard(placement) and placement[1:].isdigit())
    if not ok:
        raise ValueError(f"placement {placement!r} must be 'R' (replicate), 'P' (partial sum) or 'S<dim>' (shard)")
    if ndim is not None and is_shard(placement) and shard_dim(placement) >= ndim:
        raise ValueError(f"placement {placement!r} shards dim {shard_dim(placement)} of a {ndim}-d tensor")
    return placement


def replicated(mesh_ndim: int) -> tuple[str, ...]:
    """The layout replicated on every one of ``mesh_ndim`` axes."""
    return (REPLICATE,) * mesh_ndim


def layout_text(layout) -> str:
    """``("S0", "R")`` -> ``"S0,R"`` (what plan files and tables show)."""
    return ",".join(layout)


def parse_layout(text: str) -> tuple[str, ...]:
    """``"S0,R"`` -> ``("S0", "R")``, each placement checked."""
    return tuple(check_placement(part.strip()) for part in text.split(","))


def local_shape(shape, layout, mesh_shape) -> tuple[int, ...]:
    """The shape one rank holds of a tensor of global ``shape`` laid out as ``layout``
    on a mesh of ``mesh_shape`` (a dim sharded on several axes is divided by each)."""
    if len(layout) != len(mesh_shape):
        raise ValueError(f"layout {layout!r} has {len(layout)} placements for a {len(mesh_shape)}-axis mesh")
    local = list(shape)
    for placement, size in zip(layout, mesh_shape):
        dim = shard_dim(placement)
        if dim is None:
            continue
        if dim >= len(local) or local[dim] % size:
            raise ValueError(f"layout {layout!r} splits dim {dim} of shape {tuple(shape)} over {size} ranks: "
                             "it must exist and divide evenly")
        local[dim] //= size
    return tuple(local)
