"""plait bench hf (plait.bench.hf): the harness at toy size, one round, every side on 2
gloo ranks. No timing is asserted (speed targets live in the benchmark itself): the
test checks the report's structure, that every side trained on the tokens the batches
held (counted, not taken from the config), and that plait and its torch peer saw the
same model and data (equal step-1 losses)."""

from __future__ import annotations

import pytest

from plait.bench.hf import LAYOUTS, STEP1_LOSS_TOLERANCE, VARIANTS, HfBenchConfig, run_hf_bench, summarize
from plait.cli.bench_hf import table_lines
from plait.cli.main import main
from plait.testing import run_distributed

TOY = dict(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=64, seq_len=16, global_batch=4,
           rounds=1, warmup=1, steps=2)
# the peers compute the same float32 model on the same rows; after 3 AdamW steps their
# summation orders (bucketed all-reduce vs DDP's, sharded vs replicated) have moved the
# loss by ~1e-6; 1e-3 is far below what a wrong lr, row or token would do (> 1e-2)
CURVE_TOLERANCE = 1e-3


def _bench(rank, world_size, config):
    return run_hf_bench(config)


@pytest.mark.slow
def test_every_side_trains_the_same_model_on_the_counted_tokens():
    config = HfBenchConfig(**TOY)
    rows = run_distributed(_bench, 2, config, timeout_s=240)[0]
    assert sorted(row["variant"] for row in rows) == sorted(VARIANTS)
    result = summarize(rows, config)
    assert [entry["variant"] for entry in result["variants"]] == list(VARIANTS)
    for entry in result["variants"]:
        # every rank's targets summed, tp's replicas once: 2 steps x 4 sequences x 16 tokens
        assert entry["tokens_per_window"] == entry["tokens_per_window_expected"] == 2 * 4 * 16, entry
        assert entry["tokens_per_s"] > 0 and entry["tokens_per_s_min"] <= entry["tokens_per_s_max"]
        assert entry["trained"] and entry["loss_last"] < entry["loss_step1"], entry
    for row in rows:
        assert len(row["losses"]) == config.warmup + config.steps
    assert result["step1_losses_agree"] and result["step1_loss_spread"] <= STEP1_LOSS_TOLERANCE
    assert [pair["layout"] for pair in result["pairs"]] == list(LAYOUTS)
    for pair in result["pairs"]:
        assert len(pair["ratios"]) == config.rounds and pair["min"] <= pair["median"] <= pair["max"]
        assert pair["max_loss_difference"] <= CURVE_TOLERANCE, pair
    text = "\n".join(table_lines(result))
    for variant in VARIANTS:
        assert variant in text


def test_bad_flags_are_refused_by_name_before_any_process_starts(capsys):
    assert main(["bench", "hf", "--nprocs", "1", "--variants", "plait-dp,ddp"]) == 2
    error = capsys.readouterr().err
    assert "--nprocs 1" in error and "'ddp'" in error and "torch-ddp" in error
    assert main(["bench", "hf", "--nprocs", "2", "--global-batch", "3", "--kv-heads", "3"]) == 2
    error = capsys.readouterr().err
    assert "--global-batch 3" in error and "--kv-heads 3" in error
