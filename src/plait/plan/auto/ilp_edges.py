"""The ILP's edges as cost tables over layouts, and the exact elimination of
pass-through operators before HiGHS sees them.

An edge u -> v (argument k) is a table C[L, M]: the seconds to reshard u's output
layout L into the layout M that v's strategy wants for argument k, over the distinct
L of u's strategies and M of v's.

Elimination (variable elimination of a chain link, exact): an operator v with one
input edge a (from u), one consumer edge b (to w), no parameters and no memory in any
strategy (views, permutes: only its cost and the two edges depend on its choice)
is replaced by one edge u -> w with

    C'[L, M] = min_i ( cost_i + C_a[L, in_i] + C_b[out_i, M] ),

the cheapest way through v for every pair of its neighbours' layouts. Whatever u and
w choose, v's best reply is that argmin, so the optimum is unchanged; :func:`recover`
reads v's strategy back off its neighbours' choices (in reverse order, so a chain of
eliminated operators is read back from its kept ends). A Megatron block's
view -> permute -> attention path shrinks from |L|·15 + 15·24 + 24·8 edge variables
to |L|·8 on a 2x4 mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.plan.auto.strategy import Strategy

__all__ = ["EdgeTable", "edge_tables", "eliminate", "recover", "distinct"]


def distinct(values) -> tuple:
    """The values without repeats, in first-seen order."""
    return tuple(dict.fromkeys(values))


@dataclass(frozen=True)
class EdgeTable:
    """Seconds ``matrix[r, c]`` to turn ``source``'s output layout ``rows[r]`` into the
    layout ``columns[c]`` that ``target`` wants for its argument ``position``; a graph
    edge's ``tensor`` lets the ILP route it as a flow (plait.plan.auto.ilp_flow)."""

    source: str
    target: str
    position: int
    rows: tuple
    columns: tuple
    matrix: np.ndarray
    tensor: tuple | None = None  # (shape, itemsize) of a graph edge's tensor; None once merged


def edge_tables(graph, strategies: dict[str, tuple[Strategy, ...]], prices) -> list[EdgeTable]:
    """One table per edge of ``graph``, priced by ``prices.table`` (reshard_time_s)."""
    tables = []
    for source, target, position in graph.edges():
        producer = graph.node(source)
        rows = distinct(option.output for option in strategies[source])
        columns = distinct(option.inputs[position] for option in strategies[target])
        matrix = prices.table(rows, columns, producer)
        tables.append(EdgeTable(source, target, position, rows, columns, matrix, (producer.shape, producer.itemsize)))
    return tables


@dataclass(frozen=True)
class Eliminated:
    """Operator ``node``, removed between the tables ``into`` and ``out_of``."""

    node: str
    into: EdgeTable
    out_of: EdgeTable


def _passes_through(node, graph, options) -> bool:
    return node.name != graph.output and not node.params and all(option.memory_bytes == 0 for option in options)


def eliminate(graph, strategies, tables: list[EdgeTable]) -> tuple[list[EdgeTable], list[Eliminated]]:
    """The tables after eliminating every pass-through operator (module docstring), and
    the eliminated operators in order. One pass in graph order suffices: a later
    operator's input table may already be the product of an earlier elimination."""
    into = {node.name: [] for node in graph.nodes}
    out_of = {node.name: [] for node in graph.nodes}
    for table in tables:
        into[table.target].append(table)
        out_of[table.source].append(table)
    eliminated = []
    for node in graph.nodes:
        options = strategies[node.name]
        if len(into[node.name]) != 1 or len(out_of[node.name]) != 1 or not _passes_through(node, graph, options):
            continue
        (first,), (second,) = into[node.name], out_of[node.name]
        if first.source == second.target:
            continue
        cost = np.array([option.compute_s + option.comm_s for option in options])
        # (rows of first, options) and (options, columns of second)
        enter = first.matrix[:, [first.columns.index(option.inputs[first.position]) for option in options]]
        leave = second.matrix[[second.rows.index(option.output) for option in options], :]
        through = (enter + cost)[:, :, None] + leave[None, :, :]
        merged = EdgeTable(first.source, second.target, second.position, first.rows, second.columns,
                           through.min(axis=1))
        _swap(out_of[first.source], first, merged)
        _swap(into[second.target], second, merged)
        into[node.name], out_of[node.name] = [], []
        eliminated.append(Eliminated(node.name, first, second))
    kept = [table for tables_of in into.values() for table in tables_of]
    return kept, eliminated


def _swap(tables: list[EdgeTable], old: EdgeTable, new: EdgeTable) -> None:
    """Replace ``old`` (by identity: tables hold arrays) with ``new`` in ``tables``."""
    tables[next(i for i, table in enumerate(tables) if table is old)] = new


def recover(choice: dict[str, Strategy], strategies, eliminated: list[Eliminated]) -> dict[str, Strategy]:
    """``choice`` completed with every eliminated operator's best reply to its
    neighbours' chosen layouts (the first of equals)."""
    choice = dict(choice)
    for record in reversed(eliminated):
        options = strategies[record.node]
        first, second = record.into, record.out_of
        row = first.rows.index(choice[first.source].output)
        column = second.columns.index(choice[second.target].inputs[second.position])
        totals = [option.compute_s + option.comm_s
                  + first.matrix[row, first.columns.index(option.inputs[first.position])]
                  + second.matrix[second.rows.index(option.output), column] for option in options]
        choice[record.node] = options[int(np.argmin(totals))]
    return choice
