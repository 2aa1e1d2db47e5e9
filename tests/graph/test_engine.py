"""The rewrite engine on whole networks: every rule together keeps the outputs (float64
≤ 1e-12, float32 ≤ 1e-5 relative), reaches a fixed point (optimizing the result applies
nothing), leaves the caller's module alone; the public API, the report, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from plait.graph import RULES, GraphError, Report, RuleOutcome, optimize

from .models import (GPT_LEAF_MODULES, TOLERANCE, DataDependentControlFlow, HasUntraceableBlock, gpt_eval,
                     mobilenet_like, prepare, relative_error, resnet18_like)

RULE_NAMES = ["fold_conv_bn", "fold_linear_bn", "fold_bn_conv", "merge_linear", "remove_dropout",
              "remove_identity", "fold_constants", "cancel_permutes", "inplace_relu"]
NETWORKS = {"resnet18_like": (resnet18_like, ()), "mobilenet_like": (mobilenet_like, ()),
            "gpt_eval": (gpt_eval, GPT_LEAF_MODULES)}
# what every rule together applies to each network, counted by rule
EXPECTED_APPLIED = {
    # 17 conv -> BN in the blocks and stem + 3 downsampling 1x1 conv -> BN; a ReLU after the stem
    # and after each block's first conv (9 in place), the relu after each residual add (8 more);
    # the 5 identity shortcuts removed
    "resnet18_like": {"fold_conv_bn": 20, "remove_identity": 5, "inplace_relu": 17},
    # 7 conv -> BN, Linear -> BN1d in the head, the head's dropout and identity, then its two
    # linears (128 -> 64 -> 10: 64 > 128·10/138, merging pays), 8 ReLU(6)s in place
    "mobilenet_like": {"fold_conv_bn": 7, "fold_linear_bn": 1, "merge_linear": 1, "remove_dropout": 1,
                       "remove_identity": 1, "inplace_relu": 8},
    # the position table's slice and unsqueeze read only a parameter: folded
    "gpt_eval": {"fold_constants": 2},
}


def applied_counts(report: Report) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in report.applied:
        counts[outcome.rule] = counts.get(outcome.rule, 0) + 1
    return counts


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("network", NETWORKS)
def test_all_rules_keep_outputs_and_reach_a_fixed_point(network, dtype):
    build, leaves = NETWORKS[network]
    model, inputs = build(dtype=dtype)
    state_before = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        reference = model(*inputs)
        gm, report = optimize(model, inputs, leaf_modules=leaves)
        error = relative_error(gm(*inputs), reference)
        again, second = optimize(gm, inputs, leaf_modules=leaves)
    assert error <= TOLERANCE[dtype], f"{network}: relative error {error:.3g}\n{report.table()}"
    assert applied_counts(report) == EXPECTED_APPLIED[network], report.table()
    assert second.applied == [], second.table()  # the fixed point: nothing left to apply
    def ops(graph):  # node names may change on re-tracing, the operations may not
        return [(node.op, node.target) for node in graph.nodes]
    assert ops(again.graph) == ops(gm.graph)
    # the caller's module is untouched (optimize works on a deep copy)
    assert model.state_dict().keys() == state_before.keys()
    assert all(torch.equal(model.state_dict()[name], value) for name, value in state_before.items())


@pytest.mark.parametrize("network", NETWORKS)
def test_each_rule_alone_keeps_outputs(network):
    build, leaves = NETWORKS[network]
    model, inputs = build(dtype=torch.float64)
    with torch.no_grad():
        reference = model(*inputs)
        for name in RULES:
            gm, report = optimize(model, inputs, [name], leaf_modules=leaves)
            assert {outcome.rule for outcome in report.outcomes} <= {name}
            error = relative_error(gm(*inputs), reference)
            assert error <= TOLERANCE[torch.float64], f"{network}, {name} alone: relative error {error:.3g}"


def test_rules_registry():
    assert list(RULES) == RULE_NAMES
    for name, rule in RULES.items():
        assert rule.name == name and rule.doc, name


def test_unknown_rule_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown rule name\\(s\\) 'fold_everything'; valid rules: "
                                         + ", ".join(RULE_NAMES)):
        optimize(nn.Linear(2, 2), torch.randn(1, 2), ["fold_conv_bn", "fold_everything"])


def test_bad_arguments():
    with pytest.raises(TypeError, match="optimize needs an nn.Module, got builtin_function_or_method"):
        optimize(torch.relu, torch.randn(2))
    with pytest.raises(TypeError, match="example_inputs must be a tensor or a tuple of tensors, got int"):
        optimize(nn.Linear(2, 2), 3)
    with pytest.raises(TypeError, match="leaf_modules entry 3 is neither"):
        optimize(nn.Linear(2, 2), torch.randn(1, 2), leaf_modules=(3,))
    with pytest.raises(ValueError, match="leaf module name\\(s\\) \\['nope'\\] not found in HasUntraceableBlock"):
        optimize(HasUntraceableBlock(), torch.randn(1, 3, 5, 5), leaf_modules=("nope",))


def test_untraceable_module_names_the_construct_and_the_fix():
    model = prepare(HasUntraceableBlock(), torch.float64)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with pytest.raises(GraphError) as caught:
        optimize(model, x)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert message.startswith("torch.fx cannot trace HasUntraceableBlock inside submodule 'block' "
                              "(DataDependentControlFlow): TraceError: symbolically traced variables cannot be "
                              "used as inputs to control flow.")
    assert "leaf_modules=('block',) or (DataDependentControlFlow,)" in message and "--leaf" in message
    # the suggested fix works, by class or by qualified name, and the rest is still optimized
    for leaves in [(DataDependentControlFlow,), ("block",)]:
        gm, report = optimize(model, x, leaf_modules=leaves)
        assert [(o.rule, o.where) for o in report.applied] == [("fold_conv_bn", "conv -> bn")]
        assert relative_error(gm(x), model(x)) <= TOLERANCE[torch.float64]


def test_report_table_and_dict():
    model, inputs = mobilenet_like()
    model.features[1].train()  # one BN in training mode: refused, the rest applied
    _, report = optimize(model, inputs)
    assert isinstance(report.outcomes[0], RuleOutcome)
    assert [o.where for o in report.refused] == ["features.0 -> features.1"]
    assert report.refused[0].reason.startswith("features.1 is in training mode")
    table = report.table().splitlines()
    assert table[0] == "| rule | where | applied | FLOPs saved | bytes saved | reason |"
    assert len(table) == 2 + len(report.outcomes) + 1
    assert "| fold_conv_bn | features.0 -> features.1 | no | 0 | 0 | features.1 is in training mode" in table[2]
    data = report.as_dict()
    assert data["applied"] == len(report.applied) and data["refused"] == 1
    assert data["predicted_flops_saved"] == sum(o.flops_saved for o in report.applied) == report.predicted_flops_saved
    assert data["predicted_bytes_saved"] == sum(o.bytes_saved for o in report.applied) > 0
    assert data["outcomes"][0].keys() == {"rule", "where", "applied", "reason", "flops_saved", "bytes_saved"}


def test_single_tensor_input_and_graph_module_result():
    model = nn.Sequential(nn.Linear(4, 16), nn.Identity(), nn.Linear(16, 4)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    gm, report = optimize(copy.deepcopy(model), x)  # a bare tensor, not a tuple
    assert isinstance(gm, fx.GraphModule)
    # merge_linear comes first in RULES but sees the identity between; the second pass merges
    assert [o.rule for o in report.applied] == ["remove_identity", "merge_linear"]
    assert relative_error(gm(x), model(x)) <= TOLERANCE[torch.float64]
