"""The price of changing a tensor's layout between two operators (Alpa's resharding
cost on an edge of the graph), forward and backward, on a 1-D or 2-D AutoMesh.

A reshard runs as a sequence of single-axis steps; each changes one mesh axis's
placement with one collective over that axis's groups (priced by
``Cluster.collective_time_s`` with the algorithm plait would pick). The backward pass
runs the dual of every step in reverse order, under the gradient convention of
``plait.names.placements`` (a P tensor's gradient is R, an R tensor's is whole and
equal, an S(d) tensor's sharded alike):

    step on axis a      forward                          backward
    P    -> R           all_reduce(n)                    nothing (the gradient stays R)
    P    -> S(d)        reduce_scatter(n)                all_gather(n)
    S(d) -> R           all_gather(n)                    keep the own slice (free)
    R    -> S(d)        slice (free)                     all_gather(n)
    S(d) -> S(e)        all_to_all(n)                    all_to_all(n)
    R or S -> P         never needed: math.inf

with n the bytes of the local (per-rank) tensor at the unsharded end of the step
(all_to_all: its local size, equal at both ends): what ``Cluster`` means by nbytes
(all_reduce: the buffer; all_gather: the gathered output; reduce_scatter: the input
buffer; all_to_all: the input buffer of p chunks). On an axis of one rank every
placement is the same: no step. So on p ranks of one axis, with the ring:
S(d)->R costs (p-1)a + (p-1)/p n b, R->S(d) the same (all in backward), P->S(d)
twice that (+ the reduction), S(d)->S(e) 2((p-1)a + (p-1)/p n b) with pairwise.

Nested shards: a tensor dim sharded on both axes is split axis 0 outer, axis 1 inner
(torch DTensor's order: rank (i0, i1) holds block i0·n1 + i1). A step on axis a that
shards or unshards dim d (S(d)->R, R->S(d), P->S(d), S(d)<->S(e)) is exact as a
collective over axis a's groups only when no axis inner to a (b > a) shards d at that
moment; P->R is always exact, and slicing or all-reducing a partial sum is linear, so
P may stay on other axes. Among the paths made of such steps through layouts that
split evenly, :func:`reshard_path` takes the cheapest (forward + backward; Dijkstra
over every layout that splits evenly, :func:`layout_graph`; ties: fewer steps, then
axis 0 first), e.g. (P, R) -> (R, S0) slices on axis 1 first
and then all-reduces half the bytes on axis 0. The executor runs that path, so the
price and the run agree step by step.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import NamedTuple

from plait.names.placements import PARTIAL, REPLICATE, check_placement, is_shard, local_shape, shard, shard_dim

__all__ = ["ReshardStep", "reshard_time_s", "reshard_steps", "reshard_path", "layout_graph", "FORWARD", "BACKWARD", "SLICE"]

FORWARD = "forward"
BACKWARD = "backward"
SLICE = "slice"


class ReshardStep(NamedTuple):
    """One collective of a reshard: ``collective`` (all_reduce, reduce_scatter,
    all_gather, all_to_all or slice: local, free), the mesh ``axis`` whose groups run
    it, ``nbytes`` as Cluster.collective_time_s means it, and ``direction`` (forward or
    backward)."""

    collective: str
    axis: int
    nbytes: int
    direction: str


def _local_nbytes(shape, layout, mesh_shape, itemsize: int) -> int | None:
    """Bytes one rank holds, or None when ``layout`` does not split ``shape`` evenly."""
    try:
        return math.prod(local_shape(shape, layout, mesh_shape)) * itemsize
    except ValueError:
        return None


def _step_collectives(before: str, after: str, nbytes_before: int, nbytes_after: int):
    """(forward, backward) ReshardStep fields (collective, nbytes) of one axis's change."""
    if before == PARTIAL and after == REPLICATE:
        return [("all_reduce", nbytes_before)], []
    if before == PARTIAL:  # -> S(d)
        return [("reduce_scatter", nbytes_before)], [("all_gather", nbytes_before)]
    if after == REPLICATE:  # S(d) -> R
        return [("all_gather", nbytes_after)], [(SLICE, nbytes_before)]
    if before == REPLICATE:  # -> S(d)
        return [(SLICE, nbytes_after)], [("all_gather", nbytes_before)]
    return [("all_to_all", nbytes_before)], [("all_to_all", nbytes_after)]  # S(d) -> S(e)


def _exact_on_axis(layout, axis: int, dims) -> bool:
    """No axis inner to ``axis`` shards one of ``dims`` (nested shards: axis 0 outer)."""
    return not any(shard_dim(layout[inner]) in dims for inner in range(axis + 1, len(layout)))


def _normalise(layout, shape, mesh) -> tuple[str, ...]:
    if len(layout) != mesh.ndim:
        raise ValueError(f"layout {layout!r} has {len(layout)} placements for the {mesh.text()} mesh "
                         f"({mesh.ndim} axes)")
    for placement in layout:
        check_placement(placement, len(shape))
    # on an axis of one rank R, P and S(d) are the same tensor
    return tuple(REPLICATE if mesh.axis_size(axis) == 1 else placement for axis, placement in enumerate(layout))


def _moves(layout, shape, itemsize: int, mesh):
    """(next layout, its steps) of every exact single-axis step from ``layout``: an axis
    of more than one rank goes to R or to any S(d) (never to P), where the nesting
    rule allows and the result splits evenly."""
    n_before = _local_nbytes(shape, layout, mesh.shape, itemsize)
    for axis in range(mesh.ndim):
        if mesh.axis_size(axis) == 1:
            continue
        before = layout[axis]
        for after in (REPLICATE, *(shard(dim) for dim in range(len(shape)))):
            if after == before:
                continue
            dims = {shard_dim(p) for p in (before, after) if is_shard(p)}
            if dims and not _exact_on_axis(layout, axis, dims):
                continue
            nxt = layout[:axis] + (after,) + layout[axis + 1:]
            n_after = _local_nbytes(shape, nxt, mesh.shape, itemsize)
            if n_after is None:
                continue
            fwd, bwd = _step_collectives(before, after, n_before, n_after)
            yield nxt, tuple(ReshardStep(name, axis, nbytes, FORWARD) for name, nbytes in fwd) + tuple(
                ReshardStep(name, axis, nbytes, BACKWARD) for name, nbytes in bwd)


def _steps_time_s(steps, mesh, cluster) -> float:
    return sum(cluster.collective_time_s(name, nbytes, mesh.axis_size(axis), mesh.axis_stride(axis))[0]
               for name, axis, nbytes, _ in steps if name != SLICE)


def layout_graph(shape, itemsize: int, mesh, cluster) -> tuple[tuple, tuple]:
    """(layouts, arcs): every layout of a ``shape`` tensor that splits evenly on
    ``mesh`` (axes of one rank read R) and every exact single-axis step between them
    as (from index, to index, seconds forward + backward). reshard_time_s is the
    shortest path in this graph, so the ILP may route an edge's reshard through it
    as a flow (plait.plan.auto.ilp_edges)."""
    shape = tuple(shape)
    placements = (REPLICATE, PARTIAL, *(shard(dim) for dim in range(len(shape))))
    layouts = tuple(dict.fromkeys(
        _normalise(layout, shape, mesh) for layout in itertools.product(placements, repeat=mesh.ndim)
        if _local_nbytes(shape, layout, mesh.shape, itemsize) is not None))
    index = {layout: position for position, layout in enumerate(layouts)}
    arcs = tuple((index[layout], index[nxt], _steps_time_s(steps, mesh, cluster))
                 for layout in layouts for nxt, steps in _moves(layout, shape, itemsize, mesh))
    return layouts, arcs


def _search(src, dst, shape, itemsize: int, mesh, cluster):
    """(seconds, layouts, steps) of the cheapest exact single-axis path, or
    (math.inf, None, None) when none exists (Dijkstra over :func:`_moves`)."""
    shape = tuple(shape)
    src, dst = _normalise(src, shape, mesh), _normalise(dst, shape, mesh)
    if _local_nbytes(shape, src, mesh.shape, itemsize) is None or _local_nbytes(shape, dst, mesh.shape, itemsize) is None:
        return math.inf, None, None
    if any(d == PARTIAL and s != PARTIAL for s, d in zip(src, dst)):
        return math.inf, None, None  # a partial sum is never created by a reshard
    if src == dst:
        return 0.0, [src], []
    best = {src: (0.0, 0)}
    # (seconds, hops, tie-break counter, layout, path of layouts, ((hop, step), ...))
    frontier = [(0.0, 0, 0, src, (src,), ())]
    pushed = 1
    while frontier:
        seconds, hops, _, layout, path, steps = heapq.heappop(frontier)
        if layout == dst:
            forward = [step for _, step in steps if step.direction == FORWARD]
            # the backward pass runs the duals in reverse order of their forward steps
            backward = [step for hop in reversed(range(hops)) for at, step in steps
                        if at == hop and step.direction == BACKWARD]
            return seconds, list(path), forward + backward
        if (seconds, hops) > best[layout]:
            continue
        for nxt, new in _moves(layout, shape, itemsize, mesh):
            key = (seconds + _steps_time_s(new, mesh, cluster), hops + 1)
            if key < best.get(nxt, (math.inf, 0)):
                best[nxt] = key
                heapq.heappush(frontier, (*key, pushed, nxt, path + (nxt,), steps + tuple((hops, s) for s in new)))
                pushed += 1
    return math.inf, None, None


def reshard_time_s(src, dst, shape, itemsize: int, mesh, cluster) -> float:
    """Seconds per training step (forward + backward, per device) to turn a tensor of
    global ``shape`` and ``itemsize`` laid out as ``src`` into ``dst`` on ``mesh``:
    the sum of the collectives of :func:`reshard_steps`, 0 when the layouts are
    equal, math.inf when no reshard exists (``dst`` partial where ``src`` is not, or
    a layout that does not split ``shape`` evenly)."""
    return _search(src, dst, shape, itemsize, mesh, cluster)[0]


def reshard_path(src, dst, shape, itemsize: int, mesh, cluster) -> list[tuple[str, ...]]:
    """The layouts the forward pass goes through, ``src`` first and ``dst`` last, each
    differing from the one before on one mesh axis (axes of one rank read "R");
    ValueError when the reshard is impossible."""
    seconds, path, _ = _search(src, dst, shape, itemsize, mesh, cluster)
    if path is None:
        raise ValueError(_impossible(src, dst, shape, mesh))
    return path


def reshard_steps(src, dst, shape, itemsize: int, mesh, cluster) -> list[ReshardStep]:
    """The collectives of the reshard, forward steps in order, then backward steps in
    the order they run (slices included, free); ValueError when it is impossible."""
    seconds, _, steps = _search(src, dst, shape, itemsize, mesh, cluster)
    if steps is None:
        raise ValueError(_impossible(src, dst, shape, mesh))
    return steps


def _impossible(src, dst, shape, mesh) -> str:
    return (f"no reshard of a {tuple(shape)} tensor from {src!r} to {dst!r} on the {mesh.text()} mesh: a partial "
            "sum ('P') is only ever reduced, never created, and every shard must split its dim evenly")
