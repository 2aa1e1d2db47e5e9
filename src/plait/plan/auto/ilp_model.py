"""The intra-operator ILP's model as plain lists (columns, costs, sparse rows) and its
exhaustive oracle; ``plait.plan.auto.ilp`` solves the model with HiGHS. The
formulation is in ilp.py's docstring."""

from __future__ import annotations

import math

import numpy as np

from plait.plan.auto.ilp_edges import EdgeTable, edge_tables, eliminate, recover
from plait.plan.auto.ilp_flow import LayoutFlows
from plait.plan.auto.reshard_cost import reshard_time_s
from plait.plan.auto.strategy import Strategy

__all__ = ["EXHAUSTIVE_LIMIT", "ReshardPrices", "IlpModel", "check_strategies", "enumerate_best"]

# the most combinations exhaustive() tries (numpy arrays of this many float64: 8 MB each)
EXHAUSTIVE_LIMIT = 10 ** 6


class ReshardPrices:
    """reshard_time_s on one mesh and cluster for one solve: read off each tensor
    shape's all-pairs shortest paths in the layout graph (``flows``; a 48-layer graph
    repeats a dozen shapes), else computed and remembered per (src, dst, shape,
    itemsize)."""

    def __init__(self, mesh, cluster) -> None:
        self.mesh, self.cluster = mesh, cluster
        self.flows = LayoutFlows(mesh, cluster)
        self._seconds: dict = {}

    def table(self, rows, columns, producer) -> np.ndarray:
        """time_s of every (row, column) pair: (len(rows), len(columns)) seconds,
        remembered per (tensor, rows, columns): the layers of a model repeat them."""
        key = ("table", producer.shape, producer.itemsize, rows, columns)
        matrix = self._seconds.get(key)
        if matrix is None:
            matrix = np.array([[self.time_s(out, want, producer) for want in columns] for out in rows], dtype=float)
            matrix.setflags(write=False)
            self._seconds[key] = matrix
        return matrix

    def time_s(self, src, dst, producer) -> float:
        tensor = (producer.shape, producer.itemsize)
        seconds = self.flows.distance_s(src, dst, tensor)
        if seconds is not None:
            return seconds
        key = (src, dst, tensor)
        seconds = self._seconds.get(key)
        if seconds is None:
            seconds = reshard_time_s(src, dst, producer.shape, producer.itemsize, self.mesh, self.cluster)
            self._seconds[key] = seconds
        return seconds


def check_strategies(graph, strategies, mesh) -> dict[str, tuple[Strategy, ...]]:
    """``strategies`` per node name, each checked against its node and the mesh."""
    names = {node.name for node in graph.nodes}
    missing = [node.name for node in graph.nodes if not strategies.get(node.name)]
    extra = sorted(set(strategies) - names)
    if missing or extra:
        raise ValueError(f"strategies must list at least one Strategy for every node of the graph and no other: "
                         f"missing {missing}, not in the graph {extra}")
    checked = {}
    for node in graph.nodes:
        options = tuple(strategies[node.name])
        for option in options:
            if not isinstance(option, Strategy):
                raise TypeError(f"node {node.name!r}: {option!r} is not a plait.plan.auto.strategy.Strategy")
            if len(option.inputs) != len(node.inputs):
                raise ValueError(f"node {node.name!r} strategy {option.name!r} gives {len(option.inputs)} input "
                                 f"layouts for the node's {len(node.inputs)} inputs {list(node.inputs)}")
            layouts = [option.output, *option.inputs, *(layout for _, layout in option.params)]
            if any(len(layout) != mesh.ndim for layout in layouts):
                raise ValueError(f"node {node.name!r} strategy {option.name!r} has a layout that is not "
                                 f"{mesh.ndim} placements long (mesh {mesh.text()})")
            unlisted = [name for name in node.params if name not in dict(option.params)]
            if unlisted:
                raise ValueError(f"node {node.name!r} strategy {option.name!r} gives no layout for parameter(s) "
                                 f"{unlisted} the node reads")
        checked[node.name] = options
    return checked


def _readers(graph) -> dict[str, list[str]]:
    """Parameter name -> the nodes that read it (each once, in graph order)."""
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for name in dict.fromkeys(node.params):
            readers.setdefault(name, []).append(node.name)
    return readers


def _groups(options, layout_of) -> dict:
    """layout -> indices of the options with it (first-seen order)."""
    groups: dict = {}
    for index, option in enumerate(options):
        groups.setdefault(layout_of(option), []).append(index)
    return groups


class IlpModel:
    """Columns (s per strategy, then per edge e per layout pair or f per flow arc),
    their cost in seconds, integrality and upper bounds; rows as (coefficients by
    column, lower, upper)."""

    def __init__(self, graph, strategies: dict[str, tuple[Strategy, ...]], prices: ReshardPrices,
                 memory_limit_bytes: float | None) -> None:
        if memory_limit_bytes is not None and not (isinstance(memory_limit_bytes, (int, float))
                                                   and memory_limit_bytes > 0):
            raise ValueError(f"memory_limit_bytes={memory_limit_bytes!r} must be a number > 0 (or None: no limit)")
        self.strategies = strategies
        self.cost_s: list[float] = []
        self.memory_bytes: list[float] = []
        self.integral: list[int] = []
        self.upper: list[float] = []
        self.rows: list[tuple[dict, float, float]] = []
        self.constant_s = 0.0
        self.broken: list[tuple[str, str, int]] = []  # edges with an impossible reshard for some pair
        self.s: dict[str, list[int]] = {}
        self.flows = prices.flows
        tables, self.eliminated = eliminate(graph, strategies, edge_tables(graph, strategies, prices))
        gone = {record.node for record in self.eliminated}
        for node in graph.nodes:
            if node.name in gone:
                continue
            columns = [self._column(o.compute_s + o.comm_s, 1, o.memory_bytes) for o in strategies[node.name]]
            self.s[node.name] = columns
            self.rows.append(({column: 1.0 for column in columns}, 1.0, 1.0))
        for table in tables:
            self._edge(table)
        for name, readers in _readers(graph).items():
            first = readers[0]
            for other in readers[1:]:
                self._tie(name, first, other)
        self.memory_row = None
        if memory_limit_bytes is not None:
            self.memory_row = len(self.rows)
            self.rows.append(({column: memory / memory_limit_bytes for column, memory in enumerate(self.memory_bytes)
                               if memory}, -math.inf, 1.0))
        finite = [abs(cost) for cost in self.cost_s if cost > 0]
        self.unit_s = max(finite) if finite else 1.0

    @property
    def columns(self) -> int:
        return len(self.cost_s)

    def _column(self, cost_s: float, integral: int, memory_bytes: float = 0.0) -> int:
        self.cost_s.append(cost_s)
        self.memory_bytes.append(memory_bytes)
        self.integral.append(integral)
        self.upper.append(1.0)
        return len(self.cost_s) - 1

    def _forbid_or_add(self, columns, seconds: float) -> None:
        for column in columns:
            if math.isinf(seconds):
                self.upper[column] = 0.0
            else:
                self.cost_s[column] += seconds

    def _edge(self, table: EdgeTable) -> None:
        source, target, position = table.source, table.target, table.position
        outs = {layout: [i for i, o in enumerate(self.strategies[source]) if o.output == layout] for layout in table.rows}
        ins = {layout: [i for i, o in enumerate(self.strategies[target]) if o.inputs[position] == layout]
               for layout in table.columns}
        price = {(out, want): float(table.matrix[r, c]) for r, out in enumerate(table.rows)
                 for c, want in enumerate(table.columns)}
        if any(math.isinf(seconds) for seconds in price.values()):
            self.broken.append((source, target, position))
        if len(outs) == 1 or len(ins) == 1:  # fold into the other side's strategies
            if len(outs) == 1 and len(ins) == 1:
                seconds = next(iter(price.values()))
                if math.isinf(seconds):  # no plan at all: forbid the producer's every strategy
                    self._forbid_or_add(self.s[source], seconds)
                else:
                    self.constant_s += seconds
                return
            (side, groups, at) = (target, ins, 1) if len(outs) == 1 else (source, outs, 0)
            for layout, indices in groups.items():
                seconds = next(s for pair, s in price.items() if pair[at] == layout)
                self._forbid_or_add([self.s[side][i] for i in indices], seconds)
            return
        finite = sum(not math.isinf(seconds) for seconds in price.values())
        arcs = None if table.tensor is None else self.flows.arcs(table.tensor, table.rows, table.columns)
        if arcs is not None and len(arcs) < finite:
            self._flow(table, outs, ins, arcs)
            return
        pair_column = {pair: self._column(seconds, 0) for pair, seconds in price.items() if not math.isinf(seconds)}
        for out, indices in outs.items():
            row = {column: 1.0 for pair, column in pair_column.items() if pair[0] == out}
            row.update({self.s[source][i]: -1.0 for i in indices})
            self.rows.append((row, 0.0, 0.0))
        for want, indices in ins.items():
            row = {column: 1.0 for pair, column in pair_column.items() if pair[1] == want}
            row.update({self.s[target][i]: -1.0 for i in indices})
            self.rows.append((row, 0.0, 0.0))

    def _flow(self, table: EdgeTable, outs: dict, ins: dict, arcs) -> None:
        """The edge as a flow over ``arcs`` (plait.plan.auto.ilp_flow): at every layout X,
        inflow - outflow + y[X] - z[X] = 0."""
        arc_columns = [(start, end, self._column(seconds, 0)) for start, end, seconds in arcs]
        layouts = dict.fromkeys([*table.rows, *table.columns, *(a[0] for a in arcs), *(a[1] for a in arcs)])
        for layout in layouts:
            row = {column: 1.0 for _, end, column in arc_columns if end == layout}
            row.update({column: -1.0 for start, _, column in arc_columns if start == layout})
            row.update({self.s[table.source][i]: 1.0 for i in outs.get(layout, [])})
            row.update({self.s[table.target][j]: -1.0 for j in ins.get(layout, [])})
            self.rows.append((row, 0.0, 0.0))

    def _tie(self, name: str, first: str, other: str) -> None:
        """The readers of parameter ``name`` take the same layout of it."""
        mine = _groups(self.strategies[first], lambda option: option.param_layout(name))
        theirs = _groups(self.strategies[other], lambda option: option.param_layout(name))
        for layout in {**mine, **theirs}:
            row = {self.s[first][i]: 1.0 for i in mine.get(layout, [])}
            row.update({self.s[other][i]: -1.0 for i in theirs.get(layout, [])})
            self.rows.append((row, 0.0, 0.0))

    def chosen_columns(self, x) -> list[int]:
        return [max(columns, key=lambda column: x[column]) for columns in self.s.values()]

    def choice(self, x) -> dict[str, Strategy]:
        """Every node's strategy: the kept ones' from HiGHS's ``x``, the eliminated ones'
        best replies to those."""
        kept = {name: self.strategies[name][int(np.argmax([x[c] for c in columns]))]
                for name, columns in self.s.items()}
        return recover(kept, self.strategies, self.eliminated)

    def disconnected(self) -> str:
        return ", ".join(f"{source} -> {target} (input {position})" for source, target, position in self.broken) \
            or "no edge has an impossible reshard; the tied parameters' layouts disagree"


def enumerate_best(graph, strategies, prices: ReshardPrices, memory_limit_bytes):
    """(indices of the cheapest combination or None, combinations, smallest memory of a
    connectable plan when only the memory limit rules every one out): numpy arrays over
    the grid of all combinations, one axis per node."""
    sizes = [len(strategies[node.name]) for node in graph.nodes]
    combinations = math.prod(sizes)
    if combinations > EXHAUSTIVE_LIMIT or len(sizes) > 64:
        raise ValueError(f"exhaustive search over {combinations:,} combinations of {len(sizes)} nodes is above the "
                         f"limit of {EXHAUSTIVE_LIMIT:,} (and 64 nodes): use solve()")
    axis = {node.name: position for position, node in enumerate(graph.nodes)}

    def along(name: str, values) -> np.ndarray:
        shape = [1] * len(sizes)
        shape[axis[name]] = sizes[axis[name]]
        return np.asarray(values, dtype=float).reshape(shape)

    cost = np.zeros(sizes)
    memory = np.zeros(sizes)
    allowed = np.ones(sizes, dtype=bool)
    for node in graph.nodes:
        options = strategies[node.name]
        cost = cost + along(node.name, [o.compute_s + o.comm_s for o in options])
        memory = memory + along(node.name, [o.memory_bytes for o in options])
    for source, target, position in graph.edges():
        table = np.array([[prices.time_s(out.output, want.inputs[position], graph.node(source))
                           for want in strategies[target]] for out in strategies[source]])
        shape = [1] * len(sizes)
        shape[axis[source]], shape[axis[target]] = sizes[axis[source]], sizes[axis[target]]
        cost = cost + table.reshape(shape)  # the source's axis comes first: graph order is topological
    for name, readers in _readers(graph).items():
        for other in readers[1:]:
            first = readers[0]
            same = np.array([[a.param_layout(name) == b.param_layout(name) for b in strategies[other]]
                             for a in strategies[first]])
            shape = [1] * len(sizes)
            shape[axis[first]], shape[axis[other]] = sizes[axis[first]], sizes[axis[other]]
            allowed &= same.reshape(shape)
    allowed &= np.isfinite(cost)
    if not allowed.any():
        return None, combinations, None
    fits = allowed & (memory <= memory_limit_bytes) if memory_limit_bytes is not None else allowed
    if not fits.any():
        return None, combinations, float(memory[allowed].min())
    best = np.unravel_index(int(np.argmin(np.where(fits, cost, math.inf))), sizes)
    return tuple(int(i) for i in best), combinations, None
