"""`plait plan --model hf:CONFIG` and `--module ... --tp-plan`: tensor parallelism of a
user's model priced from its plan, and the mistakes refused by name."""

import pytest
import torch

from plait.cli.main import main

# a Sequential MLP split as Megatron's MLP: fc1 by columns, fc2 by rows
MLP_PLAN = {"0": "colwise", "2": "rowwise"}


def mlp_factory():
    """A module factory for --module: batch 4 of width 16, hidden 32."""
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)), torch.randn(4, 16)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from transformers import GPT2Config

    directory = tmp_path_factory.mktemp("gpt2")
    GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16).save_pretrained(directory)
    return directory


def test_hf_model_is_priced_under_its_plan(capsys, gpt2_dir):
    """b=2, s=8, h=32, V=64 at tp=2, bf16-mixed as plait train runs it (autocast over fp32
    weights): per micro-batch 10 all-reduces: the two rowwise outputs of each block are
    bfloat16 (b·s·h·2 = 1,024 bytes, 4 calls), the embedding's output and the gradients
    of the colwise inputs (the LayerNorm outputs, float32 under autocast: b·s·h·4 =
    2,048 bytes; 1 + 4 + the head's 1) = 16,384 bytes; the logits' all-gather is
    bfloat16 (b·s·V·2 = 2,048 bytes)."""
    argv = ["plan", "--model", f"hf:{gpt2_dir}", "--seq", "8", "--gpus", "8", "--global-batch", "8", "--tp", "2",
            "--micro-batch", "2", "--no-sequence-parallel", "--no-recompute", "--top", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(GPT2LMHeadModel): 28,032 parameters, 2 blocks, tp plan of 5 colwise, 4 rowwise, 1 vocab" in out
    assert "tensor-parallel plan (5 colwise, 4 rowwise, 1 vocab, 6 sequence, 1 replicate) at tp=2:" in out
    assert "all_reduce per step: 10 calls of 16,384 bytes in all" in out
    assert "all_gather per step: 1 calls of 2,048 bytes in all" in out
    assert "best: tp=2 pp=1 dp=4 mb=2 m=1 none" in out


def test_module_with_a_tp_plan_prices_tensor_parallelism(capsys):
    """The MLP's fc1 sees the data (no input gradient: no backward all-reduce), fc2's output
    is all-reduced forward: 4·16·4 bytes per micro-batch of 4 in float32."""
    argv = ["plan", "--module", "tests.cli.test_plan_tp_cli:mlp_factory", "--tp-plan",
            "tests.cli.test_plan_tp_cli:MLP_PLAN", "--gpus", "8", "--global-batch", "16", "--tp", "2",
            "--micro-batch", "4", "--precision", "fp32", "--top", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tp plan of 1 colwise, 1 rowwise" in out and "best: tp=2 " in out
    assert "all_reduce per step: 1 calls of 256 bytes in all" in out


@pytest.mark.parametrize("argv,message", [
    (["--model", "hf:/no/such/dir"], "--model hf:/no/such/dir: /no/such/dir does not exist"),
    (["--model", "hf:GPT2", "--layers", "4"], "--layers describe a GPT; --model hf: traces its own model"),
    (["--model", "gpt-125m", "--tp-plan", "x:y"], "--tp-plan is for --module or --model hf:"),
    (["--module", "tests.cli.test_plan_tp_cli:mlp_factory", "--tp-plan", "tests.cli.test_plan_tp_cli:nope"],
     "--tp-plan 'tests.cli.test_plan_tp_cli:nope': module 'tests.cli.test_plan_tp_cli' has no 'nope'"),
    (["--module", "tests.cli.test_plan_tp_cli:mlp_factory", "--tp-plan", "tests.cli.test_plan_tp_cli:mlp_factory"],
     "--tp-plan 'tests.cli.test_plan_tp_cli:mlp_factory': calling it on the Sequential raised TypeError"),
])
def test_tp_plan_mistakes_are_clear_errors(capsys, argv, message):
    assert main(["plan", "--gpus", "8", "--global-batch", "16", *argv]) == 2
    assert message in capsys.readouterr().err
