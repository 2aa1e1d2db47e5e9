"""Each rewrite rule alone, on small modules: outputs unchanged (float64 ≤ 1e-12 and float32
≤ 1e-5 relative, see models.TOLERANCE), the pattern gone from the graph, and each
precondition refusing with its reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import fuse_modules
from torch.fx.experimental.optimization import fuse

from plait.graph import RULES, optimize
from plait.graph.merge_linear import linear_flops_per_row

from .models import (TOLERANCE, BnConv, BnUsedTwice, ConvBn, FunctionalDropout, LinearBn, LinearsAroundDropout,
                     ParameterArithmetic, PermuteUsedTwice, Permutes, RandomParameterNoise, ReluKinds, ReluRefusals,
                     TiedConvs, TwoLinears, TwoLinearsShared, WithIdentity, conv_bn_shared, conv_called_twice,
                     prepare, relative_error)

DTYPES = (torch.float64, torch.float32)


def run(module: nn.Module, inputs: tuple, rules, dtype=torch.float64):
    """Optimize with ``rules``; check the outputs against the original; return (gm, report)."""
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    with torch.no_grad():
        reference = module(*inputs)
        gm, report = optimize(module, inputs, rules)
        error = relative_error(gm(*inputs), reference)
    assert error <= TOLERANCE[dtype], f"{rules}: relative error {error:.3g} > {TOLERANCE[dtype]:g}\n{report.table()}"
    for outcome in report.applied:  # applied only where the predicted gain is not negative
        assert outcome.flops_saved >= 0 and outcome.bytes_saved >= 0, outcome
    return gm, report


def module_types(gm) -> list[type]:
    return [type(gm.get_submodule(node.target)) for node in gm.graph.nodes if node.op == "call_module"]


def reasons(report) -> list[str]:
    return [outcome.reason for outcome in report.refused]


# ---- fold_conv_bn ---------------------------------------------------------------------

CONVS = {  # name: (conv, bn, input shape)
    "conv2d": (lambda: nn.Conv2d(3, 6, 3), lambda: nn.BatchNorm2d(6), (2, 3, 7, 7)),
    "padded_strided_nobias": (lambda: nn.Conv2d(3, 6, 3, stride=2, padding=2, bias=False),
                              lambda: nn.BatchNorm2d(6), (2, 3, 9, 9)),
    "grouped_dilated": (lambda: nn.Conv2d(4, 6, 3, dilation=2, groups=2, padding=1),
                        lambda: nn.BatchNorm2d(6), (2, 4, 9, 9)),
    "depthwise_reflect": (lambda: nn.Conv2d(5, 5, 3, groups=5, padding=1, padding_mode="reflect"),
                          lambda: nn.BatchNorm2d(5), (2, 5, 8, 8)),
    "conv1d": (lambda: nn.Conv1d(3, 4, 5, padding=2), lambda: nn.BatchNorm1d(4), (2, 3, 11)),
    "conv3d_bn_no_affine": (lambda: nn.Conv3d(2, 3, 3), lambda: nn.BatchNorm3d(3, affine=False), (2, 2, 5, 5, 5)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", CONVS)
def test_fold_conv_bn_is_exact_for_every_conv_kind(kind, dtype):
    conv, bn, shape = CONVS[kind]
    model = prepare(ConvBn(conv(), bn()), dtype)
    gm, report = run(model, (torch.randn(shape),), ["fold_conv_bn"], dtype)
    assert [(o.rule, o.where) for o in report.applied] == [("fold_conv_bn", "conv -> bn")]
    assert not any(issubclass(t, nn.modules.batchnorm._BatchNorm) for t in module_types(gm))
    if kind == "conv2d":  # 2 FLOPs per element of the BN's (2, 6, 5, 5) output; the conv had a bias
        itemsize = torch.empty((), dtype=dtype).element_size()
        assert (report.applied[0].flops_saved, report.applied[0].bytes_saved) == (
            2 * (2 * 6 * 5 * 5), (2 * (2 * 6 * 5 * 5) + 4 * 6) * itemsize)


def test_fold_conv_bn_refusals():
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    training = prepare(ConvBn(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), torch.float64)
    training.bn.train()
    assert reasons(optimize(training, x, ["fold_conv_bn"])[1]) == [
        "bn is in training mode (it normalises by the batch's statistics; call .eval())"]
    no_stats = prepare(ConvBn(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)), torch.float64)
    assert "bn has no running statistics (track_running_stats=False" in reasons(
        optimize(no_stats, x, ["fold_conv_bn"])[1])[0]
    _, report = run(prepare(TiedConvs(), torch.float64), (x,), ["fold_conv_bn"])
    assert reasons(report) == [
        "conv_a.weight is tied to conv_b.weight (rewriting it would untie them: two copies of the weights)"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pytorch_104593_output_used_twice_is_not_folded(dtype):
    """y = conv(x); bn(y) + y: folding would change y for the add. torch.ao's fuse_modules
    folds it anyway (wrong); plait refuses and stays exact."""
    model, inputs = conv_bn_shared(dtype=dtype)
    gm, report = run(model, inputs, ["fold_conv_bn"], dtype)
    assert report.applied == []
    assert reasons(report) == ["conv's output is also used by add (rewriting it would change that use)"]
    fused = fuse_modules(model, [["conv", "bn"]])
    assert relative_error(fused(*inputs), model(*inputs)) > 0.05  # the peer's wrong answer


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_called_twice_is_not_folded_where_fx_fuse_is_wrong(dtype):
    """bn(conv(x)) + conv(2x): torch.fx.experimental.optimization.fuse rewrites the conv module,
    so the second call gets the BN too (wrong); plait refuses."""
    model, inputs = conv_called_twice(dtype=dtype)
    gm, report = run(model, inputs, None, dtype)
    assert report.applied == []
    assert reasons(report) == [
        "conv is called at 2 places (conv, conv_1); changing its weights would change every call"]
    fused = fuse(model)
    assert relative_error(fused(*inputs), model(*inputs)) > 0.05


# ---- fold_linear_bn -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_fold_linear_bn(dtype, bias):
    gm, report = run(prepare(LinearBn(bias=bias), dtype), (torch.randn(7, 6),), ["fold_linear_bn"], dtype)
    assert [o.where for o in report.applied] == ["linear -> bn"]
    assert module_types(gm) == [nn.Linear]
    # BN: 2 FLOPs per element; a new bias costs 1 add per element
    assert report.applied[0].flops_saved == 7 * 5 * (2 if bias else 1)


def test_fold_linear_bn_refuses_a_sequence_layout():
    """Linear on (N, L, C) then BatchNorm1d normalises dim 1 = L, not the linear's features."""
    model = prepare(LinearBn(6, 5), torch.float64)
    model.bn = nn.BatchNorm1d(4).double().eval()
    _, report = run(model, (torch.randn(3, 4, 6),), ["fold_linear_bn"])
    assert reasons(report) == ["linear's output has shape (3, 4, 5): BatchNorm1d normalises dim 1, which is the "
                               "linear's features only for (N, features)"]


# ---- fold_bn_conv ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv", [lambda: nn.Conv2d(4, 6, 3, stride=2, dilation=2),
                                  lambda: nn.Conv2d(4, 6, 1, bias=False, padding="valid")],
                         ids=["strided_dilated", "1x1_no_bias"])
def test_fold_bn_conv(dtype, conv):
    gm, report = run(prepare(BnConv(nn.BatchNorm2d(4), conv()), dtype), (torch.randn(2, 4, 9, 9),),
                     ["fold_bn_conv"], dtype)
    assert [o.where for o in report.applied] == ["bn -> conv"]
    assert module_types(gm) == [nn.Conv2d]


def test_fold_bn_conv_refusals():
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    padded = prepare(BnConv(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1)), torch.float64)
    assert reasons(run(padded, (x,), ["fold_bn_conv"])[1]) == [
        "conv is padded (padding=(1, 1)): its zero padding comes after bn in the original, which the folded "
        "conv would not reproduce"]
    grouped = prepare(BnConv(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, groups=2)), torch.float64)
    assert reasons(run(grouped, (x,), ["fold_bn_conv"])[1]) == [
        "conv is grouped (groups=2): only an ungrouped conv sees every BN channel in every output channel"]
    assert reasons(run(prepare(BnUsedTwice(), torch.float64), (x,), ["fold_bn_conv"])[1]) == [
        "bn's output is also used by getitem (rewriting it would change that use)"]
    training = prepare(BnConv(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3)), torch.float64, train=True)
    assert reasons(optimize(training, x, ["fold_bn_conv"])[1])[0].startswith("bn is in training mode")


# ---- merge_linear ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias1,bias2", [(True, True), (False, True), (True, False), (False, False)])
def test_merge_linear(dtype, bias1, bias2):
    model = TwoLinears(6, 32, 5, bias1, bias2).to(dtype)
    gm, report = run(model, (torch.randn(3, 4, 6),), ["merge_linear"], dtype)  # rows = 3·4
    assert [o.where for o in report.applied] == ["first -> second"]
    assert module_types(gm) == [nn.Linear]
    merged = gm.get_submodule("second")
    assert (merged.in_features, merged.out_features, merged.bias is not None) == (6, 5, bias1 or bias2)
    has_bias = bias1 or bias2
    expected = 12 * (linear_flops_per_row(model.first) + linear_flops_per_row(model.second)
                     - (2 * 6 * 5 + (5 if has_bias else 0)))
    assert report.applied[0].flops_saved == expected


def test_merge_linear_refuses_a_bottleneck():
    """mid = 4 < in·out/(in+out) = 64·64/128 = 32: two layers cost 2·(64·4 + 4·64) = 1,024 FLOPs
    per row plus biases, one merged layer 2·64·64 = 8,192: refused."""
    model = TwoLinears(64, 4, 64).double()
    gm, report = run(model, (torch.randn(5, 64),), ["merge_linear"])
    assert module_types(gm) == [nn.Linear, nn.Linear]
    (refusal,) = report.refused
    rows = 5
    flops_added = rows * ((2 * 64 * 64 + 64) - (2 * 64 * 4 + 4 + 2 * 4 * 64 + 64))
    assert refusal.reason.startswith(f"predicted gain is not positive (FLOPs +{flops_added:,}, bytes +")
    # just above the threshold mid = 32 the merge pays
    assert run(TwoLinears(64, 33, 64).double(), (torch.randn(5, 64),), ["merge_linear"])[1].applied


def test_merge_linear_refuses_a_shared_intermediate():
    _, report = run(TwoLinearsShared(6, 32, 5).double(), (torch.randn(3, 6),), ["merge_linear"])
    assert reasons(report) == ["first's output is also used by sum_1 (rewriting it would change that use)"]


# ---- remove_dropout, remove_identity ----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_remove_dropout_then_merge(dtype):
    """Linear -> Dropout (eval) -> Linear: the dropout goes, then the linears merge (a second pass)."""
    gm, report = run(LinearsAroundDropout().to(dtype).eval(), (torch.randn(3, 8),), None, dtype)
    assert [(o.rule, o.where) for o in report.applied] == [("remove_dropout", "drop"),
                                                          ("merge_linear", "first -> second")]
    assert module_types(gm) == [nn.Linear]


def test_remove_dropout_refuses_training_mode():
    model = LinearsAroundDropout().double()  # nn.Module starts in training mode
    _, report = optimize(model, torch.randn(3, 8, dtype=torch.float64), ["remove_dropout"])
    assert reasons(report) == ["drop is in training mode (it zeroes random elements; call .eval())"]


def test_functional_dropout():
    x = torch.randn(4, 6, dtype=torch.float64)
    gm, report = run(FunctionalDropout(training=False).double(), (x,), ["remove_dropout"])
    assert [o.where for o in report.applied] == ["dropout"]
    assert all(node.target is not F.dropout for node in gm.graph.nodes)
    _, report = optimize(FunctionalDropout(training=True).double(), x, ["remove_dropout"])
    assert reasons(report) == ["dropout is called with training=True (it zeroes random elements)"]


def test_remove_identity():
    gm, report = run(WithIdentity().double(), (torch.randn(4, 6),), ["remove_identity"])
    assert [(o.where, o.flops_saved, o.bytes_saved) for o in report.applied] == [("keep", 0.0, 0.0)]
    assert module_types(gm) == [nn.Linear]


# ---- fold_constants ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_fold_constants(dtype):
    gm, report = run(ParameterArithmetic().to(dtype), (torch.randn(3, 6),), ["fold_constants"], dtype)
    folded = {o.where: (o.flops_saved, o.bytes_saved) for o in report.applied}
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert folded["t"] == (0.0, 0.0)  # a view: saves its call only
    assert folded["mul"] == (5.0, 10.0 * itemsize)  # scale * 2: 5 FLOPs, 5 read + 5 written
    assert folded["add"] == (5.0, 10.0 * itemsize)  # (scale * 2) + 1: next round, once mul is a buffer
    assert folded["matmul_1"] == (2 * 5 * 3 * 5.0, (15 + 15 + 25) * itemsize)  # left @ right
    remaining = [node.op for node in gm.graph.nodes if node.op in ("call_function", "call_method")]
    assert len(remaining) == 4  # x @ W', y * s', y @ M', + : only what reads the input
    assert all(not p.requires_grad for p in gm.buffers())


def test_fold_constants_never_folds_random_ops():
    _, report = optimize(RandomParameterNoise(), torch.randn(4), ["fold_constants"])
    assert report.outcomes == []


# ---- cancel_permutes ---------------------------------------------------------------------

def test_cancel_permutes():
    gm, report = run(Permutes(), (torch.randn(2, 3, 4),), ["cancel_permutes"])
    assert sorted(o.where for o in report.applied) == ["permute -> permute_1", "transpose -> transpose_1"]
    names = [node.name for node in gm.graph.nodes]
    assert "permute_2" in names and "permute_3" in names  # (1,0,2) then (0,2,1) is not the identity


def test_cancel_permutes_refuses_a_shared_intermediate():
    _, report = run(PermuteUsedTwice(), (torch.randn(2, 3, 4),), ["cancel_permutes"])
    assert reasons(report) == ["permute's output is also used by sum_1 (rewriting it would change that use)"]


# ---- inplace_relu ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_relu(dtype):
    gm, report = run(ReluKinds().to(dtype), (torch.randn(2, 3, 6, 6),), ["inplace_relu"], dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert {o.where: o.bytes_saved for o in report.applied} == {  # each relu's output, no longer allocated
        "conv -> relu": 2 * 4 * 4 * 4 * itemsize, "linear -> relu_1": 2 * 4 * itemsize,
        "add -> relu_2": 2 * 4 * itemsize}
    assert sum(node.target is torch.relu_ for node in gm.graph.nodes) == 3


def test_inplace_relu_refusals():
    x = torch.randn(3, 4, dtype=torch.float64)
    _, report = run(ReluRefusals().double(), (x,), ["inplace_relu"])
    assert reasons(report) == [
        "relu's input x is a graph input (in place would modify the caller's tensor)",
        "linear's output is also used by add (rewriting it would change that use)",
        "relu_2's input comes from view (view), not a conv/linear or another op known to return a fresh "
        "tensor (in place could overwrite a tensor it views)"]


def test_every_rule_has_a_test_here():
    tested = {"fold_conv_bn", "fold_linear_bn", "fold_bn_conv", "merge_linear", "remove_dropout",
              "remove_identity", "fold_constants", "cancel_permutes", "inplace_relu"}
    assert set(RULES) == tested
