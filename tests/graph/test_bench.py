"""plait.graph.bench (equivalence, timing harness, peers), plait.graph.drawing and the
example models: the measurement helpers of `plait optimize`. No timing is asserted."""

import math

import pytest
import torch
from torch import fx, nn

from plait.graph import bench, examples
from plait.graph.drawing import draw_graph, layout
from plait.graph.engine import trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- equivalence ------------------------------------------------------------------------

def test_tolerances_are_the_issues_and_other_dtypes_are_refused():
    assert bench.tolerance_for(torch.float32) == 1e-5
    assert bench.tolerance_for(torch.float64) == 1e-12
    with pytest.raises(ValueError, match=r"torch.bfloat16.*--dtype float32"):
        bench.tolerance_for(torch.bfloat16)


def test_equal_outputs_have_zero_error():
    reference = torch.randn(3, 4, dtype=torch.float64)
    difference = bench.compare_outputs(reference, reference.clone(), 1e-12)
    assert difference.ok and difference.relative_error == 0.0


def test_relative_error_is_the_norm_ratio_and_names_the_worst_element():
    reference = torch.ones(2, 5, dtype=torch.float64)  # ‖ref‖ = √10
    changed = reference.clone()
    changed[1, 3] += 0.5
    difference = bench.compare_outputs(reference, changed, 1e-5)
    assert difference.relative_error == pytest.approx(0.5 / math.sqrt(10), rel=1e-12)
    assert not difference.ok
    assert difference.where == "output 0 [1, 3]"
    assert (difference.reference_value, difference.value, difference.max_abs_difference) == (1.0, 1.5, 0.5)
    assert "OUTPUTS CHANGED" in difference.describe() and "reference 1, got 1.5" in difference.describe()


def test_error_just_inside_and_just_outside_the_tolerance():
    reference = torch.zeros(100, dtype=torch.float64)
    reference[0] = 1.0
    inside, outside = reference.clone(), reference.clone()
    inside[1], outside[1] = 0.9e-12, 1.1e-12  # ‖ref‖ = 1, so the error is that entry
    assert bench.compare_outputs(reference, inside, 1e-12).ok
    assert not bench.compare_outputs(reference, outside, 1e-12).ok


def test_nested_outputs_take_the_worst_tensor():
    reference = {"logits": torch.ones(3), "extra": (torch.ones(2), [torch.full((2,), 2.0)])}
    changed = {"logits": torch.ones(3), "extra": (torch.ones(2), [torch.tensor([2.0, 4.0])])}
    difference = bench.compare_outputs(reference, changed, 1e-5)
    assert difference.where == "output 2 [1]"  # the third tensor in order
    assert difference.relative_error == pytest.approx(2.0 / math.sqrt(8))


@pytest.mark.parametrize("changed, where", [
    ((torch.ones(2, 3),), "shape (2, 3) instead of (2, 4)"),
    ((torch.ones(2, 4), torch.ones(1)), "2 output tensors instead of 1"),
])
def test_structure_mismatch_is_infinitely_wrong(changed, where):
    difference = bench.compare_outputs((torch.ones(2, 4),), changed, 1e-5)
    assert difference.relative_error == math.inf and where in difference.where


def test_nan_and_zero_reference():
    assert bench.compare_outputs(torch.ones(3), torch.tensor([1.0, math.nan, 1.0]), 1e-5).relative_error == math.inf
    assert bench.compare_outputs(torch.zeros(3), torch.zeros(3), 1e-5).ok
    assert not bench.compare_outputs(torch.zeros(3), torch.tensor([0.0, 1e-30, 0.0]), 1e-5).ok


# ---- timing harness ---------------------------------------------------------------------

class CallLog(nn.Module):
    """Appends its name to a shared list on every call (to see the alternation)."""

    def __init__(self, name: str, log: list):
        super().__init__()
        self.name, self.log = name, log

    def forward(self, x):
        self.log.append(self.name)
        return x + 1


def test_timing_statistics():
    timing = bench.Timing("m", batch=8, latencies_s=(0.004, 0.001, 0.003, 0.002), iterations=10)
    assert timing.median_s == pytest.approx(0.0025)
    assert (timing.min_s, timing.max_s) == (0.001, 0.004)
    assert timing.throughput_per_s == pytest.approx(8 / 0.0025)
    assert bench.format_latency(timing) == "2.500 ms (1.000-4.000)"
    assert bench.Timing("m", 1, (0.3, 0.1, 0.2), 1).median_s == 0.2


def test_paired_speedup_is_the_median_of_same_repeat_ratios():
    baseline = bench.Timing("eager", 1, (2.0, 30.0, 4.0), 1)  # a slow spell in repeat 1 hits both
    variant = bench.Timing("plait", 1, (1.0, 20.0, 1.0), 1)
    assert bench.paired_speedup(baseline, variant) == 2.0  # ratios 2, 1.5, 4
    assert baseline.median_s / variant.median_s == 4.0  # the ratio of medians mixes repeats
    with pytest.raises(ValueError, match="same repeats"):
        bench.paired_speedup(baseline, bench.Timing("x", 1, (1.0,), 1))


def test_iterations_per_sample():
    assert bench.iterations_for(0.01, 0.05) == 5
    assert bench.iterations_for(0.011, 0.05) == 5  # ceil(4.5)
    assert bench.iterations_for(0.1, 0.05) == 1
    assert bench.iterations_for(0.0, 0.05) == 1


def test_models_alternate_in_rotated_order_and_every_sample_is_kept():
    log: list[str] = []
    models = {name: CallLog(name, log) for name in ("a", "b", "c")}
    timings = bench.measure_latency(models, (torch.zeros(4, 2),), batch=4, repeats=3, warmup_calls=2, sample_s=0.0)
    assert set(timings) == {"a", "b", "c"}
    assert all(len(t.latencies_s) == 3 and t.iterations == 1 and t.batch == 4 for t in timings.values())
    # warm-up 2 each, one calibration call of the first, then one call per model per repeat, rotated
    assert log == ["a", "a", "b", "b", "c", "c", "a"] + ["a", "b", "c"] + ["b", "c", "a"] + ["c", "a", "b"]


@pytest.mark.parametrize("kwargs", [{"repeats": 0}, {"warmup_calls": -1}, {"sample_s": -1.0}])
def test_bad_timing_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        bench.measure_latency({"a": nn.Identity()}, (torch.zeros(1),), batch=1, **kwargs)


def test_counted_flops_of_a_linear():
    assert bench.counted_flops(nn.Linear(4, 3), (torch.zeros(2, 4),)) == 2 * 2 * 4 * 3


# ---- peers ------------------------------------------------------------------------------

def _wrong(model, peer_module, inputs) -> bool:
    reference = bench.run_model(model, inputs)
    return not bench.compare_outputs(reference, bench.run_model(peer_module, inputs), 1e-5).ok


def test_fuse_modules_groups_follow_the_graph():
    model, _ = examples.resnet18_like()
    groups = bench.fuse_modules_groups(trace(model))
    assert len(groups) == 20  # every conv + BN
    assert groups[0] == ["conv1", "bn1", "relu"]  # the stem's ReLU module is called once
    # a block's ReLU module is called twice (after bn1 and after the add): not fusable by name
    assert ["layer1.0.conv1", "layer1.0.bn1"] in groups
    model, _ = examples.mobilenet_like()
    groups = bench.fuse_modules_groups(trace(model))
    assert ["features.6", "features.7", "features.8"] in groups  # pointwise conv + BN + ReLU
    assert ["features.3", "features.4"] in groups  # depthwise conv + BN (ReLU6 is not fusable)
    assert ["head.1", "head.2"] in groups  # Linear + BatchNorm1d: torch has no Linear+BN+ReLU fuser


def test_conv_called_twice_is_not_named_and_fx_fuse_gets_it_wrong():
    model, inputs = examples.conv_called_twice()
    traced = trace(model)
    assert bench.fuse_modules_groups(traced) == []
    assert bench.fuse_modules_peer(model, traced).skipped
    peer = bench.fx_fuse_peer(model, traced)
    assert peer.detail == "fuse(model)" and _wrong(model, peer.module, inputs)


def test_pytorch_104593_fx_fuse_refuses_and_fuse_modules_is_wrong():
    model, inputs = examples.conv_bn_shared()
    traced = trace(model)
    assert not _wrong(model, bench.fx_fuse_peer(model, traced).module, inputs)  # torch 2.13 checks the users
    peer = bench.fuse_modules_peer(model, traced)
    assert peer.detail == "1 groups: conv+bn" and _wrong(model, peer.module, inputs)


def test_peers_are_right_on_resnet():
    model, inputs = examples.resnet18_like()
    traced = trace(model)
    for peer in (bench.fx_fuse_peer(model, traced), bench.fuse_modules_peer(model, traced)):
        assert not _wrong(model, peer.module, inputs), peer.name


def test_fx_fuse_falls_back_to_the_leaf_traced_graph_and_leaves_it_alone():
    model, inputs = examples.gpt_eval()
    traced = trace(model, examples.GPT_LEAF_MODULES)
    before = bench.run_model(traced, inputs)
    peer = bench.fx_fuse_peer(model, traced)
    assert "symbolic_trace fails" in peer.detail and not _wrong(model, peer.module, inputs)
    assert torch.equal(bench.run_model(traced, inputs), before)
    assert bench.fuse_modules_peer(model, traced).skipped


# ---- drawing and the examples -----------------------------------------------------------

class Skip(nn.Module):
    def forward(self, x):
        return torch.relu(x) + x


def test_layout_rows_are_longest_paths():
    graph = fx.symbolic_trace(Skip()).graph
    rows = {node.name: position for node, position in layout(graph).items()}
    assert rows == {"x": (0, 0), "relu": (1, 0), "add": (2, 0), "output": (3, 0)}


def test_draw_graph_writes_a_png(tmp_path):
    model, _ = examples.mobilenet_like()
    path = draw_graph(trace(model), tmp_path / "deep" / "graph.png", "mobilenet")
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


@pytest.mark.parametrize("name", sorted(examples.EXAMPLES))
def test_examples_are_eval_models_the_tracer_reproduces(name):
    model, inputs = examples.EXAMPLES[name](batch=3)
    assert isinstance(inputs, tuple) and inputs[0].shape[0] == 3
    assert not any(module.training for module in model.modules())
    leaves = examples.GPT_LEAF_MODULES if name == "gpt_eval" else ()
    assert torch.equal(bench.run_model(trace(model, leaves), inputs), bench.run_model(model, inputs))


def test_examples_follow_the_dtype():
    model, inputs = examples.resnet18_like(dtype=torch.float64)
    assert inputs[0].dtype == torch.float64 and bench.run_model(model, inputs).dtype == torch.float64
