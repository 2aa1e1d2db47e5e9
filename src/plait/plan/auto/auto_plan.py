"""What the auto-parallel planner decides, as plain data (torch-free): the mesh, every
operator's strategy, the predicted step time and memory, and why (the alternatives).

The predicted step time of a choice of strategies ``c`` on a mesh is Alpa's intra-op
objective, per device and per training step (forward + backward):

    T(c) = sum_v compute_s(c_v) + sum_v comm_s(c_v) + sum_(u->v, i) reshard_s(out(c_u) -> in_i(c_v))

(compute, the operators' own collectives, and the reshards on the edges, priced by
``plait.plan.auto.reshard_cost``); memory per device is ``sum_v memory_bytes(c_v)``.

Operator groups (what the report's table and the "why" speak of): consecutive nodes
(in topological order) run inside one module, where a leaf module (one no other node
runs inside, e.g. ``transformer.h.0.mlp.c_fc``) counts as its parent's
(``transformer.h.0.mlp``), so a block's projections and the activation between them
form one group.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.opgraph import OpGraph
from plait.plan.auto.strategy import Strategy

__all__ = ["name_pattern", "PlanCost", "EdgeReshard", "MeshOutcome", "Baseline", "RunnerUp", "AutoPlan",
           "operator_groups", "group_key", "TOP_GROUP"]

TOP_GROUP = "(model)"  # the group of nodes run at the model's top level (inputs, a functional loss)
_NUMBERS = re.compile(r"_\d+(?=\W|$)|\d+")  # fx's "_7" suffixes and layer indices


def name_pattern(text: str) -> str:
    """``text`` without its numbers: a module path's layer indices and fx's name suffixes
    (``h.3.attn`` -> ``h..attn``; ``add_7`` and ``add`` -> ``add``), so repeated blocks
    of a model read alike."""
    return _NUMBERS.sub("", text)


@dataclass(frozen=True)
class PlanCost:
    """One plan's predicted step time split (seconds per device per step) and memory per device."""

    compute_s: float
    comm_s: float
    reshard_s: float
    memory_bytes: float

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s

    def as_json(self) -> dict:
        return {"step_time_s": self.step_time_s, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "reshard_s": self.reshard_s, "memory_bytes": self.memory_bytes}


@dataclass(frozen=True)
class EdgeReshard:
    """The reshard on one edge (``source`` -> argument ``position`` of ``target``) of a
    plan: its seconds (forward + backward) and its forward collectives, e.g.
    ("all_gather@1",) (over mesh axis 1); empty when the layouts agree."""

    source: str
    target: str
    position: int
    time_s: float
    collectives: tuple[str, ...]


@dataclass(frozen=True)
class MeshOutcome:
    """The best plan the solver found on one mesh shape (``cost`` None when none fits:
    ``status`` says why), its solve time and relative optimality gap."""

    mesh_shape: tuple[int, ...]
    cost: PlanCost | None
    solve_s: float
    gap: float
    status: str

    def as_json(self) -> dict:
        return {"mesh": list(self.mesh_shape), "cost": None if self.cost is None else self.cost.as_json(),
                "solve_s": self.solve_s, "gap": self.gap if math.isfinite(self.gap) else None, "status": self.status}


@dataclass(frozen=True)
class Baseline:
    """A reference plan priced by the same model: ``name`` (e.g. "all replicated"),
    what it is, its mesh and cost (None when it does not fit the memory limit)."""

    name: str
    description: str
    mesh_shape: tuple[int, ...]
    cost: PlanCost | None

    def as_json(self) -> dict:
        return {"name": self.name, "description": self.description, "mesh": list(self.mesh_shape),
                "cost": None if self.cost is None else self.cost.as_json()}


@dataclass(frozen=True)
class RunnerUp:
    """For one operator group: its deciding node's chosen strategy, the best plan that
    does not choose it (``runner_up``: that node's strategy there) and how much slower
    that plan is (``delta_s`` >= 0). ``method``: "re-solved" (the solver re-run with the
    chosen strategy removed) or "others held" (only this node changed, the rest as
    chosen: an upper bound of the re-solved delta). ``alike``: later groups of the same
    name up to numbers (h.1.mlp after h.0.mlp) whose deciding node chose the same
    strategy, not priced again."""

    group: str
    node: str
    chosen: str
    runner_up: str | None
    delta_s: float | None
    method: str
    alike: int = 0

    def as_json(self) -> dict:
        return {"group": self.group, "node": self.node, "chosen": self.chosen, "runner_up": self.runner_up,
                "delta_s": self.delta_s, "method": self.method, "alike": self.alike}


@dataclass(frozen=True)
class AutoPlan:
    """The planner's answer: ``mesh`` and per node of ``graph`` the chosen ``Strategy``
    (``choice``) and the layouts the executor takes (``layouts``: node name ->
    ``plait.parallel.auto.node_layout.NodeLayout``), the predicted ``cost``, the solver's
    ``solve_s``, ``gap`` and ``status`` on the chosen mesh, and the alternatives:
    ``meshes`` (the best plan on every mesh shape tried), ``baselines`` and
    ``runner_ups``; ``edges``: every edge's reshard. ``simplified``: whether ``graph`` is
    the trace after Alpa's merges. ``stages``: the inter-operator plan (stages and
    sub-meshes) when one was asked for, else None."""

    graph: OpGraph
    mesh: AutoMesh
    choice: dict[str, Strategy]
    layouts: dict
    cost: PlanCost
    solve_s: float
    gap: float
    status: str
    meshes: tuple[MeshOutcome, ...]
    baselines: tuple[Baseline, ...] = ()
    runner_ups: tuple[RunnerUp, ...] = ()
    edges: tuple[EdgeReshard, ...] = ()
    simplified: bool = True
    cluster_description: str = ""
    memory_limit_bytes: float | None = None
    stages: object | None = None
    model_description: str = ""

    @property
    def step_time_s(self) -> float:
        return self.cost.step_time_s

    @property
    def total_solve_s(self) -> float:
        return sum(outcome.solve_s for outcome in self.meshes)


def _leaf_modules(graph: OpGraph) -> set[str]:
    """Module paths no other node's module lies inside."""
    paths = {node.module for node in graph.nodes if node.module}
    return {path for path in paths if not any(other.startswith(path + ".") for other in paths)}


def group_key(module: str, leaves: set[str]) -> str:
    """The group a node run inside ``module`` belongs to: a leaf module's parent, else the module."""
    if module in leaves:
        module = module.rpartition(".")[0]
    return module or TOP_GROUP


def operator_groups(graph: OpGraph) -> list[tuple[str, tuple[str, ...]]]:
    """(group name, node names) of consecutive nodes of one module (see the module doc),
    in topological order; a module entered twice apart gives two groups of one name."""
    leaves = _leaf_modules(graph)
    groups: list[tuple[str, list[str]]] = []
    for node in graph.nodes:
        key = group_key(node.module, leaves)
        if groups and groups[-1][0] == key:
            groups[-1][1].append(node.name)
        else:
            groups.append((key, [node.name]))
    return [(key, tuple(names)) for key, names in groups]
