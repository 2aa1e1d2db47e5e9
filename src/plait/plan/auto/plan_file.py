"""An auto-parallel plan saved as JSON, and read back for ``plait train --plan FILE``.

The file (``"format": "plait.auto_plan"``, ``"version": 1``) names the model's source
(``"PKG.MOD:FUNCTION"``, a factory returning ``(module, example_inputs)``, or
``"hf:CONFIG"``) and its example inputs' shapes, the mesh, per node of the (simplified)
graph its layouts (output, one per input, one per parameter, as ``"S0,R"`` text) with
the strategy's name, kind, module and merged members, and the predictions (step time
split, memory per device, solve time, gap, the alternatives). Only the layouts are
executed; the rest is the record of why.

Loading checks the format and version, and ``SavedPlan.check_graph`` refuses a plan
whose node names differ from a re-trace of the model (a changed model would otherwise
run with layouts meant for other operators), naming the nodes on each side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from plait.names.placements import layout_text, parse_layout
from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.node_layout import NodeLayout
from plait.parallel.auto.opgraph import OpGraph
from plait.plan.auto.auto_plan import AutoPlan

__all__ = ["FORMAT", "VERSION", "SavedPlan", "plan_json", "save_plan", "load_plan", "read_plan"]

FORMAT = "plait.auto_plan"
VERSION = 1
_SHOWN_NAMES = 6  # node names a mismatch message lists per side


@dataclass(frozen=True)
class SavedPlan:
    """A plan read back: its ``mesh``, per node the executor's ``layouts``, the
    ``strategy_names``, the merged ``members`` and the ``kinds``, whether the graph was
    ``simplified``, the model ``source`` (factory spec or hf:CONFIG, or None),
    ``input_shapes`` and the recorded ``prediction`` (a dict, as saved)."""

    path: str
    mesh: AutoMesh
    layouts: dict[str, NodeLayout]
    strategy_names: dict[str, str]
    members: dict[str, tuple[str, ...]]
    kinds: dict[str, str]
    simplified: bool
    source: str | None
    input_shapes: tuple[tuple[int, ...], ...]
    prediction: dict

    def check_graph(self, graph: OpGraph) -> None:
        """Refuse (ValueError) unless ``graph`` (the model re-traced, simplified as the plan
        was) has exactly the plan's node names, each of the kind it had."""
        planned, traced = set(self.layouts), {node.name for node in graph.nodes}
        if planned == traced:
            changed = [f"{node.name} ({self.kinds[node.name]} -> {node.kind})" for node in graph.nodes
                       if self.kinds.get(node.name, node.kind) != node.kind]
            if changed:
                raise ValueError(f"plan {self.path} does not match the model's trace: nodes of another kind now: "
                                 f"{', '.join(changed[:_SHOWN_NAMES])}: the model changed since it was planned; "
                                 "plan it again (plait plan --auto ... --save FILE)")
            return
        only_plan = [name for name in self.layouts if name not in traced]
        only_model = [node.name for node in graph.nodes if node.name not in planned]

        def shown(names):
            more = f" and {len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else ""
            return (", ".join(names[:_SHOWN_NAMES]) + more) if names else "none"

        raise ValueError(f"plan {self.path} does not match the model's trace: nodes only in the plan: "
                         f"{shown(only_plan)}; only in the model: {shown(only_model)}: the model changed since it "
                         "was planned; plan it again (plait plan --auto ... --save FILE)")


def _layouts_text(layouts) -> list[str]:
    return [layout_text(layout) for layout in layouts]


def plan_json(plan: AutoPlan, *, source: str | None = None, input_shapes=()) -> dict:
    """The JSON document of ``plan`` (what ``save_plan`` writes)."""
    nodes = []
    for node in plan.graph.nodes:
        strategy = plan.choice[node.name]
        nodes.append({"name": node.name, "kind": node.kind, "module": node.module,
                      "members": list(node.members or (node.name,)), "strategy": strategy.name,
                      "output": layout_text(strategy.output), "inputs": _layouts_text(strategy.inputs),
                      "params": {name: layout_text(layout) for name, layout in strategy.params}})
    prediction = {**plan.cost.as_json(), "solve_s": plan.solve_s, "gap": plan.gap, "status": plan.status,
                  "memory_limit_bytes": plan.memory_limit_bytes}
    return {"format": FORMAT, "version": VERSION,
            "model": {"source": source, "description": plan.model_description,
                      "input_shapes": [list(shape) for shape in input_shapes]},
            "cluster": plan.cluster_description, "mesh": list(plan.mesh.shape),
            "simplified": plan.simplified, "nodes": nodes, "prediction": prediction,
            "meshes": [outcome.as_json() for outcome in plan.meshes],
            "baselines": [baseline.as_json() for baseline in plan.baselines],
            "runner_ups": [runner_up.as_json() for runner_up in plan.runner_ups],
            "stages": None if plan.stages is None else _stages_json(plan.stages)}


def _stages_json(search) -> dict:
    """The inter-operator plan (plait.plan.auto.stages.StageSearch) as JSON."""
    return {"latency_s": search.latency_s, "microbatches": search.microbatches,
            "single_stage_latency_s": search.single_stage_latency_s, "stage_layers": list(search.stage_layers),
            "stages": [{"start": stage.start, "end": stage.end, "layer_names": list(stage.layer_names),
                        "devices": stage.devices, "mesh": list(stage.mesh_shape), "time_s": stage.time_s,
                        "memory_bytes": stage.memory_bytes} for stage in search.stages]}


def save_plan(plan: AutoPlan, path: str | Path, *, source: str | None = None, input_shapes=()) -> Path:
    """Write ``plan`` as JSON at ``path`` (parent directories created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan_json(plan, source=source, input_shapes=input_shapes), indent=1,
                               allow_nan=False) + "\n")
    return path


def _field(document: dict, key: str, kind, where: str):
    value = document.get(key)
    if not isinstance(value, kind):
        raise ValueError(f"{where}: field {key!r} is {value!r}; a plait plan file has a {kind.__name__} there "
                         "(write it with plait plan --auto --save FILE)")
    return value


def read_plan(document: dict, where: str = "plan") -> SavedPlan:
    """A ``SavedPlan`` from a JSON document (format and version checked, every layout parsed)."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{where} is not a plait auto plan (format {found!r}, expected {FORMAT!r}); write one with "
                         "plait plan --auto ... --save FILE")
    if document.get("version") != VERSION:
        raise ValueError(f"{where} is plan version {document.get('version')!r}; this plait reads version {VERSION}: "
                         "plan the model again (plait plan --auto ... --save FILE)")
    mesh = AutoMesh(tuple(_field(document, "mesh", list, where)))
    layouts, names, members, kinds = {}, {}, {}, {}
    for entry in _field(document, "nodes", list, where):
        try:
            name = entry["name"]
            layout = NodeLayout(inputs=tuple(parse_layout(text) for text in entry["inputs"]),
                                output=parse_layout(entry["output"]),
                                params=tuple((param, parse_layout(text)) for param, text in entry["params"].items()))
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{where}: node entry {entry!r} lacks or mistypes {error}") from None
        for placements in (layout.output, *layout.inputs, *(placed for _, placed in layout.params)):
            if len(placements) != mesh.ndim:
                raise ValueError(f"{where}: node {name!r} has layout {layout_text(placements)!r} for a "
                                 f"{mesh.ndim}-axis mesh {mesh.text()}")
        layouts[name], names[name] = layout, entry.get("strategy", "")
        members[name] = tuple(entry.get("members") or (name,))
        if "kind" in entry:
            kinds[name] = entry["kind"]
    model = document.get("model") or {}
    return SavedPlan(path=where, mesh=mesh, layouts=layouts, strategy_names=names, members=members, kinds=kinds,
                     simplified=bool(document.get("simplified", True)), source=model.get("source"),
                     input_shapes=tuple(tuple(shape) for shape in model.get("input_shapes") or ()),
                     prediction=dict(document.get("prediction") or {}))


def load_plan(path: str | Path) -> SavedPlan:
    """Read the plan file at ``path`` (see the module doc); check it against the model
    with ``SavedPlan.check_graph`` before running it."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no plan file at {path}; write one with plait plan --auto ... --save {path}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"plan file {path} is not JSON ({error.msg} at line {error.lineno}); write it with "
                         "plait plan --auto ... --save FILE") from None
    return read_plan(document, str(path))
