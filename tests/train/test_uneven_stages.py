"""Uneven pipeline stages in plait train (--stage-layers): the chunks hold the layers
the user gave, and training is exact.

Parity: a pipeline only moves where each layer runs, not what it computes: the same
micro-batches are accumulated in the same order, so pp=2 with uneven chunks must give
the losses of one process (pp=1) up to float64 roundoff. Three steps of AdamW on
losses of ~2-4.5 keep that roundoff ~1e-15 relative; the stated bound is 1e-10.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.testing import run_distributed
from plait.train import budget
from plait.train.config import TrainConfig
from plait.train.hf_layout import check_stage_layers
from tests.train import runs

TOLERANCE = 1e-10  # float64, three steps (module docstring)
STEPS = 3
COMMON = dict(dtype="float64", global_batch=8, micro_batch=2, dp=1, tp=1, steps=STEPS, warmup_steps=1, lr=3e-3,
              min_lr=3e-4, eval_interval=0, checkpoint_interval=0, keep_checkpoints=0, timeout_s=60.0)


def _gpt(out, **overrides) -> TrainConfig:
    return TrainConfig(**{**COMMON, "layers": 4, "hidden": 16, "heads": 2, "seq_len": 8, "data_max_bytes": 20_000,
                          "out": str(out), **overrides})


def _mlp(out, **overrides) -> TrainConfig:
    return TrainConfig(**{**COMMON, "model": "mlp", "data": "digits", "mlp_hidden": (16, 16, 16), "out": str(out),
                          **overrides})


def _hf(out, model_dir, **overrides) -> TrainConfig:
    return TrainConfig(**{**COMMON, "model": f"hf:{model_dir}", "seq_len": 8, "data_max_bytes": 20_000,
                          "out": str(out), **overrides})


def _llama_dir(directory: Path, blocks: int) -> Path:
    """A tiny Llama-style config.json (tests/hf_models.py) with ``blocks`` decoder blocks."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_models import tiny_llama

    directory.mkdir(parents=True, exist_ok=True)
    tiny_llama(0, vocab_size=96, num_hidden_layers=blocks).config.save_pretrained(directory)
    return directory


def _train_and_list(rank, world_size, configs):
    """A plait.testing worker: train each config; return, per config, the parameter names this rank holds."""
    from plait.train.loop import Trainer

    held = []
    for config in configs:
        trainer = Trainer(config, resume="never", log=lambda _: None)
        trainer.train()
        held.append(sorted(trainer.hybrid.names))
    return held


def test_stage_layers_are_checked_by_name():
    """Count, sum and sizes are refused with the values and a valid split; an hf model's
    blocks are counted when its config is read."""
    with pytest.raises(ValueError, match=r"stage_layers=3,2 sums to 5 transformer blocks but layers=4 has 4.*"
                                         r"stage_layers=2,2"):
        _gpt("unused", pp=2, stage_layers=(3, 2))
    with pytest.raises(ValueError, match=r"stage_layers=4 gives 1 pipeline chunks but pp\(2\) \* virtual\(1\) = 2"):
        _gpt("unused", pp=2, stage_layers=(4,))
    with pytest.raises(ValueError, match=r"stage_layers\[0\]=0; every pipeline chunk needs at least one layer"):
        _gpt("unused", pp=2, stage_layers=(0, 4))
    with pytest.raises(ValueError, match=r"sums to 3 linear layers but mlp_hidden=16,16,16 has 4"):
        _mlp("unused", pp=2, stage_layers=(2, 1))
    with pytest.raises(ValueError, match=r"gives 3 pipeline chunks but pp\(2\) \* virtual\(2\) = 4"):
        _gpt("unused", pp=2, virtual=2, schedule="interleaved_1f1b", stage_layers=(1, 1, 2))
    with pytest.raises(ValueError, match=r"sums to 4 decoder blocks but hf:x has 3.*stage_layers=2,1"):
        check_stage_layers(_hf("unused", "x", pp=2, stage_layers=(3, 1)), 3)


def test_the_chunks_are_the_layers_given():
    """The GPT's first chunk takes the embedding and its last the head beyond the blocks
    counted; interleaved chunks go round the ranks; the MLP counts its linears."""
    gpt = _gpt("unused", pp=2, virtual=2, schedule="interleaved_1f1b", layers=5, stage_layers=(2, 1, 1, 1))
    counts = budget.layer_parameters(gpt, vocab=50)
    assert budget.chunk_bounds(gpt, counts) == [0, 3, 4, 5, 7]
    assert budget.chunks_of_ranks(gpt, counts) == [[0, 1, 2, 4], [3, 5, 6]]
    mlp = _mlp("unused", pp=2, stage_layers=(3, 1))
    assert budget.chunk_bounds(mlp, budget.layer_parameters(mlp, vocab=10)) == [0, 3, 4]
    assert budget.chunk_layer_counts(_gpt("unused", pp=1, stage_layers=(4,))) is None  # one chunk: nothing cut


@pytest.mark.slow
def test_uneven_stages_train_like_one_process(tmp_path):
    """pp=2 with uneven chunks (GPT 3+1 blocks, MLP 3+1 linears, Llama-style 1+2 decoder
    blocks: none of them the balanced split) gives one process's losses, and each rank
    holds exactly its chunk's parameters."""
    llama = _llama_dir(tmp_path / "llama", blocks=3)
    uneven = [_gpt(tmp_path / "gpt-pp2", pp=2, stage_layers=(3, 1)),
              _mlp(tmp_path / "mlp-pp2", pp=2, stage_layers=(3, 1)),
              _hf(tmp_path / "llama-pp2", llama, pp=2, stage_layers=(1, 2))]
    single = [config.replace(pp=1, stage_layers=(), out=config.out.replace("-pp2", "-pp1")) for config in uneven]
    held = run_distributed(_train_and_list, 2, uneven, timeout_s=300)
    run_distributed(runs.train_each, 1, single, timeout_s=300)
    for config, reference in zip(uneven, single):
        losses, expected = runs.losses(config.out), runs.losses(reference.out)
        assert len(losses) == len(expected) == STEPS, (config.out, losses, expected)
        worst = max(abs(a - b) for a, b in zip(losses, expected))
        assert worst <= TOLERANCE, f"{config.out}: max |loss - one process| = {worst:.3g}"
    layer_of = {"gpt": lambda name: name.split(".")[1] if name.startswith("blocks.") else None,
                "mlp": lambda name: name.split(".")[1],
                "llama": lambda name: name.split(".")[2] if name.startswith("model.layers.") else None}
    chunks = {kind: tuple(tuple(sorted({layer_of[kind](name) for name in rank_held[index]} - {None}))
                          for rank_held in held) for index, kind in enumerate(layer_of)}
    assert chunks == {"gpt": (("0", "1", "2"), ("3",)), "mlp": (("0", "2", "4"), ("6",)),
                      "llama": (("0",), ("1", "2"))}, chunks
