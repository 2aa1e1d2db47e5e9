"""`plait plan --auto`: a factory's training step planned, the table printed, the plan,
SVG and DOT written (or the plan as JSON on stdout); flags that do not apply refused by
name."""

import json
import xml.etree.ElementTree as ElementTree

import pytest
import torch
from torch import nn

from plait.cli.main import main
from plait.plan.auto.plan_file import load_plan, read_plan

FACTORY = "tests.cli.test_plan_auto:mlp_step"


class MLPStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(512, 2048), nn.Linear(2048, 512)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def mlp_step():
    """A --module factory: an MLP with its loss, on a batch of 64."""
    torch.manual_seed(0)
    return MLPStep(), (torch.randn(64, 512), torch.randn(64, 512))


def not_a_step():
    """A factory whose module returns activations, not a loss."""
    return nn.Linear(4, 4), torch.randn(2, 4)


def test_plan_auto_prints_the_table_and_writes_plan_svg_dot(tmp_path, capsys):
    files = {kind: tmp_path / f"plan.{kind}" for kind in ("json", "svg", "dot")}
    assert main(["plan", "--auto", "--module", FACTORY, "--cluster", "dgx-a100", "--gpus", "4", "--mesh", "2x2",
                 "--save", str(files["json"]), "--svg", str(files["svg"]), "--dot", str(files["dot"])]) == 0
    out = capsys.readouterr().out
    assert "mesh 2x2 (4 devices)" in out and "predicted step" in out and "memory" in out
    assert "chosen sharding" in out and "fc1 " in out and "fc2 " in out  # the group's row names its linears
    assert "why: the best plan on each mesh" in out and "all replicated" in out and "data parallel" in out
    assert "wrote plan: " in out and "wrote picture: " in out
    saved = load_plan(files["json"])
    assert saved.mesh.shape == (2, 2) and saved.source == FACTORY and saved.input_shapes == ((64, 512),) * 2
    assert ElementTree.parse(files["svg"]).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    assert files["dot"].read_text().startswith("digraph auto_plan {")
    # --json: the plan document alone on stdout, the batch resized by --global-batch
    assert main(["plan", "--auto", "--module", FACTORY, "--gpus", "4", "--mesh", "4", "--global-batch", "32",
                 "--json"]) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert read_plan(document).mesh.shape == (4,) and document["model"]["input_shapes"] == [[32, 512], [32, 512]]
    assert "predicted step" not in captured.out


@pytest.mark.parametrize("argv, message", [
    (["--auto", "--module", FACTORY, "--tp", "2"], "with --auto these do not apply: --tp"),
    (["--auto", "--module", FACTORY, "--schedule", "1f1b", "--layers", "2"], "--layers; --schedule"),
    (["--auto", "--model", "gpt-1.3b"], "--model gpt-1.3b (--auto plans a traced model"),
    (["--module", FACTORY, "--mesh", "2x2", "--global-batch", "8"], "--mesh: only with --auto"),
    (["--auto", "--module", FACTORY, "--mesh", "3x3"], "mesh 3x3 has 9 devices; the cluster has 8"),
    (["--auto", "--module", FACTORY, "--mesh", "2x2x2"], "--mesh '2x2x2' must be N or AxB"),
    (["--auto", "--module", "tests.cli.test_plan_auto:not_a_step"], "must return the scalar loss"),
])
def test_what_does_not_apply_is_refused_by_name(argv, message, capsys):
    assert main(["plan", "--cluster", "dgx-a100", "--gpus", "8", *argv]) == 2
    assert message in capsys.readouterr().err



def test_an_hf_model_is_planned_with_its_loss(tmp_path, capsys):
    """--model hf:CONFIG: the causal LM and its next-token loss on --global-batch sequences
    of --seq tokens, its parameters named lm.<HF name>."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8).save_pretrained(tmp_path)
    assert main(["plan", "--auto", "--model", f"hf:{tmp_path}", "--seq", "8", "--global-batch", "4",
                 "--cluster", "dgx-a100", "--gpus", "2", "--mesh", "2", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["model"]["source"] == f"hf:{tmp_path}"
    assert document["model"]["input_shapes"] == [[4, 8], [4, 8]]
    params = {name for node in document["nodes"] for name in node["params"]}
    assert {"lm.transformer.wte.weight", "lm.transformer.h.0.mlp.c_fc.weight"} <= params
    assert main(["plan", "--auto", "--model", f"hf:{tmp_path}", "--gpus", "2"]) == 2
    assert "--auto --model hf: needs --global-batch N" in capsys.readouterr().err


def float64_step():
    """A float64 factory (plait's parity tests train such models on this CPU)."""
    torch.manual_seed(0)
    return MLPStep().double(), (torch.randn(8, 512, dtype=torch.float64), torch.randn(8, 512, dtype=torch.float64))


def test_the_local_cluster_is_measured_in_the_models_dtype(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))  # not the user's saved calibration
    assert main(["plan", "--auto", "--module", "tests.cli.test_plan_auto:float64_step", "--cluster", "local",
                 "--nprocs", "2", "--mesh", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert "peak TFLOP/s float64" in captured.err  # the measured device line
    assert json.loads(captured.out)["mesh"] == [2]
