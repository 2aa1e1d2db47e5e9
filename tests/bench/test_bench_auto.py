"""plait bench auto's models (plait.models.auto_zoo) and harness (plait.bench.auto):
the zoo's models return their scalar loss and split into the layers the knob search
prices; the harness runs end to end at toy size. No timing is asserted (speed lives in
the benchmark itself)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.bench.auto import AutoBenchConfig, plan_world, run_auto_bench, summarize
from plait.bench.auto_plans import AUTO, DATA_PARALLEL, KNOB, plan_sides, RUN_AUTO, RUN_DP, SINGLE
from plait.cli.bench_auto import table_lines
from plait.cli.main import main
from plait.cost.presets import PLACEHOLDER_LOCAL_LINK
from plait.models.auto_zoo import TINY, ZOO, build
from plait.parallel.auto.trace import trace_graph
from plait.plan.cluster import cluster_preset
from plait.plan.device_spec import DeviceSpec
from plait.testing import run_distributed

# float64, the same products in the same order up to the loss: only the split into
# modules differs, so 1e-12 relative (a few ulps of ~2) is the bound
EXACT = 1e-12


def test_zoo_models_return_a_scalar_loss_that_their_pipeline_layers_rebuild():
    for name in ZOO:
        model, inputs = build(name, dtype=torch.float64, **TINY[name])
        loss = model(*inputs)
        assert loss.dim() == 0 and loss.dtype == torch.float64 and torch.isfinite(loss), name
        loss.backward()
        assert all(param.grad is not None for param in model.parameters()), name
        x = inputs[0]
        for layer in model.pipeline_layers():
            x = layer(x)
        rebuilt = F.mse_loss(x, inputs[1]) if name == "moe" else F.cross_entropy(x, inputs[1])
        assert torch.allclose(rebuilt, loss, rtol=EXACT, atol=0), (name, float(rebuilt), float(loss))
        again_model, again_inputs = build(name, dtype=torch.float64, **TINY[name])  # seeded: the same
        assert torch.equal(again_model(*again_inputs), loss.detach()), name


def test_moe_mixes_exactly_the_top_k_experts_of_each_token():
    model, (x, _) = build("moe", dtype=torch.float64, **TINY["moe"])
    top_k, experts = model.top_k, model.w_in.shape[0]
    with torch.no_grad():
        gate = torch.softmax(model.gate(x), dim=-1).reshape(-1, experts)
        tokens = x.reshape(-1, x.shape[-1])
        outputs = torch.stack([torch.relu(tokens @ model.w_in[e] + model.b_in[e]) @ model.w_out[e]
                               for e in range(experts)])  # (E, n, H): each expert alone
        expected = tokens.clone()
        for token in range(tokens.shape[0]):
            for expert in gate[token].topk(top_k).indices.tolist():
                expected[token] += gate[token, expert] * outputs[expert, token]
        got = model.mixture(x).reshape(tokens.shape)
    assert 1 <= top_k < experts
    assert torch.allclose(got, expected, rtol=EXACT, atol=EXACT)


# a CPU-like device for the plans (fixed: no measuring of this machine in a test)
TEST_DEVICE = DeviceSpec(name="test cpu", peak_flops_per_s=(("float32", 5e10), ("float64", 2.5e10)),
                         memory_bytes=8e9, memory_bandwidth_bytes_per_s=2e10, matmul_efficiency=1.0,
                         memory_efficiency=1.0, kernel_overhead_s=5e-6)
COLUMNS = ("busy", "nprocs", "model", "plan", "kind", "runner", "mesh", "predicted_ms", "measured_ms", "min_ms",
           "max_ms", "error_pct", "rounds", "losses_agree", "refused", "detail", "breakdown")


def test_zoo_models_trace_and_the_auto_plan_is_no_slower_than_the_plans_inside_its_search():
    """Each model traces to its heavy ops and a scalar loss; of its planned sides, the
    auto plan's predicted time is at most the data-parallel and single-strategy ones'
    (restrictions of the same ILP on the (p,) mesh, one of the meshes auto searches)."""
    expected_heavy = {"wide_mlp": {"linear": 4}, "moe": {"linear": 1, "matmul": 2},
                      "mixer": {"linear": 6}}  # mixer: the embedding, 4 in its one block, the head
    cluster = cluster_preset("local", nprocs=2, device=TEST_DEVICE, local_link=PLACEHOLDER_LOCAL_LINK,
                             call_overhead_s=0.0)
    for name in ZOO:
        model, inputs = build(name, dtype=torch.float64, **TINY[name])
        traced = trace_graph(model, inputs)
        graph = traced.graph
        kinds = [node.kind for node in graph.nodes]
        heavy = {kind: kinds.count(kind) for kind in ("linear", "matmul", "conv") if kind in kinds}
        assert heavy == expected_heavy[name], (name, heavy)
        loss = graph.node(graph.node(graph.output).inputs[0])
        assert loss.kind == "loss" and loss.shape == (), (name, loss)
        assert {param.name for param in graph.params} == {name for name, _ in model.named_parameters()}, name
        sides = {side.plan: side for side in plan_sides(name, model, inputs, cluster, traced=traced)}
        assert set(sides) == {AUTO, DATA_PARALLEL, SINGLE, KNOB}, (name, sides)
        for other in (DATA_PARALLEL, SINGLE):
            # the ILP's optimum against a restriction of it: equal at best (HiGHS' relative gap 1e-4)
            assert sides[AUTO].predicted_s <= sides[other].predicted_s * (1 + 1e-4), (name, other, sides)
        assert all(side.predicted_s > 0 for side in sides.values())
        assert sides[KNOB].runner == RUN_DP and sides[AUTO].runner == RUN_AUTO


def _bench(rank, world_size, job):
    return run_auto_bench(job)


@pytest.mark.slow
def test_the_bench_runs_every_plan_of_every_model_and_reports_every_column():
    config = AutoBenchConfig(size="tiny", dtype="float64", nprocs=(2,), rounds=1, warmup=0, steps=1)
    job = plan_world(config, 2, PLACEHOLDER_LOCAL_LINK, call_overhead_s=0.0, link_source="test", emit=lambda _: None,
                     device=TEST_DEVICE)
    for name in config.models:
        kinds = [side.plan for side in job.sides if side.model == name]
        assert kinds[:3] == [AUTO, DATA_PARALLEL, SINGLE] and KNOB in kinds, (name, kinds)
    rows = run_distributed(_bench, 2, job, timeout_s=240)[0]
    table = summarize(job, rows, busy=False)
    assert len(table) == len(job.sides)
    for row in table:
        assert set(COLUMNS) <= set(row), row
        assert row["predicted_ms"] > 0, row
        assert row["refused"] is None, row
        if row["runner"] is not None:
            assert row["rounds"] == config.rounds and 0 < row["min_ms"] <= row["measured_ms"] <= row["max_ms"], row
            assert row["error_pct"] == pytest.approx((row["predicted_ms"] / row["measured_ms"] - 1) * 100)
        # every side starts from the same weights and batch: float64 losses equal to round-off
        assert row["losses_agree"], row
    for name in config.models:
        losses = [row["first_loss"] for row in rows if row["model"] == name]
        assert max(losses) - min(losses) <= 1e-12 * max(losses), (name, losses)
    text = "\n".join(table_lines(table))
    assert all(row["plan"] in text for row in table)


def test_bad_flags_are_refused_by_name_before_any_process_starts(capsys):
    assert main(["bench", "auto", "--nprocs", "1,2", "--models", "wide_mlp,resnet", "--rounds", "0"]) == 2
    error = capsys.readouterr().err
    assert "--nprocs 1,2" in error and "'resnet'" in error and "moe" in error and "--rounds 0" in error
