"""The auto planner end to end on a tiny MLP training step (trace -> strategies -> ILP per
mesh -> the best): a valid plan whose predicted step time is the sum of its parts,
recomputed here from the strategies and the reshard prices; the plan file's round trip
and its refusal of a plan that does not match the model."""

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.node_layout import NodeLayout
from plait.parallel.auto.opgraph import OpGraph
from plait.parallel.auto.trace import simplify, trace_graph
from plait.plan.auto.plan_file import load_plan, save_plan
from plait.plan.auto.planner import ALL_REPLICATED, auto_plan, DATA_PARALLEL, default_mesh_shapes
from plait.plan.auto.report import report_lines
from plait.plan.auto.reshard_cost import reshard_time_s
from plait.plan.auto.strategies import graph_strategies
from plait.cost import LinkModel
from plait.plan.cluster import Cluster, cluster_preset
from plait.plan.device_spec import DeviceSpec
from plait.testing import run_distributed

HIDDEN, BATCH = 1024, 256  # wide enough that sharding beats replication on 8 A100s (5x here)
REL = 1e-12  # sums of the same float terms in another order


class MLPStep(nn.Module):
    """A two-layer MLP and its loss: forward(x, y) -> mse."""

    def __init__(self, hidden: int = HIDDEN, layers: int = 2):
        super().__init__()
        widths = [hidden, 4 * hidden] + [hidden] * (layers - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x, y):
        for index, layer in enumerate(self.layers):
            x = layer(x) if index == len(self.layers) - 1 else torch.relu(layer(x))
        return nn.functional.mse_loss(x, y)


def mlp_step(layers: int = 2):
    torch.manual_seed(0)
    return MLPStep(layers=layers), (torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN))


@pytest.fixture(scope="module")
def planned():
    model, inputs = mlp_step()
    cluster = cluster_preset("dgx-a100", gpus=8)
    traced = trace_graph(model, inputs)
    return model, inputs, cluster, traced, auto_plan(model, inputs, cluster, traced=traced)


def test_default_meshes_are_every_1d_and_2d_factorisation():
    assert default_mesh_shapes(8) == [(8,), (2, 4), (4, 2)]
    assert default_mesh_shapes(6) == [(6,), (2, 3), (3, 2)]
    assert default_mesh_shapes(5) == [(5,)]


def test_the_plan_is_valid_and_its_time_is_the_sum_of_its_parts(planned):
    model, inputs, cluster, traced, plan = planned
    graph, mesh = plan.graph, plan.mesh
    assert graph == simplify(traced.graph)
    assert [outcome.mesh_shape for outcome in plan.meshes] == [(8,), (2, 4), (4, 2)]
    # every choice is one of the node's strategies on that mesh (enumerated again here)
    options = graph_strategies(graph, mesh, cluster)
    assert set(plan.choice) == {node.name for node in graph.nodes}
    assert all(plan.choice[name] in options[name] for name in plan.choice)
    # the predicted time, recomputed: the strategies' compute and collectives, a reshard per edge
    compute_s = sum(strategy.compute_s for strategy in plan.choice.values())
    comm_s = sum(strategy.comm_s for strategy in plan.choice.values())
    reshard_s = 0.0
    for node in graph.nodes:
        for position, source in enumerate(node.inputs):
            produced = graph.node(source)
            reshard_s += reshard_time_s(plan.choice[source].output, plan.choice[node.name].inputs[position],
                                        produced.shape, produced.itemsize, mesh, cluster)
    assert math.isfinite(reshard_s)
    assert plan.cost.compute_s == pytest.approx(compute_s, rel=REL)
    assert plan.cost.comm_s == pytest.approx(comm_s, rel=REL)
    assert plan.cost.reshard_s == pytest.approx(reshard_s, rel=REL, abs=1e-18)
    assert plan.step_time_s == pytest.approx(compute_s + comm_s + reshard_s, rel=REL)
    assert plan.cost.memory_bytes == pytest.approx(sum(s.memory_bytes for s in plan.choice.values()), rel=REL)
    assert sum(edge.time_s for edge in plan.edges) == pytest.approx(reshard_s, rel=REL, abs=1e-18)
    # the executor's layouts are the strategies' own
    assert plan.layouts == {name: NodeLayout(inputs=s.inputs, output=s.output, params=s.params)
                            for name, s in plan.choice.items()}
    # the best of the meshes and no worse than the baselines; sharding wins here
    assert plan.step_time_s == min(o.cost.step_time_s for o in plan.meshes if o.cost is not None)
    baselines = {baseline.name: baseline.cost.step_time_s for baseline in plan.baselines}
    assert set(baselines) == {ALL_REPLICATED, DATA_PARALLEL}
    assert plan.step_time_s <= baselines[DATA_PARALLEL] <= baselines[ALL_REPLICATED]
    assert plan.step_time_s < 0.5 * baselines[ALL_REPLICATED]
    assert any(placement != "R" for strategy in plan.choice.values() for _, layout in strategy.params
               for placement in layout)  # some parameter is sharded
    # every runner-up is a real alternative, no faster than the plan
    assert plan.runner_ups and all(r.delta_s is None or r.delta_s >= -1e-12 * plan.step_time_s
                                   for r in plan.runner_ups)
    assert all(r.runner_up != r.chosen for r in plan.runner_ups)


def test_a_memory_limit_is_kept_and_an_impossible_one_refused(planned):
    model, inputs, cluster, traced, plan = planned
    free = plan.cost  # the chosen mesh's plan without a limit (80 GiB)
    smallest = sum(min(s.memory_bytes for s in options)
                   for options in graph_strategies(plan.graph, plan.mesh, cluster).values())
    assert smallest < free.memory_bytes  # so a limit between them binds
    limit = (smallest + free.memory_bytes) / 2
    tight = auto_plan(model, inputs, cluster, traced=traced, mesh_shapes=[plan.mesh.shape],
                      memory_limit_bytes=limit, max_resolves=0)
    assert tight.cost.memory_bytes <= limit and tight.step_time_s >= free.step_time_s
    with pytest.raises(ValueError, match="memory limit"):
        auto_plan(model, inputs, cluster, traced=traced, mesh_shapes=[(8,)], memory_limit_bytes=1000.0)
    with pytest.raises(ValueError, match=r"mesh 2x2 has 4 devices; the cluster has 8"):
        auto_plan(model, inputs, cluster, traced=traced, mesh_shapes=[(2, 2)])


def test_plan_file_round_trip_and_refusals(planned, tmp_path):
    model, inputs, cluster, traced, plan = planned
    path = save_plan(plan, tmp_path / "plan.json", source="tests.plan.auto.test_planner:mlp_step",
                     input_shapes=[tuple(t.shape) for t in inputs])
    saved = load_plan(path)
    assert saved.mesh == plan.mesh and saved.layouts == plan.layouts
    assert saved.source == "tests.plan.auto.test_planner:mlp_step" and saved.input_shapes == ((BATCH, HIDDEN),) * 2
    assert saved.strategy_names == {name: s.name for name, s in plan.choice.items()}
    assert saved.prediction["step_time_s"] == plan.step_time_s and saved.simplified
    saved.check_graph(simplify(trace_graph(model, inputs).graph))  # the model re-traced: the same names
    deeper, deeper_inputs = mlp_step(layers=3)
    with pytest.raises(ValueError, match=r"does not match the model's trace: nodes only in the plan: none; only in "
                                         r"the model: linear_2"):
        saved.check_graph(simplify(trace_graph(deeper, deeper_inputs).graph))
    graph = plan.graph
    other_kind = OpGraph(nodes=tuple(dataclasses.replace(node, kind="reduce") if node.kind == "loss" else node
                                     for node in graph.nodes), params=graph.params, inputs=graph.inputs,
                         output=graph.output)
    with pytest.raises(ValueError, match=r"nodes of another kind now: mse_loss \(loss -> reduce\)"):
        saved.check_graph(other_kind)
    document = json.loads(path.read_text())
    other_mesh = [2, 4] if plan.mesh.ndim == 1 else [8]
    for key, value, message in (("version", 2, "plan version 2; this plait reads version 1"),
                                ("format", "other", "is not a plait auto plan"),
                                ("mesh", other_mesh, f"has layout .* for a {len(other_mesh)}-axis mesh")):
        (tmp_path / "bad.json").write_text(json.dumps({**document, key: value}))
        with pytest.raises(ValueError, match=message):
            load_plan(tmp_path / "bad.json")


def test_the_inter_operator_pass_is_reported_apart(tmp_path):
    """--microbatches: Alpa's stage / sub-mesh search on one micro-batch's graph, every
    device in one stage's sub-mesh, kept apart from the executed intra-op layouts."""
    model, inputs = mlp_step(layers=3)
    cluster = cluster_preset("dgx-a100", gpus=4)
    plan = auto_plan(model, inputs, cluster, mesh_shapes=[(4,)], microbatches=4, max_resolves=0)
    search = plan.stages
    assert search.microbatches == 4 and sum(stage.devices for stage in search.stages) == 4
    assert search.latency_s == pytest.approx(sum(s.time_s for s in search.stages)
                                             + 3 * max(s.time_s for s in search.stages), rel=REL)
    text = "\n".join(report_lines(plan))
    assert "inter-operator plan" in text and f"{len(search.stages)} stage(s), 4 micro-batches" in text
    document = json.loads(save_plan(plan, tmp_path / "plan.json").read_text())
    assert document["stages"]["stage_layers"] == list(search.stage_layers)
    assert {node["name"] for node in document["nodes"]} == set(plan.layouts)  # the layouts stay the intra-op plan's
    with pytest.raises(ValueError, match="microbatches=3 does not divide the batch of 256"):
        auto_plan(model, inputs, cluster, mesh_shapes=[(4,)], microbatches=3)


def _unit_cluster(devices: int):
    """A float64 device slow enough (1 GFLOP/s) that sharding the MLP pays, on one node."""
    device = DeviceSpec(name="unit", peak_flops_per_s=(("float64", 1e9),), memory_bytes=1e12,
                        memory_bandwidth_bytes_per_s=1e9, kernel_overhead_s=1e-6)
    link = LinkModel(1e-6, 1e-9)
    return Cluster(name="test", nodes=1, devices_per_node=devices, device=device, intra_link=link, inter_link=link)


def small_step():
    """The factory the saved plan names: a float64 MLP step, batch 16."""
    torch.manual_seed(0)
    model = MLPStep(hidden=16).double()
    return model, (torch.randn(16, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64))


def _run_saved_plan(rank: int, world_size: int, path: str) -> dict:
    """Load the plan, rebuild and re-trace the model, check the names, run one step
    sharded and one whole: the loss and every gradient's largest difference."""
    from plait.cli.factory import load_factory
    from plait.parallel.auto.execute import AutoParallelModule

    saved = load_plan(path)
    model, inputs = load_factory(saved.source)
    traced = trace_graph(model, inputs)
    graph = simplify(traced.graph)
    saved.check_graph(graph)
    auto = AutoParallelModule(traced, saved.layouts, saved.mesh, graph=graph)
    reference, _ = small_step()
    loss, ref_loss = auto(*inputs), reference(*inputs)
    loss.backward()
    ref_loss.backward()
    grads = dict(reference.named_parameters())
    return {"loss": abs(float(loss - ref_loss)),
            "grads": max(float((param.grad - auto.reference_shard(grads[name].grad, name)).abs().max())
                         for name, param in auto.named_parameters())}


@pytest.mark.slow
def test_a_saved_plan_runs_sharded_exactly(tmp_path):
    """plan -> save -> (2 ranks) load, re-trace, check names, execute: float64 loss and
    gradients equal one process's to 1e-12 (sums of a few hundred O(1) products)."""
    model, inputs = small_step()
    plan = auto_plan(model, inputs, _unit_cluster(2), mesh_shapes=[(2,)], max_resolves=0)
    assert any(placement != "R" for strategy in plan.choice.values() for _, layout in strategy.params
               for placement in layout)  # parameters really sharded
    path = save_plan(plan, tmp_path / "plan.json", source="tests.plan.auto.test_planner:small_step")
    for result in run_distributed(_run_saved_plan, 2, str(path)):
        assert result["loss"] <= 1e-12 and result["grads"] <= 1e-12, result
