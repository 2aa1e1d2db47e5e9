"""Strategy enumeration per operator kind (plait.plan.auto.strategies): the layouts each
kind may take on meshes (4,), (3,) and (2, 2) against hand lists, no non-dividing dim
ever sharded, no P output where it would be wrong, parameter operands and fused parts,
the costs of batch / column / row linears and of a parameter matmul against hand
formulas from the Cluster's collectives and the DeviceSpec's time, and a traced model
whose every node is priced, its products' FLOPs equal to the tracer's (floats compared
at 1e-12 relative: the same products summed in another order)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.cost import LinkModel
from plait.names.placements import local_shape
from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.opgraph import OpGraph, OpNode, ParamMeta
from plait.parallel.auto.trace import simplify, trace_graph
from plait.plan.auto.strategies import graph_strategies, grad_nodes, node_strategies
from plait.plan.cluster import Cluster
from plait.plan.device_spec import DeviceSpec
from plait.plan.layers import backward_matmuls

F64 = ("float64", 8)
DEVICE = DeviceSpec(name="unit", peak_flops_per_s=(("float64", 1e9),), memory_bytes=1e12,
                    memory_bandwidth_bytes_per_s=1e9, kernel_overhead_s=1e-6)
# a calibrated device: matmuls priced by eta(m, n, k), so the local shapes matter, not only the FLOPs
CALIBRATED = DeviceSpec(name="fit", peak_flops_per_s=(("float64", 1e9),), memory_bytes=1e12,
                        memory_bandwidth_bytes_per_s=1e9, kernel_overhead_s=1e-6, matmul_fit=(0.9, 3.0, 5.0, 7.0))
# two nodes of two: mesh axis 0 (stride 2) crosses nodes on the slow link, axis 1 stays inside
FAST, SLOW = LinkModel(1e-6, 1e-10), LinkModel(1e-4, 1e-8)


def _cluster(device=DEVICE, nodes=2, per_node=2) -> Cluster:
    return Cluster(name="unit", nodes=nodes, devices_per_node=per_node, device=device, intra_link=FAST,
                   inter_link=SLOW)


def _node(name, kind, inputs, shape, params=(), attrs=(), dtype=F64, target=None):
    return OpNode(name, kind, target or f"aten.{kind}.default", tuple(inputs), tuple(params), tuple(shape),
                  dtype[0], dtype[1], attrs=tuple(attrs))


def _graph(nodes, params=(), inputs=None) -> OpGraph:
    nodes = list(nodes)
    nodes.append(_node("out", "output", (nodes[-1].name,), nodes[-1].shape))
    return OpGraph(tuple(nodes), tuple(ParamMeta(n, tuple(s), "float64", 8) for n, s in params),
                   tuple(inputs or [n.name for n in nodes if n.kind == "input"]), "out")


def _layouts(graph, name, mesh_shape, cluster=None):
    """{strategy name: (output, inputs, params)} of node ``name``."""
    strategies = node_strategies(graph.node(name), graph, AutoMesh(mesh_shape), cluster or _cluster())
    assert strategies[0].name == "replicated" and set(strategies[0].output) == {"R"}
    assert len({s.name for s in strategies}) == len(strategies)
    return {s.name: (s.output, s.inputs, s.params) for s in strategies}


def _linear_graph(x_shape=(4, 6, 8), out_features=16, upstream=False):
    """x -> [linear0 ->] fc; with ``upstream`` fc's input carries a gradient."""
    nodes = [_node("x", "input", (), x_shape)]
    params = [("fc.weight", (out_features, x_shape[-1])), ("fc.bias", (out_features,))]
    source = "x"
    if upstream:
        params += [("up.weight", (x_shape[-1], x_shape[-1]))]
        nodes.append(_node("up", "linear", ("x",), x_shape, ("up.weight",)))
        source = "up"
    nodes.append(_node("fc", "linear", (source,), x_shape[:-1] + (out_features,), ("fc.weight", "fc.bias")))
    return _graph(nodes, params)


def test_linear_layouts_on_4_and_3():
    graph = _linear_graph()  # x (4, 6, 8), W (16, 8): 6 does not divide by 4
    w, b = "fc.weight", "fc.bias"
    assert _layouts(graph, "fc", (4,)) == {
        "replicated": (("R",), (("R",),), ((w, ("R",)), (b, ("R",)))),
        "batch@0": (("S0",), (("S0",),), ((w, ("R",)), (b, ("R",)))),
        "column@0": (("S2",), (("R",),), ((w, ("S0",)), (b, ("S0",)))),
        "row@0": (("P",), (("S2",),), ((w, ("S1",)), (b, ("R",))))}
    # (3,): only the sequence dim 6 and the weight's 9 and 12 divide
    graph = _linear_graph((4, 6, 12), 9)
    assert _layouts(graph, "fc", (3,)) == {
        "replicated": (("R",), (("R",),), ((w, ("R",)), (b, ("R",)))),
        "sequence@0": (("S1",), (("S1",),), ((w, ("R",)), (b, ("R",)))),
        "column@0": (("S2",), (("R",),), ((w, ("S0",)), (b, ("S0",)))),
        "row@0": (("P",), (("S2",),), ((w, ("S1",)), (b, ("R",))))}


def test_linear_on_2x2_combines_axes_and_drops_non_dividing_doubles():
    graph = _linear_graph()  # every 1-D option divides by 2; only the sequence dim 6 fails on both axes (4)
    found = _layouts(graph, "fc", (2, 2))
    styles = ["replicated", "batch", "sequence", "column", "row"]
    expected = set()
    for a in styles:
        for b in styles:
            if a == b == "sequence":
                continue
            parts = [f"{s}@{axis}" for axis, s in enumerate((a, b)) if s != "replicated"]
            expected.add(",".join(parts) or "replicated")
    assert set(found) == expected and len(found) == 24
    assert found["batch@0,column@1"] == (("S0", "S2"), (("S0", "R"),),
                                         (("fc.weight", ("R", "S0")), ("fc.bias", ("R", "S0"))))
    assert found["column@0,row@1"] == (("S2", "P"), (("R", "S2"),),
                                       (("fc.weight", ("S0", "S1")), ("fc.bias", ("S0", "R"))))
    assert found["batch@0,batch@1"][0] == ("S0", "S0")


def _cost_case(device):
    graph = _linear_graph(upstream=True)  # fc's x carries a gradient (an upstream linear)
    cluster = _cluster(device)
    by_name = {s.name: s for s in node_strategies(graph.node("fc"), graph, AutoMesh((4,)), cluster)}
    return graph, cluster, by_name


def _linear_time(device, m, n, k):
    forward = (("gemm", 1, m, n, k),)
    return (device.time_s(flops=2 * m * n * k, nbytes=0, kernels=1, dtype="float64", matmuls=forward)
            + device.time_s(flops=4 * m * n * k, nbytes=0, kernels=2, dtype="float64",
                            matmuls=backward_matmuls(forward)))


@pytest.mark.parametrize("device", [DEVICE, CALIBRATED], ids=["flops", "calibrated"])
def test_linear_costs_against_hand_formulas(device):
    graph, cluster, by = _cost_case(device)
    m, n, k, p = 4 * 6, 16, 8, 4  # tokens, out, in; a mesh of 4 over two nodes (stride 1)
    all_reduce = lambda nbytes: cluster.collective_time_s("all_reduce", nbytes, p, 1)[0]  # noqa: E731
    assert by["replicated"].compute_s == pytest.approx(_linear_time(device, m, n, k), rel=1e-12)
    assert by["replicated"].comm_s == 0
    # batch: a quarter of the tokens; the weight's and the bias's gradients all-reduced (data parallelism)
    assert by["batch@0"].compute_s == pytest.approx(_linear_time(device, m // p, n, k), rel=1e-12)
    assert by["batch@0"].comm_s == pytest.approx(all_reduce(n * k * 8) + all_reduce(n * 8), rel=1e-12)
    # column: a quarter of the outputs; x's gradient is partial: all-reduced in backward
    assert by["column@0"].compute_s == pytest.approx(_linear_time(device, m, n // p, k), rel=1e-12)
    assert by["column@0"].comm_s == pytest.approx(all_reduce(m * k * 8), rel=1e-12)
    # row: a quarter of the contraction; no collective inside (the P output is resharded on the edge)
    assert by["row@0"].compute_s == pytest.approx(_linear_time(device, m, n, k // p), rel=1e-12)
    assert by["row@0"].comm_s == 0


def test_linear_memory_column_holds_a_pth_of_the_parameters():
    graph, cluster, by = _cost_case(DEVICE)
    p, x_bytes = 4, 4 * 6 * 8 * 8
    param_elements = 16 * 8 + 16
    per_element = 8 + 8 + 2 * 8  # parameter + gradient + Adam's two states, float64
    assert by["replicated"].memory_bytes == x_bytes + param_elements * per_element
    assert by["column@0"].memory_bytes == x_bytes + param_elements * per_element / p
    assert by["batch@0"].memory_bytes == x_bytes / p + param_elements * per_element
    # row: the weight split, the bias whole, x split on its last dim
    assert by["row@0"].memory_bytes == x_bytes / p + (16 * 8 / p + 16) * per_element
    # SGD without state: only the parameter and its gradient
    sgd = node_strategies(graph.node("fc"), graph, AutoMesh((4,)), cluster, optimizer_state_bytes_per_param=0)
    assert sgd[0].memory_bytes == x_bytes + param_elements * 16


def test_2d_gradient_all_reduces_run_on_their_own_axis():
    graph = _linear_graph(upstream=True)
    cluster = _cluster()
    by = {s.name: s for s in node_strategies(graph.node("fc"), graph, AutoMesh((2, 2)), cluster)}
    slow = lambda nbytes: cluster.collective_time_s("all_reduce", nbytes, 2, 2)[0]  # noqa: E731 axis 0
    fast = lambda nbytes: cluster.collective_time_s("all_reduce", nbytes, 2, 1)[0]  # noqa: E731 axis 1
    # batch on axis 0 (across nodes): W/2 and b/2 all-reduced there; column on axis 1: x/2's gradient
    assert by["batch@0,column@1"].comm_s == pytest.approx(
        slow(16 * 8 * 8 / 2) + slow(16 * 8 / 2) + fast(4 * 6 * 8 * 8 / 2), rel=1e-12)
    assert by["column@0,batch@1"].comm_s == pytest.approx(
        fast(16 * 8 * 8 / 2) + fast(16 * 8 / 2) + slow(4 * 6 * 8 * 8 / 2), rel=1e-12)
    assert slow(1000) > fast(1000)


def test_input_without_gradient_needs_no_all_reduce():
    graph = _linear_graph()  # fc reads the user input: no gradient to all-reduce under column
    strategies = {s.name: s for s in node_strategies(graph.node("fc"), graph, AutoMesh((4,)), _cluster())}
    assert strategies["column@0"].comm_s == 0
    assert grad_nodes(graph) == {"fc", "out"}


def _kind_graph():
    """One graph with a node of every kind, on shapes chosen so 4 and 3 divide some dims."""
    B, S, E, V = 4, 12, 12, 9
    nodes = [
        _node("ids", "input", (), (B, S), dtype=("int64", 8)),
        _node("pos", "constant", (), (S, E)),
        _node("emb", "embedding", ("ids",), (B, S, E), ("emb.weight",)),
        _node("addpos", "elementwise", ("emb", "pos"), (B, S, E), target="aten.add.Tensor"),
        _node("ln", "norm", ("addpos",), (B, S, E), ("ln.weight", "ln.bias"), attrs=(("normalized_ndim", 1),)),
        _node("qkv", "view", ("ln",), (B, S, 2, E // 2), attrs=()),  # (4,12,12) -> (4,12,2,6)
        _node("q", "permute", ("qkv",), (B, 2, S, E // 2), attrs=(("perm", (0, 2, 1, 3)),)),
        _node("kt", "permute", ("q",), (B, 2, E // 2, S), attrs=(("perm", (0, 1, 3, 2)),)),
        _node("scores", "matmul", ("q", "kt"), (B, 2, S, S)),
        _node("probs", "softmax", ("scores",), (B, 2, S, S), attrs=(("dim", 3),)),
        _node("attn", "attention", ("q", "q", "q"), (B, 2, S, E // 2)),
        _node("total", "reduce", ("probs",), (B, S), attrs=(("dims", (1, 3)), ("keepdim", False))),
        _node("logits", "linear", ("ln",), (B, S, V), ("head.weight",)),
        _node("flat", "view", ("logits",), (B * S, V)),
        _node("labels", "input", (), (B * S,), dtype=("int64", 8)),
        _node("loss", "loss", ("flat", "labels"), (),
              attrs=(("op", "cross_entropy"), ("class_dim", 1), ("reduction", "mean"))),
    ]
    params = [("emb.weight", (V, E)), ("ln.weight", (E,)), ("ln.bias", (E,)), ("head.weight", (V, E))]
    return _graph(nodes, params, inputs=["ids", "labels"])


def test_layouts_per_kind_on_4():
    g = _kind_graph()

    def short(name):  # {strategy: (output, inputs)} on (4,)
        return {k: (v[0][0], tuple(i[0] for i in v[1]), tuple(p[1][0] for p in v[2]))
                for k, v in _layouts(g, name, (4,)).items()}

    assert short("ids") == {"replicated": ("R", (), ()), "batch@0": ("S0", (), ()), "sequence@0": ("S1", (), ())}
    assert short("pos") == {"replicated": ("R", (), ())}
    # embedding: table (9, 12): 9 rows do not divide by 4, so no vocab split
    assert short("emb") == {"replicated": ("R", ("R",), ("R",)), "batch@0": ("S0", ("S0",), ("R",)),
                            "sequence@0": ("S1", ("S1",), ("R",)), "column@0": ("S2", ("R",), ("S1",))}
    # elementwise with a broadcast (S, E) constant: S0 of the output leaves it R, S1/S2 shard it
    assert short("addpos") == {"replicated": ("R", ("R", "R"), ()), "S0@0": ("S0", ("S0", "R"), ()),
                               "S1@0": ("S1", ("S1", "S0"), ()), "S2@0": ("S2", ("S2", "S1"), ())}
    # norm over the last dim: batch and sequence follow, parameters replicated
    assert short("ln") == {"replicated": ("R", ("R",), ("R", "R")), "S0@0": ("S0", ("S0",), ("R", "R")),
                           "S1@0": ("S1", ("S1",), ("R", "R"))}
    # view (4,12,12) -> (4,12,2,6): dims 0 and 1 carry, the split dim 12 -> (2, 6) leads with 12/2 not /4
    assert short("qkv") == {"replicated": ("R", ("R",), ()), "S0@0": ("S0", ("S0",), ()),
                            "S1@0": ("S1", ("S1",), ())}
    assert short("q") == {"replicated": ("R", ("R",), ()), "S0@0": ("S0", ("S0",), ()),
                          "S1@0": ("S2", ("S1",), ())}
    # matmul (4, 2, 12, 6) @ (4, 2, 6, 12): batch dim 0 (dim 1, 2 heads, does not divide), m and n (12);
    # not k (6)
    assert short("scores") == {"replicated": ("R", ("R", "R"), ()), "batch0@0": ("S0", ("S0", "S0"), ()),
                               "m@0": ("S2", ("S2", "R"), ()), "n@0": ("S3", ("R", "S3"), ())}
    assert short("probs") == {"replicated": ("R", ("R",), ()), "S0@0": ("S0", ("S0",), ()),
                              "S2@0": ("S2", ("S2",), ())}
    assert short("attn") == {"replicated": ("R", ("R", "R", "R"), ()),
                             "batch@0": ("S0", ("S0", "S0", "S0"), ())}
    # reduce over (1, 3): the kept dim 0 follows, the reduced dim 3 (12) gives P; dim 2 (12) kept -> out dim 1
    assert short("total") == {"replicated": ("R", ("R",), ()), "S0@0": ("S0", ("S0",), ()),
                              "S2@0": ("S1", ("S2",), ()), "S3@0": ("P", ("S3",), ())}
    assert short("logits") == {"replicated": ("R", ("R",), ("R",)), "batch@0": ("S0", ("S0",), ("R",)),
                               "sequence@0": ("S1", ("S1",), ("R",)), "row@0": ("P", ("S2",), ("S1",))}
    assert short("flat") == {"replicated": ("R", ("R",), ()), "S0@0": ("S0", ("S0",), ())}
    assert short("loss") == {"replicated": ("R", ("R", "R"), ()), "batch@0": ("P", ("S0", "S0"), ())}
    assert short("out") == {"replicated": ("R", ("R",), ())}


def test_layouts_per_kind_on_3():
    g = _kind_graph()
    names = {name: set(_layouts(g, name, (3,))) for name in
             ("ids", "emb", "addpos", "ln", "qkv", "q", "scores", "attn", "total", "logits", "flat", "loss")}
    assert names == {
        "ids": {"replicated", "sequence@0"},
        "emb": {"replicated", "sequence@0", "column@0", "vocab@0"},  # vocab 9 rows now divide
        "addpos": {"replicated", "S1@0", "S2@0"},
        "ln": {"replicated", "S1@0"},
        "qkv": {"replicated", "S1@0"},  # 12 -> (2, 6): the leading 2 does not divide by 3
        "q": {"replicated", "S1@0", "S3@0"},
        "scores": {"replicated", "m@0", "n@0", "k@0"},  # (4,2,12,6) @ (4,2,6,12)^: 12, 12 and 6 divide
        "attn": {"replicated"},
        "total": {"replicated", "S2@0", "S3@0"},
        "logits": {"replicated", "sequence@0", "column@0", "row@0"},
        "flat": {"replicated", "S2@0"},  # (4, 12, 9) -> (48, 9): the group leads with 4
        "loss": {"replicated", "batch@0"}}
    emb = _layouts(g, "emb", (3,))
    assert emb["vocab@0"] == (("P",), (("R",),), (("emb.weight", ("S0",)),))
    # a mean cross-entropy split over the batch all-reduces its target count (8 bytes): the only comm
    cluster = _cluster()
    loss = {s.name: s for s in node_strategies(g.node("loss"), g, AutoMesh((3,)), cluster)}
    assert loss["batch@0"].comm_s == cluster.collective_time_s("all_reduce", 8, 3, 1)[0] > 0
    assert loss["replicated"].comm_s == 0


def test_layouts_per_kind_on_2x2_and_nothing_non_dividing_sharded():
    g = _kind_graph()
    by_mesh = {shape: graph_strategies(g, AutoMesh(shape), _cluster()) for shape in ((4,), (3,), (2, 2))}
    for shape, table in by_mesh.items():
        for name, strategies in table.items():
            node = g.node(name)
            for s in strategies:  # every layout is one the ranks can hold (local_shape raises otherwise)
                local_shape(node.shape, s.output, shape)
                for source, layout in zip(node.inputs, s.inputs):
                    local_shape(g.node(source).shape, layout, shape)
                for param, layout in s.params:
                    local_shape(g.param(param).shape, layout, shape)
    two = {s.name: s for s in by_mesh[(2, 2)]["attn"]}
    assert set(two) == {"replicated", "batch@0", "heads@0", "batch@1", "heads@1", "batch@0,batch@1",
                        "batch@0,heads@1", "heads@0,batch@1"}  # heads 2 does not split over 4
    assert two["heads@0,batch@1"].output == ("S1", "S0")
    logits = {s.name for s in by_mesh[(2, 2)]["logits"]}
    assert "batch@0,row@1" in logits and "sequence@0,sequence@1" in logits and "column@0" not in logits


def test_conv_layouts():
    nodes = [_node("img", "input", (), (4, 6, 5, 5)),
             _node("conv", "conv", ("img",), (4, 8, 3, 3), ("c.weight", "c.bias"), attrs=(("groups", 1),))]
    g = _graph(nodes, [("c.weight", (8, 6, 3, 3)), ("c.bias", (8,))])
    found = _layouts(g, "conv", (2,), _cluster(nodes=1))
    assert found == {
        "replicated": (("R",), (("R",),), (("c.weight", ("R",)), ("c.bias", ("R",)))),
        "batch@0": (("S0",), (("S0",),), (("c.weight", ("R",)), ("c.bias", ("R",)))),
        "out@0": (("S1",), (("R",),), (("c.weight", ("S0",)), ("c.bias", ("S0",)))),
        "in@0": (("P",), (("S1",),), (("c.weight", ("S1",)), ("c.bias", ("R",))))}
    assert set(_layouts(g, "conv", (4,))) == {"replicated", "batch@0", "out@0"}  # 6 in-channels: not by 4
    assert set(_layouts(g, "conv", (3,))) == {"replicated", "in@0"}
    # the implicit gemm: batch halves m = N*Ho*Wo
    strategies = {s.name: s for s in node_strategies(g.node("conv"), g, AutoMesh((2,)), _cluster(nodes=1))}
    m, n, k = 4 * 3 * 3, 8, 6 * 9
    assert strategies["batch@0"].compute_s == pytest.approx(_linear_time(DEVICE, m // 2, n, k), rel=1e-12)


def test_refusals_name_the_problem():
    g = _linear_graph()
    with pytest.raises(ValueError, match="cluster 'unit' has 4"):
        node_strategies(g.node("fc"), g, AutoMesh((4, 2)), _cluster())
    with pytest.raises(ValueError, match="optimizer_state_bytes_per_param"):
        node_strategies(g.node("fc"), g, AutoMesh((4,)), _cluster(), optimizer_state_bytes_per_param=-1)
    nodes = [_node("x", "input", (), (4, 6)), _node("t", "permute", ("x",), (6, 4))]
    with pytest.raises(ValueError, match="permute.*perm"):
        node_strategies(nodes[1], _graph(nodes), AutoMesh((2,)), _cluster())
    assert math.isfinite(node_strategies(g.node("fc"), g, AutoMesh((1,)), _cluster())[0].compute_s)
    single = DeviceSpec(name="fp32 only", peak_flops_per_s=(("float32", 1e9),), memory_bytes=1e12,
                        memory_bandwidth_bytes_per_s=1e9, kernel_overhead_s=1e-6)
    with pytest.raises(ValueError, match="node 'fc' computes in float64.*pass dtype="):
        node_strategies(g.node("fc"), g, AutoMesh((4,)), _cluster(single))
    as_fp32 = node_strategies(g.node("fc"), g, AutoMesh((4,)), _cluster(single), dtype="float32")
    assert as_fp32[0].compute_s == pytest.approx(_linear_time(DEVICE, 24, 16, 8), rel=1e-12)  # same peak, as if fp32


def test_no_partial_output_through_a_non_linear_chain_or_a_max():
    # a linear with a merged gelu (A's simplify: partial_ok False) may not output P: no row
    nodes = [_node("x", "input", (), (4, 8)),
             _node("fc", "linear", ("x",), (4, 8), ("w",), attrs=(("partial_ok", False),)),
             _node("top", "reduce", ("fc",), (4,), attrs=(("op", "amax"), ("dims", (1,)))),
             _node("total", "reduce", ("fc",), (4,), attrs=(("op", "sum"), ("dims", (1,))))]
    g = _graph(nodes, [("w", (8, 8))])
    assert set(_layouts(g, "fc", (2,))) == {"replicated", "batch@0", "column@0"}
    assert set(_layouts(g, "top", (2,))) == {"replicated", "S0@0"}  # a max over a split dim is no sum
    assert _layouts(g, "total", (2,))["S1@0"][0] == ("P",)


def test_matmul_with_a_parameter_operand_read_through_a_transpose():
    # experts: x (E=4, T=6, H=8) @ w.transpose(1, 2), w stored (E, F=12, H): operand (E, H, F), dims (0, 2, 1)
    nodes = [_node("x", "input", (), (4, 6, 8)), _node("h", "elementwise", ("x",), (4, 6, 8), ("scale",)),
             _node("bmm", "matmul", ("h",), (4, 6, 12), ("w",),
                   attrs=(("param_side", 1), ("param_operands", (("w", (4, 8, 12), (0, 2, 1), ()),))))]
    g = _graph(nodes, [("scale", (8,)), ("w", (4, 12, 8))])
    found = _layouts(g, "bmm", (2,))
    assert found == {"replicated": (("R",), (("R",),), (("w", ("R",)),)),
                     "batch0@0": (("S0",), (("S0",),), (("w", ("S0",)),)),
                     "m@0": (("S1",), (("S1",),), (("w", ("R",)),)),
                     "n@0": (("S2",), (("R",),), (("w", ("S1",)),)),  # the operand's F is the parameter's dim 1
                     "k@0": (("P",), (("S2",),), (("w", ("S2",)),))}
    cluster = _cluster()
    by = {s.name: s for s in node_strategies(g.node("bmm"), g, AutoMesh((2,)), cluster)}
    bmm = (("bmm", 4, 6, 6, 8),)  # n: each rank multiplies (6, 8) by (8, 6) for the 4 experts
    hand = (DEVICE.time_s(flops=2 * 4 * 6 * 6 * 8, nbytes=0, kernels=1, dtype="float64", matmuls=bmm)
            + DEVICE.time_s(flops=4 * 4 * 6 * 6 * 8, nbytes=0, kernels=2, dtype="float64",
                            matmuls=backward_matmuls(bmm)))
    assert by["n@0"].compute_s == pytest.approx(hand, rel=1e-12)
    all_reduce = lambda nbytes: cluster.collective_time_s("all_reduce", nbytes, 2, 1)[0]  # noqa: E731
    assert by["n@0"].comm_s == pytest.approx(all_reduce(4 * 6 * 8 * 8), rel=1e-12)  # h's gradient is partial
    assert by["m@0"].comm_s == pytest.approx(all_reduce(4 * 12 * 8 * 8), rel=1e-12)  # w's gradient is partial
    assert by["batch0@0"].comm_s == 0 and by["k@0"].comm_s == 0


def _fused_graph(starts=(0, 8, 16), extra_reader=False):
    nodes = [_node("x", "input", (), (4, 6, 8)), _node("qkv", "linear", ("x",), (4, 6, 24), ("w",))]
    for i, start in enumerate(starts):
        attrs = (("op", "slice"), ("sliced_dims", (2,)), ("dim_groups", (((0,), (0,)), ((1,), (1,)), ((2,), (2,)))),
                 ("start", start), ("end", start + 8), ("step", 1))
        nodes.append(_node(f"part{i}", "view", ("qkv",), (4, 6, 8), attrs=attrs))
    if extra_reader:
        nodes.append(_node("act", "elementwise", ("qkv",), (4, 6, 24)))
    nodes.append(_node("sum", "elementwise", tuple(f"part{i}" for i in range(len(starts))), (4, 6, 8)))
    return _graph(nodes, [("w", (24, 8))])


def test_fused_parts_of_a_linear_keep_its_column_shard():
    g = _fused_graph()
    assert _layouts(g, "part1", (4,)) == {"replicated": (("R",), (("R",),), ()), "S0@0": (("S0",), (("S0",),), ()),
                                          "fused@0": (("S2",), (("S2",),), ())}
    assert "fused@0,fused@1" in _layouts(g, "part0", (2, 2))
    assert "fused@0" not in _layouts(g, "part0", (3,))  # 8 per part does not divide by 3
    for broken in (_fused_graph(starts=(0, 8, 8)), _fused_graph(extra_reader=True), _fused_graph(starts=(0, 8))):
        assert "fused@0" not in _layouts(broken, "part0", (4,))


class _Block(nn.Module):
    """ids -> embedding -> layer norm -> qkv linear -> heads -> sdpa -> linear -> conv1d over
    the sequence -> mean -> cross-entropy: every product kind the tracer gives."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8, dtype=torch.float64)
        self.ln = nn.LayerNorm(8, dtype=torch.float64)
        self.qkv = nn.Linear(8, 24, dtype=torch.float64)
        self.proj = nn.Linear(8, 8, dtype=torch.float64)
        self.conv = nn.Conv1d(8, 4, 3, padding=1, dtype=torch.float64)

    def forward(self, ids, y):
        h = self.ln(self.emb(ids))
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 8)
        logits = self.conv(torch.softmax(self.proj(a), dim=-1).transpose(1, 2)).mean(dim=2)
        return F.cross_entropy(logits, y)


def test_traced_model_every_node_priced_and_products_match_the_tracer_flops():
    torch.manual_seed(0)
    graph = simplify(trace_graph(_Block(), (torch.randint(0, 16, (4, 6)), torch.randint(0, 4, (4,)))).graph)
    # a pure FLOP counter: 1 FLOP/s at full efficiency, free kernels and bytes
    counter = DeviceSpec(name="flops", peak_flops_per_s=(("float64", 1.0),), memory_bytes=1e30,
                         memory_bandwidth_bytes_per_s=1e30, matmul_efficiency=1.0, memory_efficiency=1.0,
                         kernel_overhead_s=0.0)
    products = 0
    for mesh_shape in ((4,), (2, 2)):
        table = graph_strategies(graph, AutoMesh(mesh_shape), _cluster(counter))
        for node in graph.nodes:
            strategies = table[node.name]
            assert strategies[0].name == "replicated", node.name
            for s in strategies:
                local_shape(node.shape, s.output, mesh_shape)
                for source, layout in zip(node.inputs, s.inputs):
                    local_shape(graph.node(source).shape, layout, mesh_shape)
            if node.kind in ("linear", "matmul", "attention", "conv"):
                products += 1  # forward + backward = 3x the tracer's forward FLOPs, replicated
                assert strategies[0].compute_s == pytest.approx(3 * node.flops, rel=1e-12), node.name
    kinds = {node.kind for node in graph.nodes}
    assert {"embedding", "norm", "linear", "attention", "conv", "softmax", "reduce", "loss"} <= kinds
    assert products == 2 * 4  # qkv, proj, sdpa, conv on each mesh
    names = {s.name for s in graph_strategies(graph, AutoMesh((2,)), _cluster())[
        next(n.name for n in graph.nodes if n.kind == "attention")]}
    assert names == {"replicated", "batch@0", "heads@0"}


def test_a_merged_chain_adds_its_kernels_bytes_and_saved_outputs():
    plain = _linear_graph()
    chain = _graph([_node("x", "input", (), (4, 6, 8)),
                    _node("fc", "linear", ("x",), (4, 6, 16), ("fc.weight", "fc.bias"),
                          attrs=(("merged_ops", ("gelu", "dropout")), ("partial_ok", False)))],
                   [("fc.weight", (16, 8)), ("fc.bias", (16,))])
    one, two = (node_strategies(g.node("fc"), g, AutoMesh((4,)), _cluster())[2] for g in (plain, chain))
    assert one.name == two.name == "column@0"
    out_bytes = 4 * 6 * 16 // 4 * 8  # the local output: a quarter of the columns
    extra = (DEVICE.time_s(flops=0, nbytes=2 * 2 * out_bytes, kernels=2, dtype="float64")
             + DEVICE.time_s(flops=0, nbytes=4 * 2 * out_bytes, kernels=2, dtype="float64"))
    assert two.compute_s - one.compute_s == pytest.approx(extra, rel=1e-9)
    assert two.memory_bytes - one.memory_bytes == 2 * out_bytes
