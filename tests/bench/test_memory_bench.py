"""`plait bench memory` (plait.bench.memory, plait.bench.memory_peers): the frontier's
maths, bad flags named, one real `plait train` run measured against plait's formula,
and the peers' step run for each variant on a tiny GPT."""

import json

import pytest
import torch

from plait.bench.memory import MemoryBenchConfig, paper_formula_bytes, pareto, gpt_spec
from plait.bench.memory_peers import VARIANTS, run_peers
from plait.cli.main import main


def test_the_frontier_keeps_what_nothing_beats_on_both():
    points = [(1.0, 50.0), (2.0, 10.0), (1.5, 60.0), (3.0, 10.0), (0.5, 100.0), (2.5, 5.0)]
    assert pareto(points) == [4, 0, 1, 5]  # (1.5, 60) and (3, 10) are beaten


def test_the_published_formula_is_korthikantis():
    """sbh(34 + 5as/h) per layer at t = 1, sbh(10 + 24/t) selective, 2sbh full; times
    the stage's layers and GPipe's m micro-batches in flight."""
    config = MemoryBenchConfig(seq_len=64, hidden=32, heads=4, layers=4, micro_batch=2, global_batch=8)
    spec = gpt_spec(config, vocab=50)
    s, b, h, a = 64, 2, 32, 4
    m = 8 // (2 * 2)  # dp 2
    assert paper_formula_bytes(config, spec, (2, 1, 2), "none") == s * b * h * (34 + 5 * a * s / h) * 2 * m
    assert paper_formula_bytes(config, spec, (1, 2, 2), "selective") == s * b * h * (10 + 12) * 2 * (8 // 2)
    assert paper_formula_bytes(config, spec, (2, 1, 2), "full") == 2 * s * b * h * 2 * m


@pytest.mark.parametrize("argv,message", [
    (["--precisions", "fp8"], "--precisions: unknown 'fp8'; valid: fp32, bf16-mixed, fp16-mixed"),
    (["--recompute", "most"], "--recompute: unknown 'most'; valid: none, selective, full"),
    (["--global-batch", "6"], "global batch 6 is not a multiple of dp(2) x micro-batch (2)"),
    (["--steps", "1"], "--steps 1: at least 2"),
])
def test_bad_flags_are_named_before_any_run(capsys, argv, message, tmp_path):
    assert main(["bench", "memory", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_each_peer_variant_trains_the_same_model():
    """One round, one step of every variant on a tiny GPT: each finishes, the pairs
    are reported, and offload's files are gone afterwards (a temporary directory)."""
    torch.manual_seed(0)
    result = run_peers(seq_len=16, layers=2, hidden=32, heads=4, batch=1, microbatches=3, vocab=50, rounds=1,
                       steps=1)
    assert [row["variant"] for row in result["rows"]] == list(VARIANTS)
    assert all(row["step_s"] > 0 for row in result["rows"])
    assert [(p["plait"], p["peer"]) for p in result["pairs"]] == [
        ("plait-full", "torch-full"), ("plait-offload", "torch-save-on-cpu"), ("plait-fp16", "torch-fp16")]


@pytest.mark.slow
def test_one_real_run_is_measured_against_plaits_formula(tmp_path, capsys):
    """dp2 x pp2, fp32, GPipe, s = 128: the measured peak of saved activations (live
    storages, largest rank) equals plait's formula exactly (no recomputation, fp32:
    the accounting counts plait's GPT tensor by tensor); model state within 0.1%: AdamW
    also keeps a step count per parameter tensor, a scalar the plan leaves out; the
    PNG and summary exist."""
    status = main(["bench", "memory", "--meshes", "2x1x2", "--recompute", "none", "--precisions", "fp32",
                   "--offload", "off", "--seq-len", "128", "--steps", "2", "--no-peers", "--out", str(tmp_path)])
    assert status == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    (row,) = summary["rows"]
    assert row["measured"]["activations_bytes"] == row["predicted"]["activations_bytes"]
    assert row["measured"]["model_state_bytes"] == pytest.approx(row["predicted"]["model_state_bytes"], rel=1e-3)
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "within 10% of the measurement: 1 of 1 runs" in capsys.readouterr().out
