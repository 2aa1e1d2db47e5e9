"""An edge's reshard as a flow through the layout graph: fewer ILP variables than one
per (output layout, input layout) pair on 2-D meshes, the same optimum and the same
LP relaxation.

reshard_time_s(L, M) is the shortest path from L to M in the graph of single-axis
steps (plait.plan.auto.reshard_cost.layout_graph). So the edge's cost can be written
as an uncapacitated min-cost flow: one unit enters at the producer's output layout
(``y[L] = sum of its strategies with output L``), leaves at the layout the consumer
wants (``z[M]``), and pays each step it crosses:

    for every layout X:  sum_{arcs into X} f - sum_{arcs out of X} f + y[X] - z[X] = 0,  f >= 0.

With one-hot y and z the cheapest flow is a shortest path: C[L, M]. With fractional
y and z (the LP relaxation) it is the transport of y to z priced by the shortest
paths, which is what the pairwise formulation relaxes to: the bound is the same.

Only the arcs that lie on a shortest path from some output layout to some wanted
layout are kept (d(L, X) + c + d(Y, M) = d(L, M)): every arc of a shortest path
satisfies it, so a shortest path of every pair survives. A 3-d activation on a 2x4
mesh has 25 layouts and ~180 arcs, against 25 x 16 pairs; the ILP takes whichever
is smaller per edge.
"""

from __future__ import annotations

import math

import numpy as np

from plait.plan.auto.reshard_cost import layout_graph

__all__ = ["LayoutFlows"]

# arcs whose detour exceeds the shortest path by less than this share are on it
# (float sums of the same steps in another order differ by ~1e-16)
_ON_PATH_RELATIVE = 1e-9


class LayoutFlows:
    """The layout graphs of one mesh and cluster, per tensor (shape, itemsize), with
    their all-pairs shortest paths, and the pruned arcs per (tensor, rows, columns)."""

    def __init__(self, mesh, cluster) -> None:
        self.mesh, self.cluster = mesh, cluster
        self._graphs: dict = {}
        self._arcs: dict = {}

    def _graph(self, tensor):
        graph = self._graphs.get(tensor)
        if graph is None:
            layouts, arcs = layout_graph(tensor[0], tensor[1], self.mesh, self.cluster)
            distance = np.full((len(layouts), len(layouts)), math.inf)
            np.fill_diagonal(distance, 0.0)
            for start, end, seconds in arcs:
                distance[start, end] = min(distance[start, end], seconds)
            for middle in range(len(layouts)):  # Floyd-Warshall, <= a few dozen layouts
                distance = np.minimum(distance, distance[:, middle:middle + 1] + distance[middle:middle + 1, :])
            graph = ({layout: i for i, layout in enumerate(layouts)}, layouts, arcs, distance)
            self._graphs[tensor] = graph
        return graph

    def distance_s(self, src, dst, tensor) -> float | None:
        """reshard_time_s(src, dst) read off the all-pairs shortest paths (the same steps
        summed, in another order: equal to ~1e-16), or None where the graph does not
        apply (an axis of one rank, a layout not in it: reshard_time_s decides)."""
        if any(size == 1 for size in self.mesh.shape):
            return None
        index, _, _, distance = self._graph(tensor)
        start, end = index.get(tuple(src)), index.get(tuple(dst))
        return None if start is None or end is None else float(distance[start, end])

    def arcs(self, tensor, rows, columns):
        """((from layout, to layout, seconds), ...) on some shortest path from a layout
        of ``rows`` to one of ``columns``, or None where the flow does not apply (a
        mesh axis of one rank, or a layout that does not split the tensor evenly)."""
        if any(size == 1 for size in self.mesh.shape):
            return None
        key = (tensor, rows, columns)
        if key in self._arcs:
            return self._arcs[key]
        index, layouts, arcs, distance = self._graph(tensor)
        if any(layout not in index for layout in (*rows, *columns)):
            self._arcs[key] = None
            return None
        starts = [index[layout] for layout in rows]
        ends = [index[layout] for layout in columns]
        shortest = distance[np.ix_(starts, ends)]  # (rows, columns)
        kept = []
        for start, end, seconds in arcs:
            through = distance[starts, start][:, None] + seconds + distance[end, ends][None, :]
            on_path = np.isfinite(shortest) & (through <= shortest * (1 + _ON_PATH_RELATIVE) + 1e-30)
            if on_path.any():
                kept.append((layouts[start], layouts[end], seconds))
        self._arcs[key] = tuple(kept)
        return self._arcs[key]
