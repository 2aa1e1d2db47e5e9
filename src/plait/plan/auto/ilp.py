"""Alpa's intra-operator ILP: one sharding strategy per operator, minimising the
step's time (the operators' compute and communication plus the resharding on every
edge) under a memory limit, solved as a MILP by HiGHS (``scipy.optimize.milp``).

Variables and constraints (Alpa, OSDI '22, section 4.2):

- ``s[v,i]`` binary, node v takes its strategy i; ``sum_i s[v,i] = 1``;
- for every edge u -> v (argument k), with L ranging over the distinct output layouts
  of u's strategies and M over the distinct layouts v's strategies want for input k:
  ``y[u,L] = sum_{i: out_i = L} s[u,i]``, ``z[v,k,M] = sum_{j: in_jk = M} s[v,j]`` and
  continuous ``e[L,M] >= 0`` with ``sum_M e[L,M] = y[u,L]``, ``sum_L e[L,M] =
  z[v,k,M]``: once the s are 0/1 both margins are one-hot and the only solution puts
  e = 1 on the chosen pair, so e needs no integrality. Edge variables over layouts,
  not strategy pairs, keep the model small (a linear's 8 strategies often share 3
  output layouts). Where one side has a single layout the edge's cost folds into the
  other side's strategy costs and no e is made; a pair whose reshard is impossible
  (math.inf) gets no e, so it cannot be chosen;
- objective ``sum s[v,i] (compute_s + comm_s) + sum e[L,M] reshard_time_s(L -> M)``;
- memory ``sum s[v,i] memory_bytes <= limit``: Alpa's simplification, the sum of
  every operator's memory (parameters, their gradients and optimizer state, saved
  activations) as if all were live at once: an upper bound of the peak;
- a parameter read by several operators (tied embeddings) takes one layout: for each
  further reader r and layout Q, ``sum_{i: Q} s[first,i] = sum_{j: Q} s[r,j]``.

Two exact reductions keep a 48-layer transformer small (plait.plan.auto.ilp_edges,
ilp_flow): operators that only pass a tensor on (one input, one consumer, no
parameters, no memory: views, permutes) are solved in closed form, their edges merged;
and where it needs fewer variables an edge's e[L, M] are replaced by a flow over the
single-axis reshard steps (reshard_time_s is a shortest path of them), with the same
optimum and the same LP bound.

The costs are scaled to the largest coefficient before HiGHS sees them (its absolute
tolerances are ~1e-6: seconds of 1e-6 would drown in them); the reported costs are
recomputed from the chosen strategies (:func:`plan_objective`), the optimality gap
from HiGHS's dual bound: (objective - bound) / objective.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix

from plait.plan.auto.ilp_model import EXHAUSTIVE_LIMIT, IlpModel, ReshardPrices, check_strategies, enumerate_best
from plait.plan.auto.strategy import Strategy

__all__ = ["IlpResult", "solve", "exhaustive", "plan_objective", "EXHAUSTIVE_LIMIT"]

_GIB = float(1 << 30)


@dataclass(frozen=True)
class IlpResult:
    """The chosen strategy per node name and what the plan costs per device and step:
    ``objective_s`` = ``compute_s + comm_s + reshard_s``; ``memory_bytes`` (the sum
    over operators); ``solve_s`` (HiGHS's wall time, or the enumeration's); ``gap``
    the relative optimality gap (0 for a proven optimum); ``bound_s`` the solver's
    lower bound on the objective; ``status`` "optimal", "time_limit" (the best plan
    found when HiGHS stopped) or "exhaustive"; ``variables``/``constraints`` the
    model's size (for exhaustive: combinations, 0); ``eliminated`` the pass-through
    operators solved in closed form before HiGHS (plait.plan.auto.ilp_edges)."""

    choice: dict[str, Strategy]
    objective_s: float
    compute_s: float
    comm_s: float
    reshard_s: float
    memory_bytes: float
    solve_s: float
    gap: float
    bound_s: float
    status: str
    variables: int
    constraints: int
    eliminated: int = 0


def plan_objective(graph, choice: dict[str, Strategy], mesh, cluster, *, prices: ReshardPrices | None = None):
    """(compute_s, comm_s, reshard_s, memory_bytes) of a full choice: the sums of the
    chosen strategies' costs, and reshard_time_s from each producer's output layout to
    the layout its consumer's strategy wants, summed over every edge of ``graph``."""
    prices = prices or ReshardPrices(mesh, cluster)
    missing = [node.name for node in graph.nodes if node.name not in choice]
    if missing:
        raise ValueError(f"the choice has no strategy for node(s) {missing}")
    compute_s = sum(choice[node.name].compute_s for node in graph.nodes)
    comm_s = sum(choice[node.name].comm_s for node in graph.nodes)
    memory_bytes = sum(choice[node.name].memory_bytes for node in graph.nodes)
    reshard_s = 0.0
    for source, target, position in graph.edges():
        producer = graph.node(source)
        reshard_s += prices.time_s(choice[source].output, choice[target].inputs[position], producer)
    return compute_s, comm_s, reshard_s, memory_bytes


def _result(graph, choice, mesh, cluster, prices, **fields) -> IlpResult:
    compute_s, comm_s, reshard_s, memory_bytes = plan_objective(graph, choice, mesh, cluster, prices=prices)
    return IlpResult(choice=choice, objective_s=compute_s + comm_s + reshard_s, compute_s=compute_s, comm_s=comm_s,
                     reshard_s=reshard_s, memory_bytes=memory_bytes, **fields)


def _memory_error(limit_bytes: float, smallest_bytes: float, proven: bool = True) -> ValueError:
    found = "" if proven else "; the smallest HiGHS found within the time limit, not proven least"
    return ValueError(f"memory limit {limit_bytes / _GIB:.4g} GiB ({limit_bytes:,.0f} bytes) is below the smallest "
                      f"plan's {smallest_bytes / _GIB:.4g} GiB ({smallest_bytes:,.0f} bytes, the sum over "
                      f"operators{found}): raise --memory-limit-gib or use more devices")


def _run(model: IlpModel, objective, *, with_memory: bool, time_limit_s: float, mip_rel_gap: float):
    """HiGHS on ``model`` (its memory row left out unless ``with_memory``): (result, rows)."""
    rows = [row for index, row in enumerate(model.rows) if with_memory or index != model.memory_row]
    matrix = csr_matrix(([v for coefficients, _, _ in rows for v in coefficients.values()],
                         [c for coefficients, _, _ in rows for c in coefficients],
                         np.cumsum([0] + [len(coefficients) for coefficients, _, _ in rows])),
                        shape=(len(rows), model.columns))
    constraints = LinearConstraint(matrix, [lower for _, lower, _ in rows], [upper for _, _, upper in rows])
    result = milp(objective, integrality=np.array(model.integral), bounds=Bounds(np.zeros(model.columns), model.upper),
                  constraints=constraints, options={"time_limit": float(time_limit_s), "mip_rel_gap": float(mip_rel_gap),
                                                    "presolve": True, "disp": False})
    return result, len(rows)


def solve(graph, strategies: dict[str, list[Strategy]], mesh, cluster, *, memory_limit_bytes: float | None = None,
          time_limit_s: float = 60.0, mip_rel_gap: float = 1e-3) -> IlpResult:
    """The cheapest strategy per node (module docstring), within ``memory_limit_bytes``
    (None: no limit); HiGHS stops at ``time_limit_s`` or when the relative gap is
    below ``mip_rel_gap`` (0: prove the optimum). ValueError, naming the limits, when
    no plan fits the memory or no combination of layouts connects."""
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0):
        raise ValueError(f"time_limit_s={time_limit_s!r} must be a number > 0")
    prices = ReshardPrices(mesh, cluster)
    model = IlpModel(graph, check_strategies(graph, strategies, mesh), prices, memory_limit_bytes)
    scale = model.unit_s
    started = time.perf_counter()
    result, rows = _run(model, np.array(model.cost_s) / scale, with_memory=True, time_limit_s=time_limit_s,
                        mip_rel_gap=mip_rel_gap)
    solve_s = time.perf_counter() - started
    if result.x is None:
        _explain_failure(model, result, memory_limit_bytes, time_limit_s)
    choice = model.choice(result.x)
    bound_s = float(result.mip_dual_bound) * scale + model.constant_s \
        if result.mip_dual_bound is not None and math.isfinite(result.mip_dual_bound) else math.nan
    status = "optimal" if result.status == 0 else "time_limit"
    outcome = _result(graph, choice, mesh, cluster, prices, solve_s=solve_s, gap=0.0, bound_s=bound_s,
                      status=status, variables=model.columns, constraints=rows, eliminated=len(model.eliminated))
    objective_s = outcome.objective_s
    gap = max(0.0, (objective_s - bound_s) / objective_s) if objective_s > 0 and math.isfinite(bound_s) else 0.0
    return IlpResult(**{**outcome.__dict__, "gap": gap})


def _explain_failure(model: IlpModel, result, memory_limit_bytes, time_limit_s) -> None:
    """Raise the error that says why HiGHS returned no plan."""
    if result.status == 1:
        raise ValueError(f"HiGHS found no plan within time_limit_s={time_limit_s:g}: raise it (or simplify the "
                         "graph: fewer strategies per node)")
    if memory_limit_bytes is not None:
        # the smallest memory any connectable plan needs: the same model, memory as objective
        smallest, _ = _run(model, np.array(model.memory_bytes) / max(1.0, max(model.memory_bytes)),
                           with_memory=False, time_limit_s=time_limit_s, mip_rel_gap=1e-9)
        if smallest.x is not None:
            raise _memory_error(memory_limit_bytes, sum(model.memory_bytes[c] for c in model.chosen_columns(smallest.x)),
                                proven=smallest.status == 0)
    raise ValueError(f"no combination of the strategies connects: {model.disconnected()} (every reshard on the "
                     f"edges there is impossible); HiGHS: {str(result.message).split('. (')[0]}")


def exhaustive(graph, strategies: dict[str, list[Strategy]], mesh, cluster, *,
               memory_limit_bytes: float | None = None, time_limit_s: float = 60.0, mip_rel_gap: float = 0.0) -> IlpResult:
    """The same optimum by trying every combination (the ILP's test oracle); refuses
    graphs of more than EXHAUSTIVE_LIMIT combinations. ``time_limit_s`` and
    ``mip_rel_gap`` are accepted for a signature like :func:`solve` and unused."""
    prices = ReshardPrices(mesh, cluster)
    checked = check_strategies(graph, strategies, mesh)
    started = time.perf_counter()
    picks, combinations, smallest_bytes = enumerate_best(graph, checked, prices, memory_limit_bytes)
    solve_s = time.perf_counter() - started
    if picks is None:
        if smallest_bytes is not None:
            raise _memory_error(memory_limit_bytes, smallest_bytes)
        raise ValueError("no combination of the strategies connects (every one meets an impossible reshard or "
                         "gives a tied parameter two layouts)")
    choice = {node.name: checked[node.name][index] for node, index in zip(graph.nodes, picks)}
    outcome = _result(graph, choice, mesh, cluster, prices, solve_s=solve_s, gap=0.0, bound_s=0.0,
                      status="exhaustive", variables=combinations, constraints=0)
    return IlpResult(**{**outcome.__dict__, "bound_s": outcome.objective_s})
