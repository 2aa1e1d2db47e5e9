"""`plait plan`: the table and reasons, JSON, fixed choices, a traced module, the
local cluster, and every kind of bad input."""

import json

import pytest
import torch

from plait.cli.main import main


@pytest.fixture(autouse=True)
def no_saved_profile(tmp_path, monkeypatch):
    # --cluster local reads the saved calibration profile; keep the tests off the user's
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))


def test_search_prints_ranked_plans_and_reasons(capsys):
    assert main(["plan", "--model", "gpt-1.3b", "--cluster", "dgx-a100", "--gpus", "16", "--global-batch", "128",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "model: gpt-1.3b" in out and "dgx-a100: 2 node(s) x 8 a100-80gb = 16 devices" in out
    assert "TFLOP/s/GPU" in out and "%peak" in out and "mem GiB" in out
    assert "best: tp=" in out and "why:" in out and "searched" in out
    rows = [line for line in out.splitlines() if line[:2].strip().isdigit()]
    assert len(rows) == 3


def test_json_with_fixed_degrees(capsys):
    assert main(["plan", "--model", "gpt", "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq", "1024",
                 "--vocab", "32000", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64", "--tp", "2",
                 "--no-recompute", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert plans and all(p["tp"] == 2 and p["recompute"] == "none" for p in plans)
    assert plans[0]["step_time_s"] <= plans[-1]["step_time_s"]
    assert set(plans[0]) >= {"tp", "pp", "dp", "micro_batch", "num_microbatches", "schedule", "recompute",
                             "zero_stage", "step_time_s", "tflops_per_gpu", "percent_of_peak", "memory_per_gpu_bytes"}


def test_offload_and_autocast_are_priced_as_plait_train_runs_them(capsys):
    """--offload-activations under GPipe keeps 2 of the 8 micro-batches' activations;
    --precision bf16-mixed under the plait accounting keeps fp32 model state (4+4+8)."""
    base = ["plan", "--model", "gpt", "--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "512",
            "--vocab", "1024", "--cluster", "dgx-a100", "--gpus", "8", "--global-batch", "16", "--pp", "2",
            "--dp", "1", "--tp", "4", "--micro-batch", "2", "--schedule", "gpipe", "--no-recompute",
            "--zero-stage", "0", "--no-sequence-parallel", "--accounting", "plait", "--json"]
    runs = {}
    for name, extra in (("fp32", ["--precision", "fp32"]), ("offload", ["--precision", "fp32", "--offload-activations"]),
                        ("bf16", ["--precision", "bf16-mixed"])):
        assert main(base + extra) == 0
        runs[name] = json.loads(capsys.readouterr().out)[0]
    assert runs["offload"]["offload"] is True and runs["fp32"]["offload"] is False
    kept, offloaded = runs["fp32"]["memory_breakdown_bytes"], runs["offload"]["memory_breakdown_bytes"]
    assert offloaded["activations"] < kept["activations"] / 3  # 2 of 8 micro-batches (plus the working set)
    bf16 = runs["bf16"]["memory_breakdown_bytes"]
    assert bf16["parameters"] == kept["parameters"] and bf16["optimizer"] == kept["optimizer"]
    assert kept["activations"] / 2 < bf16["activations"] < kept["activations"]


def digits_mlp():
    """A module factory for --module: an MLP on scikit-learn digits' shape."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return model, torch.randn(32, 64)


def test_a_traced_module_is_planned_without_tensor_parallelism(capsys):
    assert main(["plan", "--module", "tests.cli.test_plan_cli:digits_mlp", "--cluster", "dgx-a100", "--gpus", "8",
                 "--global-batch", "256", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert plans and all(p["tp"] == 1 for p in plans)
    assert main(["plan", "--module", "tests.cli.test_plan_cli:digits_mlp", "--gpus", "8", "--global-batch", "256",
                 "--tp", "2"]) == 2
    assert "a traced module has no tensor-parallel split" in capsys.readouterr().err


def test_local_cluster_measures_this_machine(capsys):
    assert main(["plan", "--cluster", "local", "--nprocs", "2", "--global-batch", "8", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "measured this machine" in out and "placeholder link" in out
    assert "model: gpt:" in out and "4 layers, hidden 128, 4 heads, seq 64" in out
    assert "precision fp32, activation accounting plait" in out


@pytest.mark.parametrize("argv,message", [
    (["--cluster", "dgx-b9000", "--gpus", "8"], "unknown cluster 'dgx-b9000'; valid: dgx-a100"),
    (["--model", "gpt-7t", "--gpus", "8"], "unknown model preset 'gpt-7t'; valid: gpt-125m"),
    (["--model", "gpt", "--layers", "2", "--gpus", "8"], "--model gpt needs --hidden --heads --seq --vocab"),
    (["--gpus", "12"], "gpus=12 is not a whole number of dgx-a100 nodes"),
    (["--gpus", "8", "--tp", "3"], "tp=3 does not divide the 8 devices"),
    (["--gpus", "8", "--tp", "8", "--model", "gpt-125m"], "tp=8 does not divide heads=12"),
    (["--model", "gpt-175b", "--gpus", "8", "--dp", "1"], "GiB more than the 72.0 GiB available"),
    (["--cluster", "local"], "--cluster local needs --nprocs"),
    (["--module", "nodots", "--gpus", "8"], "factory 'nodots' is not PKG.MOD:FUNCTION"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
    assert main(["plan", "--global-batch", "64", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--module", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
    (["--module", "tests.cli.test_plan_cli:nothing_here"], "module 'tests.cli.test_plan_cli' has no 'nothing_here'; its functions: digits_mlp"),
    (["--module", "tests.cli.test_plan_cli:digits_mlp", "--layers", "4"], "--layers describe a GPT"),
    (["--profile", "x.json"], "--profile is for --cluster local"),
    (["--cluster", "local", "--nprocs", "2", "--nodes", "2"], "--nodes is for DGX clusters"),
])
def test_module_and_flag_mistakes_are_clear_errors(capsys, argv, message):
    assert main(["plan", "--gpus", "8", "--global-batch", "64", *argv]) == 2
    assert message in capsys.readouterr().err


_BOUNDED_RUN = """
import contextlib, io, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # 2 GiB of address space, all told
from plait.cli.main import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = main(["plan", "--gpus", "1048576", "--global-batch", "2097152", *sys.argv[1:]])
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue()}))
"""


def _bounded_plan(*argv: str) -> dict:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _BOUNDED_RUN, *argv], capture_output=True, text=True,
                          timeout=300)  # a hang guard only
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_million_gpus_are_planned_in_bounded_memory():
    """gpt-1.3b on 2^20 A100s, batch 2^21, in 2 GiB of address space: a plan comes
    back (the data-parallel collectives over 2^18 ranks were priced by walking every
    rank, which ran out of memory), and a budget that cuts the search says so."""
    full = _bounded_plan("--json")
    assert full["code"] == 0, full["err"]
    plans = json.loads(full["out"])
    assert plans and plans[0]["rank"] == 1 and plans[0]["tp"] * plans[0]["pp"] * plans[0]["dp"] == 1 << 20
    assert "cut the search" not in full["err"]  # the grid (2,832 layouts) fits the default budget
    cut = _bounded_plan("--max-layouts", "1000", "--top", "3")
    assert cut["code"] == 0, cut["err"]
    rows = [line for line in cut["out"].splitlines() if line[:2].strip().isdigit()]
    assert len(rows) == 3 and "best: tp=" in cut["out"]
    last = cut["out"].splitlines()[-1]
    assert last.startswith("searched ") and "budget max_layouts=1,000 cut the search: micro-batch sizes" in last
    assert "of 5,778 layouts not priced" in last


def test_the_budget_flag_prunes_and_json_stays_a_list(capsys):
    argv = ["plan", "--model", "gpt-1.3b", "--gpus", "16", "--global-batch", "128", "--max-layouts", "200"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    plans = json.loads(captured.out)
    assert isinstance(plans, list) and plans and set(plans[0]) >= {"rank", "tp", "pp", "dp", "step_time_s"}
    assert captured.err.startswith("plait plan: budget max_layouts=200 cut the search:")
    assert "of 3,018 layouts not priced" in captured.err
    assert main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "budget max_layouts=200 cut the search" in last and "of 3,018 layouts not priced" in last


@pytest.mark.parametrize("argv,message", [
    (["--gpus", str(1 << 30)], "gpus=1,073,741,824 is above the limit of 16,777,216"),
    (["--nodes", str(1 << 28)], "nodes=268,435,456 is above the limit of 2,097,152 (16,777,216 devices)"),
    (["--gpus", "8", "--global-batch", str(1 << 40)],
     "global_batch=1,099,511,627,776 is above the limit of 4,294,967,296"),
    (["--gpus", "8", "--max-micro-batch", str(1 << 20)], "max_micro_batch=1,048,576 is above the limit of 65,536"),
    (["--gpus", "8", "--top", str(10 ** 6)], "top=1,000,000 is above the limit of 10,000"),
    (["--gpus", "8", "--max-layouts", "0"], "max_layouts=0 must be a whole number >= 1"),
    (["--cluster", "local", "--nprocs", str(1 << 30)], "nprocs=1,073,741,824 is above the limit of 16,777,216"),
])
def test_absurd_values_are_clear_errors_before_any_work(capsys, argv, message):
    assert main(["plan", "--global-batch", "64", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("plait plan: error: ") and message in captured.err
    assert "measured this machine" not in captured.out  # refused before measuring anything


def test_explain_run_refuses_a_non_run_with_status_2_and_says_what_it_prices_with(tmp_path, capsys):
    assert main(["plan", "--explain-run", str(tmp_path)]) == 2
    assert "not a finished plait train run (no config.toml or report.json)" in capsys.readouterr().err
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "report.json").write_text(json.dumps({"ranks": []}))  # an older plait's report: no step parts
    assert main(["plan", "--explain-run", str(tmp_path)]) == 2
    assert "has no measured step parts" in capsys.readouterr().err
    assert main(["plan", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "re-priced now with today's saved profiles" in help_text and "every other flag is ignored" in help_text
