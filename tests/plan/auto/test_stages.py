"""Alpa's inter-operator pass: layers of an OpGraph, slices, the stage/sub-mesh DP
against brute force (synthetic prices, with and without depth-dependent prices), the
ILP-priced search on a traced model against a brute force over the same ILP.

Latencies are sums of the same floats in another order: compared at 1e-12 relative."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.trace import simplify, trace_graph
from plait.plan.auto.ilp import solve
from plait.plan.auto.stage_graph import Layer, boundary_bytes, graph_layers, slice_graph, slice_signature
from plait.plan.auto.stages import auto_stages, logical_shapes, stage_search, submesh_options
from plait.plan.auto.strategies import grad_nodes, node_strategies
from plait.plan.cluster import cluster_preset
from plait.plan.stages import alpa_partition

RELATIVE = 1e-12


def _latency(times, microbatches):
    return sum(times) + (microbatches - 1) * max(times)


def _plans(num_layers, devices, options):
    """Every (cuts, sizes, shapes): cuts of the layers, sizes summing to devices, a shape per stage."""
    for parts in range(1, num_layers + 1):
        for inner in itertools.combinations(range(1, num_layers), parts - 1):
            cuts = (0, *inner, num_layers)
            for sizes in itertools.product(sorted(options), repeat=parts):
                if sum(sizes) == devices:
                    for shapes in itertools.product(*(options[size] for size in sizes)):
                        yield list(zip(cuts, cuts[1:])), shapes


def _brute_force(num_layers, devices, options, microbatches, price, by_depth=False):
    best = math.inf
    for slices, shapes in _plans(num_layers, devices, options):
        depths = range(len(slices), 0, -1)
        times = [price(i, j, shape, depth) if by_depth else price(i, j, shape)
                 for (i, j), shape, depth in zip(slices, shapes, depths)]
        if all(math.isfinite(t) for t in times):
            best = min(best, _latency(times, microbatches))
    return best


def _random_price(rng, num_layers, options, by_depth):
    costs = [rng.uniform(0.2, 3.0) for _ in range(num_layers)]
    table = {}
    for i in range(num_layers):
        for j in range(i + 1, num_layers + 1):
            for size, shapes in options.items():
                for shape in shapes:
                    for depth in range(1, num_layers + 1):
                        base = sum(costs[i:j]) / size + rng.uniform(0.0, 0.4)
                        # deeper stages hold more micro-batches: sometimes they do not fit
                        table[i, j, shape, depth] = math.inf if by_depth and rng.random() < 0.08 * depth else base
    return (lambda i, j, shape, depth: table[i, j, shape, depth]) if by_depth else \
        (lambda i, j, shape: table[i, j, shape, 1])


def test_search_equals_brute_force_with_shapes_and_depths():
    """Random prices per (slice, logical shape) and, with by_depth, per depth: the search's
    T equals the least T over every cut, sub-mesh sizes and shape per stage."""
    rng = random.Random(35)
    checked = 0
    for case in range(120):
        num_layers, devices = rng.randint(1, 5), rng.choice([2, 3, 4])
        options = rng.choice([{1: ((1,),), 2: ((2,),), 4: logical_shapes(4)}, {1: ((1,),), 3: ((3,),)},
                              {1: ((1,),), 2: ((2,),)}])
        microbatches, by_depth = rng.choice([1, 2, 8]), rng.random() < 0.5
        price = _random_price(rng, num_layers, options, by_depth)
        expected = _brute_force(num_layers, devices, options, microbatches, price, by_depth)
        try:
            found = stage_search(num_layers, devices, options, microbatches, price, by_depth=by_depth)
        except ValueError:
            assert expected == math.inf, case
            continue
        assert found.latency_s == pytest.approx(expected, rel=RELATIVE, abs=0), case
        times = [stage.time_s for stage in found.stages]
        assert found.latency_s == _latency(times, microbatches)
        depths = range(len(found.stages), 0, -1)
        assert times == [price(s.start, s.end, s.mesh_shape, *((d,) if by_depth else ()))
                         for s, d in zip(found.stages, depths)]
        assert sum(stage.devices for stage in found.stages) == devices
        checked += 1
    assert checked > 80


def test_alpa_partition_by_depth_calls_each_depth_once():
    """by_depth: stage_time_s(i, j, n, s) once per (i, j, n, s); the last stage has depth 1."""
    calls = []

    def price(i, j, n, depth):
        calls.append((i, j, n, depth))
        return (j - i) / n + (0.0 if depth == 1 else 10.0)  # only a last stage is cheap
    plan = alpa_partition(3, 2, (1, 2), 4, price, by_depth=True)
    assert len(calls) == len(set(calls)) == 6 * 2 * 2  # 6 slices x 2 sizes x depths 1..2
    assert plan.slices == ((0, 3),) and plan.stage_times_s == (1.5,)


def test_uneven_stages_on_unequal_submeshes_win():
    """A heavy first layer and collectives that cost (n - 1) s on n devices: the first layer
    alone on 2 devices, the two light ones on 1 device, beats one stage on all 3."""
    costs = [6.0, 1.0, 1.0]
    options = {1: ((1,),), 2: ((2,),), 3: ((3,),)}

    def price(i, j, shape):
        return sum(costs[i:j]) / shape[0] + (shape[0] - 1)
    found = stage_search(3, 3, options, 8, price)
    assert [(s.start, s.end, s.devices) for s in found.stages] == [(0, 1, 2), (1, 3, 1)]
    assert found.latency_s == pytest.approx(6.0 + 7 * 4.0, rel=RELATIVE)
    assert found.single_stage_latency_s == pytest.approx(8 * (8 / 3 + 2), rel=RELATIVE)
    assert found.latency_s < found.single_stage_latency_s
    assert found.latency_s == pytest.approx(_brute_force(3, 3, options, 8, price), rel=RELATIVE)


def test_one_stage_wins_when_the_work_scales():
    """Perfect scaling and one micro-batch: T is the sum of stage times, so pp = 1 on all
    devices wins; with a 2-D shape that is cheaper than the 1-D one, that shape is taken."""
    options = {1: ((1,),), 2: ((2,),), 4: logical_shapes(4)}

    def price(i, j, shape):
        return (j - i) / math.prod(shape) + (0.0 if shape == (2, 2) else 0.1)
    found = stage_search(4, 4, options, 1, price)
    assert len(found.stages) == 1 and found.stages[0].mesh_shape == (2, 2)
    assert found.latency_s == found.single_stage_latency_s == 1.0


def test_submesh_options_follow_alpa():
    assert submesh_options(cluster_preset("dgx-a100", gpus=16)) == {
        1: ((1,),), 2: ((2,),), 4: ((4,), (2, 2)), 8: ((8,), (2, 4), (4, 2)), 16: ((16,), (2, 8), (4, 4), (8, 2))}
    assert sorted(submesh_options(cluster_preset("dgx-a100", gpus=6))) == [1, 2, 6]
    with pytest.raises(ValueError, match=r"sub-mesh size 4: shapes \[\(2, 3\)\] must be"):
        stage_search(2, 4, {4: ((2, 3),)}, 1, lambda i, j, shape: 1.0)


class _Blocks(nn.Module):
    """x -> x + block_k(x) for identical blocks (Linear, ReLU, Linear), then a head and the
    cross-entropy: layers <first>, blocks.0..n-1, <last>."""

    def __init__(self, width=16, inner=32, blocks=3, classes=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, inner), nn.ReLU(), nn.Linear(inner, width))
                                    for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block(x)
        return nn.functional.cross_entropy(self.head(x), y)


@pytest.fixture(scope="module")
def graph():
    """The traced, simplified step of _Blocks with 4 blocks on a batch of 8 (float32)."""
    torch.manual_seed(0)
    inputs = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    return simplify(trace_graph(_Blocks(blocks=4), inputs).graph)


def test_layers_slices_and_signatures(graph):
    layers = graph_layers(graph)
    assert [layer.name for layer in layers] == ["<first>", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "<last>"]
    assert [name for layer in layers for name in layer.nodes] == [node.name for node in graph.nodes]
    assert layers[0].nodes == graph.inputs
    sub = slice_graph(graph, layers, 2, 4)
    assert sub.inputs == (layers[1].nodes[-1],) and sub.node(sub.inputs[0]).kind == "input"
    assert sub.output == layers[3].nodes[-1] and len(sub.params) == 8  # two blocks' weights and biases
    assert slice_graph(graph, layers, 3, 6).output == graph.output
    grads = grad_nodes(graph)
    assert slice_signature(graph, layers, 2, 3, grads) == slice_signature(graph, layers, 3, 4, grads)
    assert slice_signature(graph, layers, 1, 2, grads) != slice_signature(graph, layers, 2, 3, grads)  # x: no grad
    assert slice_signature(graph, layers, 4, 5, grads) != slice_signature(graph, layers, 3, 4, grads)  # no add
    activation = 8 * 16 * 4  # (batch, width) float32
    labels = 8 * 8  # y (int64) goes on to the loss in the last layer, with no gradient
    assert boundary_bytes(graph, layers, 2, grads) == (activation + labels, activation)
    assert boundary_bytes(graph, layers, 1, grads) == (8 * 16 * 4 + 8 * 8, 0)  # x and the labels y: no gradient


class _TwoChildren(nn.Module):
    def __init__(self):
        super().__init__()
        self.encode, self.decode = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x):
        return (self.decode(torch.tanh(self.encode(x))) - x).pow(2).mean()


def test_without_a_container_the_top_level_children_are_the_layers():
    graph = simplify(trace_graph(_TwoChildren(), (torch.randn(4, 8),)).graph)
    assert [layer.name for layer in graph_layers(graph)] == ["<first>", "encode", "decode", "<last>"]


def test_ilp_priced_search_equals_brute_force_over_the_ilp(graph):
    """On the traced 4-block model and 4 devices (sizes 1, 2, 4; shapes (4,) and (2, 2)) the
    search's T equals the least T over every plan priced here from the ILP on each slice's
    sub-graph plus the stage's p2p sends; identical blocks share their ILPs."""
    layers = graph_layers(graph)
    cluster = cluster_preset("dgx-a100", gpus=4)
    grads = grad_nodes(graph)
    cache = {}

    def price(i, j, shape):
        if (i, j, shape) not in cache:
            sub, mesh = slice_graph(graph, layers, i, j), AutoMesh(shape)
            strategies = {node.name: node_strategies(node, sub, mesh, cluster, grad_nodes=grads) for node in sub.nodes}
            devices = math.prod(shape)
            sends = [boundary_bytes(graph, layers, j, grads)[0] if j < len(layers) else 0,
                     boundary_bytes(graph, layers, i, grads)[1] if i > 0 else 0]
            cache[i, j, shape] = solve(sub, strategies, mesh, cluster).objective_s + sum(
                cluster.p2p_time_s(nbytes / devices, False) for nbytes in sends)
        return cache[i, j, shape]
    options = submesh_options(cluster)
    for microbatches in (4,):
        found = auto_stages(graph, cluster, microbatches=microbatches, exact=True)
        expected = _brute_force(len(layers), 4, options, microbatches, price)
        assert found.latency_s == pytest.approx(expected, rel=1e-9), microbatches  # HiGHS's own rounding
        assert found.single_stage_latency_s == pytest.approx(
            microbatches * min(price(0, len(layers), shape) for shape in options[4]), rel=1e-9)
    assert sum(found.stage_layers) == len(layers) and sum(found.stage_blocks) == 4
    slices = len(layers) * (len(layers) + 1) // 2
    assert found.ilp_solves < slices * sum(len(shapes) for shapes in options.values())


def test_memory_limit_counts_in_flight_micro_batches(graph):
    """With a memory limit each stage is priced per depth: on two 1-device stages and 4
    micro-batches the first stage (depth 2) keeps 2 micro-batches of activations, the
    last one; a limit nothing fits is refused by name; a limit every plan fits gives the
    unlimited search's T with no further ILP (the one-micro-batch plans still fit)."""
    cluster = cluster_preset("dgx-a100", gpus=2)
    layers = graph_layers(graph)
    halves = [Layer("front", sum((layer.nodes for layer in layers[:5]), ())), layers[5]]  # 4 blocks, head + loss
    ones = {1: ((1,),)}
    roomy = {m: auto_stages(graph, cluster, microbatches=m, memory_limit_bytes=1e12, exact=True, options=ones,
                            layers=halves) for m in (1, 4)}
    unlimited = auto_stages(graph, cluster, microbatches=4, exact=True, options=ones, layers=halves)
    assert roomy[4].latency_s == pytest.approx(unlimited.latency_s, rel=1e-9)
    assert roomy[4].ilp_solves == unlimited.ilp_solves  # every one-micro-batch plan still fits at depth 2
    front, back = (roomy[1].stages[0].memory_bytes, roomy[4].stages[0].memory_bytes), \
        (roomy[1].stages[1].memory_bytes, roomy[4].stages[1].memory_bytes)
    assert back[0] == back[1] and front[1] > front[0]
    limit = (front[0] + front[1]) / 2  # the front stage fits with one micro-batch in flight, not two
    assert back[0] < limit
    with pytest.raises(ValueError, match="no feasible plan"):
        auto_stages(graph, cluster, microbatches=4, memory_limit_bytes=limit, exact=True, options=ones, layers=halves)
    assert auto_stages(graph, cluster, microbatches=1, memory_limit_bytes=limit, exact=True, options=ones,
                       layers=halves).latency_s == pytest.approx(roomy[1].latency_s, rel=1e-9)
    with pytest.raises(ValueError, match="no feasible plan"):
        auto_stages(graph, cluster, microbatches=4, memory_limit_bytes=1.0, exact=False)


def test_additive_pricing_is_the_sum_of_layers(graph):
    """exact=False prices a slice as the sum of its layers' own ILP optima; identical
    blocks are solved once."""
    cluster = cluster_preset("dgx-a100", gpus=2)
    layers = graph_layers(graph)
    grads, mesh = grad_nodes(graph), AutoMesh((2,))
    expected = 0.0
    for index in range(len(layers)):
        sub = slice_graph(graph, layers, index, index + 1)
        strategies = {node.name: node_strategies(node, sub, mesh, cluster, grad_nodes=grads) for node in sub.nodes}
        expected += solve(sub, strategies, mesh, cluster).objective_s
    found = auto_stages(graph, cluster, microbatches=1, exact=False, options={2: ((2,),)})
    assert len(found.stages) == 1 and found.stages[0].time_s == pytest.approx(expected, rel=1e-9)
    assert found.ilp_solves == len(layers) - 1  # blocks.1 and blocks.2 are one signature
