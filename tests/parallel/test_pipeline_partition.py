"""Stage partitioning on one process: the min-max split against brute force, the
three cost measures, explicit splits, interleaved chunks, refused inputs, and a GPT
cut into layers that reproduce its logits bit for bit."""

import itertools
import math
import random
import time

import pytest
import torch
from torch import nn

from plait.models import GPT, GPTConfig
from plait.parallel.tensor import ParallelAttention, ParallelMLP
from plait.parallel.pipeline.partition import (
    balanced_boundaries,
    build_stage,
    layer_costs,
    sequential_layers,
    split_layers,
)

SMALL = dict(layers=3, hidden=16, heads=2, seq_len=8, vocab=23, tied_head=False, dtype="float64")


def brute_force(costs, parts):
    """Every split; the smallest bottleneck, then the lexicographically smallest boundaries."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        bottleneck = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best is None or bottleneck < best[0]:
            best = (bottleneck, bounds)
    return best


def test_balanced_boundaries_small_cases():
    assert balanced_boundaries([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_boundaries([5], 1) == [0, 1]
    assert balanced_boundaries([1, 2, 3], 3) == [0, 1, 2, 3]
    assert balanced_boundaries([1, 1, 1, 1, 1], 2) == [0, 2, 5]  # ties: the earlier boundary
    assert balanced_boundaries([0, 0, 0, 0], 2) == [0, 1, 4]
    assert balanced_boundaries([10, 1, 1, 1, 1, 1, 1], 2) == [0, 1, 7]
    assert balanced_boundaries([1.5, 0.25, 4.0, 0.25, 1.5], 3) == [0, 2, 3, 5]


def test_balanced_boundaries_match_brute_force():
    rng = random.Random(7)
    for trial in range(300):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        if trial % 2:
            costs = [rng.randint(0, 6) for _ in range(n)]  # many ties
        else:
            costs = [rng.choice([0.0, rng.random() * 10]) for _ in range(n)]
        bounds = balanced_boundaries(costs, parts)
        bottleneck = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        expected_bottleneck, expected_bounds = brute_force(costs, parts)
        assert bottleneck == pytest.approx(expected_bottleneck, rel=1e-12), (costs, parts)
        if trial % 2:  # integers are exact, so the tie-break is comparable
            assert bounds == expected_bounds, (costs, parts)
        assert bounds[0] == 0 and bounds[-1] == n and all(a < b for a, b in zip(bounds, bounds[1:]))


def test_balanced_boundaries_scale():
    costs = [float(i % 7 + 1) for i in range(2000)]
    bounds = balanced_boundaries(costs, 16)
    assert len(bounds) == 17 and bounds[-1] == 2000
    assert max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) <= sum(costs) / 16 + 7


def test_balanced_boundaries_refuse_bad_input():
    with pytest.raises(ValueError, match=r"^3 layers cannot fill 4 parts .*use at most 3 parts or a model with more"):
        balanced_boundaries([1, 2, 3], 4)
    with pytest.raises(ValueError, match=r"parts=0 must be at least 1"):
        balanced_boundaries([1, 2, 3], 0)
    with pytest.raises(TypeError, match=r"parts must be an int"):
        balanced_boundaries([1, 2, 3], 2.0)
    with pytest.raises(ValueError, match=r"costs must be finite and >= 0: costs\[1\]=-1, costs\[2\]=nan, "
                                         r"costs\[3\]=inf"):
        balanced_boundaries([1, -1, math.nan, math.inf], 2)
    with pytest.raises(TypeError, match=r"costs\[0\]=True"):
        balanced_boundaries([True, 1], 1)
    with pytest.raises(ValueError, match=r"^0 layers cannot fill 1 parts"):
        balanced_boundaries([], 1)


def test_params_count_shared_parameters_once():
    first, second = nn.Linear(4, 3), nn.Linear(3, 2)
    tied = nn.Linear(4, 3)
    tied.weight = first.weight  # shared: counted at layer 0, only the bias here
    reuse = nn.Sequential(first)  # the same module again: nothing new
    assert layer_costs([first, second, reuse, tied], "params") == [15.0, 8.0, 0.0, 3.0]
    assert layer_costs([], "params") == []


def test_flops_of_known_modules():
    layers = [nn.Embedding(10, 4), nn.Linear(4, 6), nn.ReLU(), nn.LayerNorm(6), nn.Dropout(0.5)]
    tokens = torch.randint(0, 10, (2, 3))
    assert layer_costs(layers, "flops", sample_input=tokens) == [0.0, 2 * 6 * 4 * 6, 36.0, 5 * 36.0, 0.0]
    conv = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1, groups=2), nn.GELU())
    image = torch.randn(2, 4, 5, 5)
    out_elems = 2 * 6 * 5 * 5
    assert layer_costs([conv], "flops", sample_input=image) == [2 * out_elems * 2 * 9 + out_elems]


class Declared(nn.Module):
    """A custom layer that states its own FLOPs (its Linear child is then not counted)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.linear(x) * self.scale

    def flops(self, x, output):
        return 1000 * x.shape[0]


class Unknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


def test_flops_declared_by_a_module_and_refused_when_unknown():
    x = torch.randn(3, 4)
    assert layer_costs([Declared(), nn.Linear(4, 2)], "flops", sample_input=x) == [3000.0, 48.0]
    shared = nn.Linear(4, 4)  # run by layers 0 and 2: each pays for its own call
    assert layer_costs([shared, nn.ReLU(), nn.Sequential(shared, shared)], "flops", sample_input=x) == [96.0, 12.0,
                                                                                                        192.0]
    with pytest.raises(ValueError, match=r"cannot estimate the FLOPs of layers\[1\] \(Unknown\): give it a "
                                         r"flops\(input, output\) method"):
        layer_costs([nn.Identity(), Unknown()], "flops", sample_input=x)
    with pytest.raises(ValueError, match=r"balance='flops' runs the layers: pass sample_input="):
        layer_costs([nn.Linear(4, 4)], "flops")
    with pytest.raises(ValueError, match=r"balance='speed' must be one of 'params', 'flops', 'time'"):
        layer_costs([nn.Linear(4, 4)], "speed")
    with pytest.raises(TypeError, match=r"explicit list of layers per chunk goes to split_layers"):
        layer_costs([nn.Linear(4, 4)], [1])


def test_flops_of_gpt_layers_follow_megatron():
    for ffn_hidden in (0, 24):
        config = GPTConfig(**SMALL, ffn_hidden=ffn_hidden, dropout=0.1)
        model = GPT(config, seed=1)
        b, s, h, ffn, vocab = 2, 5, config.hidden, config.ffn, config.vocab
        tokens = torch.randint(0, vocab, (b, s))
        layers = sequential_layers(model)
        streams = [module.calls for module in model.modules() if hasattr(module, "calls")]
        costs = layer_costs(layers, "flops", sample_input=tokens)
        block = 2 * b * s * (4 * h * h + 2 * h * ffn) + 4 * b * s * s * h
        if ffn_hidden == 0:
            assert block == 24 * b * s * h * h + 4 * b * s * s * h
        assert costs == [b * s * h, *[float(block)] * config.layers, 5 * b * s * h + 2 * b * s * h * vocab]
        assert model.training and all(layer.training for layer in model.modules())  # modes restored
        assert streams == [module.calls for module in model.modules() if hasattr(module, "calls")]


def test_flops_of_tensor_parallel_layers_used_alone():
    s, b, h = 5, 2, 16
    layers = [ParallelAttention(h, 2, dtype=torch.float64), ParallelMLP(h, 24, dtype=torch.float64)]
    costs = layer_costs(layers, "flops", sample_input=torch.randn(s, b, h, dtype=torch.float64))
    assert costs == [2 * s * b * 4 * h * h + 4 * b * s * s * h, 2 * s * b * 2 * h * 24]


def test_time_measures_each_layer_and_leaves_no_trace():
    class Slow(nn.Module):
        def forward(self, x):
            time.sleep(0.02)
            return x * 2

    layers = [nn.Linear(4, 4), Slow(), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2)]
    before = layers[2].running_mean.clone()
    x = torch.randn(3, 4)
    rng_before = torch.random.get_rng_state()
    costs = layer_costs(layers, "time", sample_input=x, repeats=1)
    assert len(costs) == 5 and all(cost > 0 for cost in costs)
    assert costs[1] >= 0.02 and costs[1] > max(costs[0], costs[4])
    assert all(param.grad is None for layer in layers for param in layer.parameters())
    assert torch.equal(layers[2].running_mean, before) and layers[2].num_batches_tracked == 0
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    with pytest.raises(ValueError, match=r"repeats=0 must be a positive int"):
        layer_costs(layers, "time", sample_input=torch.randn(3, 4), repeats=0)


def test_time_on_a_gpt_keeps_its_dropout_streams():
    model = GPT(GPTConfig(**SMALL, dropout=0.2), seed=3)
    streams = [module.calls for module in model.modules() if hasattr(module, "calls")]
    costs = layer_costs(sequential_layers(model), "time", sample_input=torch.randint(0, 23, (2, 8)), repeats=1)
    assert len(costs) == SMALL["layers"] + 2 and all(cost > 0 for cost in costs)
    assert streams == [module.calls for module in model.modules() if hasattr(module, "calls")]
    assert all(param.grad is None for param in model.parameters())


def test_split_by_params_and_chunk_order():
    widths = [8, 8, 2, 2, 2, 2, 8, 8]
    layers = [nn.Linear(w, w, bias=False) for w in widths]  # costs 64 64 4 4 4 4 64 64
    assert split_layers(layers, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_layers(layers, 4) == [[0], [1, 2, 3], [4, 5, 6], [7]]  # 64 72 72 64
    chunks = split_layers(layers, 2, virtual=2)  # chunk c on rank c % 2: rank 0 holds 0 and 2
    assert chunks == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert sorted(i for chunk in chunks for i in chunk) == list(range(8))


def test_split_by_flops_differs_from_params():
    # an embedding is all parameters and no FLOPs; the MLP the other way round
    layers = [nn.Embedding(1000, 8), nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8)]
    tokens = torch.randint(0, 1000, (4, 16))
    assert split_layers(layers, 2, balance="params") == [[0], [1, 2, 3]]
    # FLOPs 0, 65536, 4096, 65536: both cuts around the ReLU reach 69632; the earlier wins
    assert split_layers(layers, 2, balance="flops", sample_input=tokens) == [[0, 1], [2, 3]]
    assert split_layers([*layers, nn.Linear(8, 8)], 2, balance="flops", sample_input=tokens) == [[0, 1, 2], [3, 4]]


def test_explicit_split_and_its_errors():
    layers = [nn.Linear(2, 2) for _ in range(7)]
    assert split_layers(layers, 3, balance=[2, 3, 2]) == [[0, 1], [2, 3, 4], [5, 6]]
    assert split_layers(layers, 2, virtual=2, balance=(1, 2, 2, 2)) == [[0], [1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match=r"it needs stages\(2\) \* virtual\(2\) = 4 entries, got 3"):
        split_layers(layers, 2, virtual=2, balance=[2, 3, 2])
    with pytest.raises(ValueError, match=r"sums to 6 layers but the model has 7: make the counts add up to 7"):
        split_layers(layers, 3, balance=[2, 2, 2])
    with pytest.raises(ValueError, match=r"positive int number of layers: balance\[1\]=0, balance\[2\]=2.5"):
        split_layers(layers, 3, balance=[4, 0, 2.5])
    with pytest.raises(TypeError, match=r"balance=7 must be 'params', 'flops', 'time' or a list"):
        split_layers(layers, 3, balance=7)


def test_fewer_layers_than_stages_is_refused_with_the_fix():
    layers = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(ValueError, match=r"^3 layers cannot fill 4 stages: use at most 3 stages, or a model "
                                         r"with more layers$"):
        split_layers(layers, 4)
    with pytest.raises(ValueError, match=r"^3 layers cannot fill 2 stages x 2 virtual stages = 4 model chunks: "
                                         r"use at most 1 stages with virtual=2, or virtual <= 1 with 2 stages, "
                                         r"or virtual=1 with at most 3 stages, or a model with more layers$"):
        split_layers(layers, 2, virtual=2)
    with pytest.raises(ValueError, match=r"stages=0 must be a positive int"):
        split_layers(layers, 0)
    with pytest.raises(ValueError, match=r"virtual=0 must be a positive int"):
        split_layers(layers, 1, virtual=0)


def test_build_stage_runs_layers_in_order_under_their_global_names():
    layers = [nn.Linear(3, 3) for _ in range(4)]
    stage = build_stage(layers, [1, 2])
    x = torch.randn(2, 3)
    assert torch.equal(stage(x), layers[2](layers[1](x)))
    assert list(stage.state_dict()) == ["1.weight", "1.bias", "2.weight", "2.bias"]
    with pytest.raises(ValueError, match=r"layer indices 4 are not in \[0, 4\)"):
        build_stage(layers, [3, 4])
    with pytest.raises(ValueError, match=r"at least one layer"):
        build_stage(layers, [])


def test_sequential_layers_of_a_sequential_and_refused_models():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert sequential_layers(model) == list(model.children())
    with pytest.raises(TypeError, match=r"takes an nn.Sequential or a plait GPT, got Linear"):
        sequential_layers(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"tied_head=True .* build GPTConfig\(tied_head=False\) for pipeline"):
        sequential_layers(GPT(GPTConfig(**{**SMALL, "tied_head": True})))


@pytest.mark.parametrize("mode", ["eval", "train", "train-dropout"])
def test_gpt_layers_reproduce_its_logits_exactly(mode):
    dropout = 0.3 if mode == "train-dropout" else 0.0
    config = GPTConfig(**SMALL, dropout=dropout)
    reference, pieces = GPT(config, seed=5), GPT(config, seed=5)  # twins: the same weights and dropout streams
    reference.train(mode != "eval")
    pieces.train(mode != "eval")
    tokens = torch.randint(0, config.vocab, (3, 7), generator=torch.Generator().manual_seed(0))
    layers = sequential_layers(pieces)
    assert len(layers) == config.layers + 2
    for step in range(2):  # the second step draws fresh dropout masks in both
        x = tokens
        for layer in layers:
            x = layer(x)
        assert x.shape == (3, 7, config.vocab)
        assert torch.equal(x, reference(tokens)), (mode, step)


def test_gpt_stages_share_the_model_parameters_and_reproduce_it():
    config = GPTConfig(**SMALL)
    model = GPT(config, seed=2)
    layers = sequential_layers(model)
    chunks = split_layers(layers, 2)
    assert [i for chunk in chunks for i in chunk] == list(range(len(layers)))
    stages = [build_stage(layers, chunk) for chunk in chunks]
    ids = {id(param) for stage in stages for param in stage.parameters()}
    assert ids == {id(param) for param in model.parameters()}
    tokens = torch.randint(0, config.vocab, (2, 8))
    x = tokens
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, model(tokens))
    # params: embedding + positions | blocks | head; each stage within one layer of the ideal
    costs = layer_costs(layers, "params")
    assert sum(costs) == config.num_parameters()
    assert costs[0] == config.vocab * config.hidden + config.seq_len * config.hidden
    assert costs[-1] == config.vocab * config.hidden + 2 * config.hidden
