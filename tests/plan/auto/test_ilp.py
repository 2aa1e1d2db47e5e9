"""The intra-operator ILP against exhaustive search, its memory limit, tied parameters
and its errors.

Both solve() and exhaustive() recompute the cost of the combination they chose with
the same float64 sums (plan_objective), so an equal (or equally priced) combination
agrees to rounding: 1e-12 relative. HiGHS proves its optimum to mip_rel_gap = 0 and an
absolute 1e-6 of the largest cost coefficient; random costs leave no two combinations
that close.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from plait.cost import LinkModel
from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.opgraph import OpGraph, OpNode, ParamMeta
from plait.parallel.auto.trace import simplify, trace_graph
from plait.plan import device_preset
from plait.plan.auto import ilp
from plait.plan.auto.reshard_cost import reshard_time_s
from plait.plan.auto.strategies import graph_strategies
from plait.plan.auto.strategy import Strategy
from plait.plan.cluster import Cluster
from plait.plan.device_spec import DeviceSpec

SHAPE = (8, 16)
F64 = 8


def _cluster(devices: int) -> Cluster:
    link = LinkModel(1e-5, 1e-9)
    return Cluster(name="test", nodes=1, devices_per_node=devices, device=device_preset("a100-80gb"),
                   intra_link=link, inter_link=link)


def _node(name, inputs=(), params=(), kind="elementwise"):
    return OpNode(name=name, kind=kind, target="aten.test", inputs=tuple(inputs), params=tuple(params), shape=SHAPE,
                  dtype="float64", itemsize=F64)


def _graph(nodes, params=()):
    return OpGraph(nodes=tuple(nodes), params=tuple(ParamMeta(p, SHAPE, "float64", F64) for p in params),
                   inputs=(nodes[0].name,), output=nodes[-1].name)


def _random_case(seed: int, shape: str, mesh: AutoMesh):
    """A chain or a run of diamonds (a -> b, a -> c, b + c -> d) of <= 8 operators, each
    with 1-4 strategies of random layouts and costs (the first all-replicated, so a
    plan always exists); two operators read one tied parameter."""
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(rng.randint(6, 8) if shape == "chain" else 7)]
    if shape == "chain":
        inputs = [()] + [(names[i - 1],) for i in range(1, len(names))]
    else:  # n0 -> n1, n2 -> n3 -> n4, n5 -> n6
        inputs = [(), ("n0",), ("n0",), ("n1", "n2"), ("n3",), ("n3",), ("n4", "n5")]
    tied = rng.sample(range(1, len(names)), 2)
    params = [("w",) if i in tied else (f"p{i}",) if rng.random() < 0.4 else () for i in range(len(names))]
    # views and permutes hold no memory: the solver eliminates those with one input and one consumer
    weightless = [not params[i] and rng.random() < 0.5 for i in range(len(names))]
    nodes = [_node(name, ins, ps) for name, ins, ps in zip(names, inputs, params)]
    placements = ["R", "S0", "S1", "P"]
    replicated = ("R",) * mesh.ndim

    def layout(allow_partial=True):
        return tuple(rng.choice(placements if allow_partial else placements[:3]) for _ in range(mesh.ndim))

    strategies = {}
    for node, light in zip(nodes, weightless):
        options = [Strategy("replicated", replicated, (replicated,) * len(node.inputs),
                            tuple((p, replicated) for p in node.params), rng.uniform(4e-5, 1.5e-4), 0.0,
                            0 if light else rng.randint(1_000_000, 4_000_000))]
        for k in range(rng.randint(0, 3)):
            options.append(Strategy(f"s{k}", layout(), tuple(layout(False) for _ in node.inputs),
                                    tuple((p, layout(False)) for p in node.params), rng.uniform(0, 6e-5),
                                    rng.uniform(0, 3e-5), 0 if light else rng.randint(200_000, 2_000_000)))
        strategies[node.name] = options
    return _graph(nodes, sorted({p for ps in params for p in ps})), strategies


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("shape", ["chain", "diamond"])
def test_the_ilp_finds_the_exhaustive_optimum_on_small_graphs(shape, mesh_shape):
    mesh = AutoMesh(mesh_shape)
    cluster = _cluster(mesh.size)
    resharded = bound = eliminated = 0
    for seed in range(6):
        graph, strategies = _random_case(seed, shape, mesh)
        best = ilp.exhaustive(graph, strategies, mesh, cluster)
        found = ilp.solve(graph, strategies, mesh, cluster, mip_rel_gap=0.0)
        assert found.objective_s == pytest.approx(best.objective_s, rel=1e-12), (seed, found.choice, best.choice)
        assert found.status == "optimal" and found.gap <= 1e-6
        resharded += found.reshard_s > 0
        eliminated += found.eliminated
        # a memory limit between the smallest and the unconstrained plan's memory binds
        limit = 0.5 * (best.memory_bytes + _smallest_memory(graph, strategies, mesh, cluster))
        unlimited, best = best, ilp.exhaustive(graph, strategies, mesh, cluster, memory_limit_bytes=limit)
        bound += best.choice != unlimited.choice
        found = ilp.solve(graph, strategies, mesh, cluster, memory_limit_bytes=limit, mip_rel_gap=0.0)
        assert found.objective_s == pytest.approx(best.objective_s, rel=1e-12), (seed, "memory")
        assert found.memory_bytes <= limit * (1 + 1e-9)
        # the objective is the strategies' costs plus every edge's reshard, priced again here
        again = sum(found.choice[n.name].compute_s + found.choice[n.name].comm_s for n in graph.nodes) + sum(
            reshard_time_s(found.choice[u].output, found.choice[v].inputs[k], SHAPE, F64, mesh, cluster)
            for u, v, k in graph.edges())
        assert found.objective_s == pytest.approx(again, rel=1e-12)
    assert resharded >= 3 and bound >= 3 and eliminated >= 3  # the cases exercise edges, the limit, elimination


def _smallest_memory(graph, strategies, mesh, cluster) -> float:
    """The least memory of any connectable plan: exhaustive's error names it."""
    with pytest.raises(ValueError, match="below the smallest plan's") as error:
        ilp.exhaustive(graph, strategies, mesh, cluster, memory_limit_bytes=1.0)
    return float(error.value.args[0].split("GiB (")[2].split(" bytes")[0].replace(",", ""))


def test_tied_parameters_take_one_layout_in_every_reader():
    """Alone, a would shard wte on dim 0 and b on dim 1 (each 1 us cheaper than the
    other): tied, both take one layout, and that costs more than the untied optimum.
    The batch x arrives sharded and a wants it whole: a constant all_gather, which
    the solver's bound must include (a proven optimum has no gap)."""
    mesh, cluster = AutoMesh((4,)), _cluster(4)
    graph = _graph([_node("x", kind="input"), _node("a", ["x"], ["wte"], "embedding"),
                    _node("b", ["a"], ["wte"], "linear")], params=["wte"])
    r, s0, s1 = ("R",), ("S0",), ("S1",)
    strategies = {
        "x": [Strategy("batch", s0, (), (), 0.0, 0.0, 0.0)],
        "a": [Strategy("row", r, (r,), (("wte", s0),), 1e-6, 0.0, 1.0),
              Strategy("col", r, (r,), (("wte", s1),), 2e-6, 0.0, 1.0)],
        "b": [Strategy("row", r, (r,), (("wte", s0),), 2e-6, 0.0, 1.0),
              Strategy("col", r, (r,), (("wte", s1),), 1e-6, 0.0, 1.0)],
    }
    found = ilp.solve(graph, strategies, mesh, cluster, mip_rel_gap=0.0)
    gather_s = reshard_time_s(s0, r, SHAPE, F64, mesh, cluster)
    assert found.choice["a"].param_layout("wte") == found.choice["b"].param_layout("wte")
    assert found.objective_s == pytest.approx(3e-6 + gather_s, rel=1e-12)
    assert found.bound_s == pytest.approx(found.objective_s, rel=1e-9) and found.gap < 1e-9
    assert ilp.exhaustive(graph, strategies, mesh, cluster).objective_s == pytest.approx(3e-6 + gather_s, rel=1e-12)


def test_a_memory_limit_forces_the_sharded_plan_and_an_impossible_one_is_refused():
    """The replicated strategy is faster (no gradient all-reduce) but holds 4 MB; the
    sharded one 1 MB plus a 1 KiB reshard on its edge."""
    mesh, cluster = AutoMesh((4,)), _cluster(4)
    graph = _graph([_node("x", kind="input"), _node("w", ["x"], ["p"], "linear")], params=["p"])
    r, s0 = ("R",), ("S0",)
    strategies = {"x": [Strategy("replicated", r, (), (), 0.0, 0.0, 0.0)],
                  "w": [Strategy("replicated", r, (r,), (("p", r),), 4e-6, 0.0, 4e6),
                        Strategy("sharded", s0, (s0,), (("p", s0),), 1e-6, 5e-6, 1e6)]}
    assert ilp.solve(graph, strategies, mesh, cluster).choice["w"].name == "replicated"
    limited = ilp.solve(graph, strategies, mesh, cluster, memory_limit_bytes=2e6)
    assert limited.choice["w"].name == "sharded" and limited.memory_bytes == 1e6
    assert limited.reshard_s == pytest.approx(reshard_time_s(r, s0, SHAPE, F64, mesh, cluster), rel=1e-12)
    assert limited.reshard_s > 0
    message = r"memory limit 0.0004657 GiB \(500,000 bytes\) is below the smallest plan's 0.0009313 GiB " \
              r"\(1,000,000 bytes.*raise --memory-limit-gib or use more devices"
    for search in (ilp.solve, ilp.exhaustive):
        with pytest.raises(ValueError, match=message):
            search(graph, strategies, mesh, cluster, memory_limit_bytes=5e5)


def test_unconnectable_strategies_and_bad_inputs_are_refused_by_name():
    mesh, cluster = AutoMesh((4,)), _cluster(4)
    graph = _graph([_node("x", kind="input"), _node("y", ["x"])])
    r, p = ("R",), ("P",)
    partial_in = {"x": [Strategy("replicated", r, (), (), 0.0, 0.0, 0.0)],
                  "y": [Strategy("wants_partial", r, (p,), (), 0.0, 0.0, 0.0)]}
    with pytest.raises(ValueError, match=r"no combination of the strategies connects: x -> y \(input 0\)"):
        ilp.solve(graph, partial_in, mesh, cluster)
    with pytest.raises(ValueError, match=r"missing \['y'\]"):
        ilp.solve(graph, {"x": partial_in["x"]}, mesh, cluster)
    with pytest.raises(ValueError, match="gives 0 input layouts for the node's 1 inputs"):
        ilp.solve(graph, {"x": partial_in["x"], "y": [Strategy("bad", r, (), (), 0.0, 0.0, 0.0)]}, mesh, cluster)
    with pytest.raises(ValueError, match="above the limit of 1,000,000"):
        many = [Strategy(f"s{i}", r, (r,) * 0, (), float(i), 0.0, 0.0) for i in range(11)]
        wide = _graph([_node(f"n{i}", kind="input") for i in range(6)])
        ilp.exhaustive(wide, {f"n{i}": many for i in range(6)}, mesh, cluster)
    assert math.isinf(reshard_time_s(r, p, SHAPE, F64, mesh, cluster))


class _Mlp(torch.nn.Module):
    """16 -> 64 -> 8 with GELU, its MSE loss inside (the train step)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 8)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.down(torch.nn.functional.gelu(self.up(x))), y)


def test_the_ilp_finds_the_exhaustive_optimum_on_a_traced_model():
    """A traced MLP with B's strategies on (4,) and (2, 2) (216 and 46,656 combinations):
    the ILP's plan costs what the exhaustive one does, unlimited (Megatron's
    column-then-row pair, also the least memory here) and with the memory limit at
    exactly the smallest plan's (the memory row holding at equality)."""
    torch.manual_seed(0)
    inputs = (torch.randn(32, 16, dtype=torch.float64), torch.randn(32, 8, dtype=torch.float64))
    graph = simplify(trace_graph(_Mlp().double(), inputs).graph)
    device = DeviceSpec(name="unit", peak_flops_per_s=(("float64", 1e9),), memory_bytes=1e12,
                        memory_bandwidth_bytes_per_s=1e9, kernel_overhead_s=1e-6)
    for shape in ((4,), (2, 2)):
        mesh = AutoMesh(shape)
        link = LinkModel(1e-6, 1e-9)
        cluster = Cluster(name="test", nodes=1, devices_per_node=mesh.size, device=device, intra_link=link,
                          inter_link=link)
        strategies = graph_strategies(graph, mesh, cluster)
        best = ilp.exhaustive(graph, strategies, mesh, cluster)
        found = ilp.solve(graph, strategies, mesh, cluster, mip_rel_gap=0.0)
        assert found.objective_s == pytest.approx(best.objective_s, rel=1e-12)
        assert [found.choice[n.name].name.split("@")[0] for n in graph.nodes if n.kind == "linear"] == ["column", "row"]
        limit = 0.5 * (best.memory_bytes + _smallest_memory(graph, strategies, mesh, cluster))
        best = ilp.exhaustive(graph, strategies, mesh, cluster, memory_limit_bytes=limit)
        found = ilp.solve(graph, strategies, mesh, cluster, memory_limit_bytes=limit, mip_rel_gap=0.0)
        assert found.objective_s == pytest.approx(best.objective_s, rel=1e-12) and found.memory_bytes <= limit


def test_edges_routed_as_flows_through_the_layout_graph_keep_the_optimum():
    """Operators taking all 16 layouts of a 2-d tensor on a 2x2 mesh (two nodes: axis 0
    slow): the edges are routed as flows over single-axis steps, fewer variables than
    one per (output, input) layout pair, and the optimum is exhaustive search's."""
    mesh = AutoMesh((2, 2))
    cluster = Cluster(name="test", nodes=2, devices_per_node=2, device=device_preset("a100-80gb"),
                      intra_link=LinkModel(1e-6, 1e-10), inter_link=LinkModel(1e-5, 1e-9))
    layouts = [(a, b) for a in ("R", "S0", "S1", "P") for b in ("R", "S0", "S1", "P")]
    graph = _graph([_node("x", kind="input"), _node("a", ["x"]), _node("b", ["a"]), _node("c", ["b"])])
    for seed in range(3):
        rng = random.Random(seed)
        strategies = {node.name: [Strategy(f"s{k}", out, tuple(rng.choice([m for m in layouts if "P" not in m])
                                                               for _ in node.inputs), (),
                                           rng.uniform(0, 2e-5), 0.0, rng.randint(1, 10) * 1000)
                                  for k, out in enumerate(layouts)] for node in graph.nodes}
        pairs = sum(math.isfinite(reshard_time_s(out, want, SHAPE, F64, mesh, cluster))
                    for u, v, k in graph.edges() for out in {o.output for o in strategies[u]}
                    for want in {o.inputs[k] for o in strategies[v]})
        for limit in (None, 20_000):
            best = ilp.exhaustive(graph, strategies, mesh, cluster, memory_limit_bytes=limit)
            found = ilp.solve(graph, strategies, mesh, cluster, memory_limit_bytes=limit, mip_rel_gap=0.0)
            assert found.objective_s == pytest.approx(best.objective_s, rel=1e-12), (seed, limit)
            assert found.variables < 4 * len(layouts) + pairs
