"""`plait optimize PKG.MOD:FUNCTION`: the rules' table, the equivalence check, --bench
with the peers, --report, and each bad input's message. The FUNCTIONs are below
(this test module is importable under its own __name__ while it runs)."""

import json

import pytest
import torch
from torch import nn

from plait.cli.main import main
from plait.cli.optimize import resolve_leaves, with_batch
from plait.graph import examples

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Tiny(nn.Module):
    """conv + BN + ReLU, a dropout and an identity: fold_conv_bn, remove_dropout, remove_identity fire."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.drop = nn.Dropout(0.5)
        self.skip = nn.Identity()

    def forward(self, x):
        return self.skip(self.drop(self.relu(self.bn(self.conv(x)))))


def tiny():
    model = examples.randomize_batchnorm(Tiny(), torch.Generator().manual_seed(0)).eval()
    return model, (torch.randn(2, 3, 8, 8),)


def tiny_training():
    """Dropout (and BN) in training mode: the outputs differ from run to run."""
    model, inputs = tiny()
    return model.train(), inputs


def bare_module():
    return tiny()[0]


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a tensor's value: torch.fx cannot trace it
            return x
        return -x


def untraceable():
    return DataDependent(), (torch.randn(2, 3),)


def not_a_tuple():
    return [tiny()[0]]


TARGET = f"{__name__}:tiny"


def run(capsys, *argv):
    status = main(["optimize", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_prints_what_fired_and_checks_equivalence(capsys):
    status, out, err = run(capsys, TARGET)
    assert status == 0, err
    assert "| fold_conv_bn | conv -> bn | yes |" in out
    assert "remove_dropout" in out and "remove_identity" in out
    assert "equivalence: relative error" in out and "(tolerance 1e-05): ok" in out
    assert "| variant |" not in out  # no timing without --bench


def test_rules_flag_selects_and_dtype_batch_apply(capsys):
    status, out, err = run(capsys, TARGET, "--rules", "remove_dropout", "--dtype", "float64", "--batch", "5")
    assert status == 0, err
    assert "rules fired: remove_dropout x1;" in out and "fold_conv_bn" not in out
    assert "inputs (5, 3, 8, 8) float64" in out and "(tolerance 1e-12): ok" in out


def test_bench_and_report(capsys, tmp_path):
    status, out, err = run(capsys, TARGET, "--bench", "--repeats", "1", "--report", str(tmp_path / "r"))
    assert status == 0, err
    for variant in ("eager (before)", "traced, no rules", "plait optimize", "torch.fx fuse", "fuse_modules"):
        assert f"| {variant} | yes (" in out, variant
    assert "predicted:" in out
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["equivalence"]["ok"] and report["rules_fired"].startswith("fold_conv_bn x1")
    names = [row["name"] for row in report["bench"]["rows"]]
    assert names == ["eager (before)", "traced, no rules", "plait optimize", "torch.fx fuse", "fuse_modules"]
    assert all(len(row["timing"]["latencies_s"]) == 1 for row in report["bench"]["rows"])
    assert "| fold_conv_bn |" in (tmp_path / "r" / "report.md").read_text()
    for picture in ("graph-before.png", "graph-after.png"):
        assert (tmp_path / "r" / picture).read_bytes()[:8] == PNG_MAGIC


def test_bench_shows_where_fx_fuse_is_wrong(capsys):
    status, out, err = run(capsys, "plait.graph.examples:conv_called_twice", "--bench", "--repeats", "1")
    assert status == 0, err
    assert "conv is called at 2 places" in out  # plait refuses, with the reason
    assert "| plait optimize | yes (0) |" in out
    assert "| torch.fx fuse | **WRONG** (0.28) |" in out


def test_changed_outputs_stop_before_timing(capsys):
    status, out, err = run(capsys, f"{__name__}:tiny_training", "--bench")
    assert status == 1
    assert "OUTPUTS CHANGED; largest difference" in out and "reference" in out
    assert "not deterministic" in out and "call module.eval()" in out and "not timing (--bench)" in out
    assert "| variant |" not in out
    assert "bn is in training mode" in out and "drop is in training mode" in out  # the refusals say why


@pytest.mark.parametrize("target, message", [
    ("no_colon_here", "factory 'no_colon_here' is not PKG.MOD:FUNCTION"),
    ("no_such_package_xyz.mod:f", "cannot import 'no_such_package_xyz.mod'"),
    (f"{__name__}:missing", f"module '{__name__}' has no 'missing'"),
    (f"{__name__}:TARGET", f"names a str ({TARGET!r}), not a function"),
    (f"{__name__}:bare_module", "returned a bare Tiny: return (module, example_inputs)"),
    (f"{__name__}:not_a_tuple", "returned 1 items (Tiny), not 2: it must name a function"),
])
def test_bad_target(capsys, target, message):
    status, out, err = run(capsys, target)
    assert status == 2
    assert message in err and "Traceback" not in err


def test_unknown_rule_is_named_with_the_valid_ones(capsys):
    status, _, err = run(capsys, TARGET, "--rules", "fold_conv_bn,fold_everything")
    assert status == 2
    assert "'fold_everything'" in err and "fold_conv_bn, fold_linear_bn" in err


def test_untraceable_module_names_the_construct_and_suggests_leaves(capsys):
    status, _, err = run(capsys, f"{__name__}:untraceable")
    assert status == 2
    assert "torch.fx cannot trace DataDependent" in err and "control flow" in err and "--leaf" in err


def test_gpt_needs_its_leaves(capsys):
    status, _, err = run(capsys, "plait.graph.examples:gpt_eval")
    assert status == 2 and "torch.fx cannot trace GPTEval" in err
    status, out, err = run(capsys, "plait.graph.examples:gpt_eval", "--leaf", "plait.graph.examples:GPT_LEAF_MODULES")
    assert status == 0, err
    assert "(tolerance 1e-05): ok" in out


def test_bad_leaf_names(capsys):
    status, _, err = run(capsys, TARGET, "--leaf", "plait.graph.examples:SEED")
    assert status == 2 and "not an nn.Module class" in err
    status, _, err = run(capsys, TARGET, "--leaf", "no.such.block")
    assert status == 2 and "no.such.block" in err
    status, _, err = run(capsys, TARGET, "--leaf", "./blocks.py:Block")  # a file path: it was a traceback
    assert status == 2 and "--leaf './blocks.py:Block' is a file path, not PKG.MOD:CLASS: write blocks:Block" in err


def test_leaf_resolution_and_batch_resizing():
    assert resolve_leaves(("blocks.0", "plait.graph.examples:GPT_LEAF_MODULES")) == (
        "blocks.0", *examples.GPT_LEAF_MODULES)
    tokens = torch.tensor([[1, 2], [3, 4]])
    assert with_batch((tokens, torch.tensor(7.0)), 3)[0].tolist() == [[1, 2], [3, 4], [1, 2]]
    assert with_batch((tokens,), 1)[0].tolist() == [[1, 2]]
    assert with_batch((torch.tensor(7.0),), 3)[0].item() == 7.0
