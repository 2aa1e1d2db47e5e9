"""compile_styles on a two-linear MLP's graph (written out as the tracer writes it): each
choice of strategies (B's, picked by name) either becomes the parallelize plan whose
modules do exactly those layouts, or is refused naming the first node no style runs."""

import pytest
import torch
from torch import nn

from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.opgraph import OpGraph, OpNode, ParamMeta
from plait.parallel.tensor import ColwiseParallel, RowwiseParallel
from plait.plan.auto.strategies import graph_strategies
from plait.plan.auto.to_styles import compile_styles, effective_styles
from plait.plan.cluster import cluster_preset

BATCH, WIDTH, HIDDEN = 4, 8, 16
MESH = AutoMesh((2,))


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x, target):
        return nn.functional.mse_loss(self.fc2(nn.functional.gelu(self.fc1(x))), target)


def _linear(name, source, module, in_features, out_features):
    return OpNode(name=name, kind="linear", target="aten.linear.default", inputs=(source,),
                  params=(f"{module}.weight", f"{module}.bias"), shape=(BATCH, out_features), dtype="float64",
                  itemsize=8, flops=2.0 * BATCH * in_features * out_features, module=module,
                  attrs=(("weight", f"{module}.weight"), ("bias", f"{module}.bias"), ("weight_out_dim", 0),
                         ("in_features", in_features), ("out_features", out_features)))


def _graph() -> OpGraph:
    def tensor(name, kind, inputs, shape, **fields):
        return OpNode(name=name, kind=kind, target=fields.pop("target", ""), inputs=inputs, params=(), shape=shape,
                      dtype="float64", itemsize=8, **fields)

    nodes = (tensor("x", "input", (), (BATCH, WIDTH), attrs=(("index", 0),)),
             tensor("target", "input", (), (BATCH, WIDTH), attrs=(("index", 1),)),
             _linear("linear", "x", "fc1", WIDTH, HIDDEN),
             tensor("gelu", "elementwise", ("linear",), (BATCH, HIDDEN), target="aten.gelu.default",
                    attrs=(("op", "gelu"),)),
             _linear("linear_1", "gelu", "fc2", HIDDEN, WIDTH),
             tensor("mse_loss", "loss", ("linear_1", "target"), (), target="aten.mse_loss.default",
                    attrs=(("op", "mse"), ("reduction", "mean"), ("class_dim", 1))),
             tensor("output", "output", ("mse_loss",), ()))
    params = tuple(ParamMeta(name, shape, "float64", 8) for name, shape in (
        ("fc1.weight", (HIDDEN, WIDTH)), ("fc1.bias", (HIDDEN,)), ("fc2.weight", (WIDTH, HIDDEN)),
        ("fc2.bias", (WIDTH,))))
    return OpGraph(nodes=nodes, params=params, inputs=("x", "target"), output="output")


@pytest.fixture(scope="module")
def options():
    graph = _graph()
    return graph, graph_strategies(graph, MESH, cluster_preset("dgx-a100", gpus=2), dtype="float32")


def _choose(graph, strategies, names: dict, takes: dict = {}):
    """Each node's strategy named in ``names``; any other node takes the strategy with
    the inputs it is given (``takes``: node -> its input layouts; default: its
    producers' outputs, no reshard), the cheapest of those (none: the replicated one)."""
    choice = {}
    for node in graph.nodes:
        options = strategies[node.name]
        if node.name in names:
            choice[node.name] = next(s for s in options if s.name == names[node.name])
            continue
        wanted = takes.get(node.name, tuple(choice[source].output for source in node.inputs))
        fitting = [s for s in options if s.inputs == wanted]
        choice[node.name] = min(fitting, key=lambda s: s.comm_s + s.compute_s) if fitting else options[0]
    return choice


def test_megatron_mlp_is_column_then_row(options):
    graph, strategies = options
    choice = _choose(graph, strategies, {"linear": "column@0", "linear_1": "row@0", "mse_loss": "replicated"},
                     takes={"mse_loss": (("R",), ("R",))})
    compiled = compile_styles(graph, choice, MESH, model=TwoLinear())
    assert compiled.ok, compiled.reason
    assert compiled.plan.styles == {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    assert effective_styles(TwoLinear(), compiled.plan, 2) == {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def test_gathered_column_and_sliced_row(options):
    graph, strategies = options
    # fc1 column whose output every reader takes whole: gather_output; fc2 row taking a
    # replicated input it slices itself: input_is_parallel=False
    choice = _choose(graph, strategies, {"linear": "column@0", "gelu": "replicated", "linear_1": "row@0",
                                         "mse_loss": "replicated"}, takes={"mse_loss": (("R",), ("R",))})
    compiled = compile_styles(graph, choice, MESH, model=TwoLinear())
    assert compiled.plan.styles == {"fc1": ColwiseParallel(gather_output=True),
                                    "fc2": RowwiseParallel(input_is_parallel=False)}


def test_all_replicated_is_an_empty_plan(options):
    graph, strategies = options
    choice = {node.name: strategies[node.name][0] for node in graph.nodes}
    compiled = compile_styles(graph, choice, MESH, model=TwoLinear())
    assert compiled.ok and compiled.plan.styles == {}


@pytest.mark.parametrize("names, takes, node, words", [
    # data parallelism: the batch arrives split
    ({"x": "batch@0", "target": "batch@0", "linear": "batch@0", "linear_1": "batch@0", "mse_loss": "batch@0"}, {},
     "x", "batch sharding is data parallelism"),
    # column fc1, then an all-gather between gelu and a replicated fc2: outside any module
    ({"linear": "column@0", "linear_1": "replicated", "mse_loss": "replicated"},
     {"linear_1": (("R",),), "mse_loss": (("R",), ("R",))}, "linear_1", "reshards S1 -> R"),
    # a row fc2 whose partial sum is reduce-scattered into a batch-split loss: a
    # row-parallel module all-reduces (sequence parallelism aside)
    ({"linear": "column@0", "linear_1": "row@0", "mse_loss": "batch@0"}, {}, "linear_1", "all-reduces its output"),
])
def test_refused_choices_name_the_first_node(options, names, takes, node, words):
    graph, strategies = options
    choice = _choose(graph, strategies, names, takes)
    compiled = compile_styles(graph, choice, MESH, model=TwoLinear())
    assert compiled.plan is None and compiled.node == node, compiled.reason
    assert words in compiled.reason


def test_two_axis_mesh_refused():
    with pytest.raises(ValueError, match="one tensor-parallel axis"):
        compile_styles(_graph(), {}, AutoMesh((2, 2)))


def test_parallelize_refusal_becomes_the_reason(options):
    """A column split the module cannot take (a model whose fc1 is not an nn.Linear)."""
    graph, strategies = options
    model = TwoLinear()
    model.fc1 = nn.Sequential(nn.Linear(WIDTH, HIDDEN))  # same parameters' shapes, another module type
    choice = _choose(graph, strategies, {"linear": "column@0", "linear_1": "row@0", "mse_loss": "replicated"},
                     takes={"mse_loss": (("R",), ("R",))})
    compiled = compile_styles(graph, choice, MESH, model=model)
    assert compiled.plan is None and compiled.node == "linear" and "parallelize refuses" in compiled.reason
    assert torch.is_tensor(model.fc1[0].weight)
