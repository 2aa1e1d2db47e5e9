"""plait train with --recompute and --offload-activations: in float64, with dropout, on
tp2 x pp2, every pipeline schedule's loss curve with full or selective recomputation
(or with activations offloaded to files) equals the run without it bitwise (the
recompute replays the dropout masks and re-runs the tensor-parallel collectives in
the same order on both tp ranks; zero bubble's input- and weight-gradient passes share
one recompute and one read-back). Bad settings are refused by name; an offload
directory nobody can write is named on every rank before any step."""

from __future__ import annotations


import pytest

from plait.testing import run_distributed
from plait.train.config import TrainConfig
from tests.train import runs


def _config(out, **overrides) -> TrainConfig:
    values = dict(layers=4, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8, micro_batch=2,
                  dp=1, tp=2, pp=2, steps=3, warmup_steps=1, dropout=0.1, dtype="float64", eval_interval=0,
                  checkpoint_interval=0, keep_checkpoints=0, out=str(out), timeout_s=60.0)
    values.update(overrides)
    return TrainConfig(**values)


CASES = [("gpipe", "full", {}), ("1f1b", "full", {}), ("1f1b", "selective", {}), ("zero_bubble", "full", {}),
         ("zero_bubble", "selective", {}), ("interleaved_1f1b", "full", {"virtual": 2}), ("chimera", "full", {}),
         ("1f1b", "full", {"recompute_layers": 1}),
         # activation offload, alone and under recomputation (kept inputs go to files too)
         ("zero_bubble", "none", {"offload_activations": True}), ("1f1b", "selective", {"offload_activations": True})]
ONLY_RECOMPUTED = ("recompute_layers", "offload_activations")  # what the compared run leaves out


@pytest.mark.slow
def test_recomputed_training_equals_stored_activations_bitwise(tmp_path):
    configs, pairs = [], []
    for index, (schedule, mode, extra) in enumerate(CASES):
        plain = _config(tmp_path / f"{index}-none", schedule=schedule,
                        **{key: value for key, value in extra.items() if key not in ONLY_RECOMPUTED})
        recomputed = plain.replace(out=str(tmp_path / f"{index}-{mode}-treated"), recompute=mode, **extra)
        configs += [plain, recomputed]
        pairs.append((schedule, mode, extra, plain.out, recomputed.out))
    run_distributed(runs.train_each, 4, configs, timeout_s=600)
    for schedule, mode, extra, plain_out, recomputed_out in pairs:
        plain, recomputed = runs.losses(plain_out), runs.losses(recomputed_out)
        assert len(plain) == len(recomputed) == 3
        assert recomputed == plain, f"{schedule} {mode} {extra}: {recomputed} != {plain}"


def test_bad_recompute_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="recompute='partial' is not valid: .*none, selective, full"):
        _config(tmp_path, recompute="partial")
    with pytest.raises(ValueError, match="recompute='full' with model='mlp': recomputation re-runs the GPT's"):
        TrainConfig(model="mlp", data="digits", tp=1, recompute="full", out=str(tmp_path))
    with pytest.raises(ValueError, match="recompute_layers=-2: give a block count >= 0, or -1 for every block"):
        _config(tmp_path, recompute_layers=-2)


def _train_expecting_error(rank, world_size, config):
    from plait.train.loop import Trainer

    try:
        Trainer(config, resume="never", log=lambda _: None)
    except OSError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_an_offload_directory_nobody_can_write_is_named_on_every_rank(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "offload").write_text("a file where the offload directory would go")
    config = _config(out, offload_activations=True)
    for message in run_distributed(_train_expecting_error, 4, config, timeout_s=120):
        assert "rank 0 cannot write its offload directory" in message
        assert "rank 3 cannot write" in message and "needs a writable --out on every node" in message
