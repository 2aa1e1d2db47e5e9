"""plait.train.budget: what a run needs per process, checked before launch.

The parameter split is compared with the real model cut by the trainer's own
partitioner, and the weights + gradients + optimizer state with the live tensors of
a real training step (not with the budget's own formula)."""

from __future__ import annotations

import pytest
import torch

from plait.testing import run_distributed
from plait.train import budget
from plait.train.config import TrainConfig
from plait.train.build import load_data

TINY = dict(layers=3, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8, micro_batch=2,
            dp=1, tp=1, pp=1, steps=1, eval_interval=0, checkpoint_interval=0, timeout_s=60.0)


@pytest.fixture(scope="module")
def data():
    return load_data(TrainConfig(**TINY))


@pytest.mark.parametrize("overrides", [{}, {"pp": 2}, {"pp": 3}, {"pp": 2, "tied_head": False},
                                       {"pp": 2, "schedule": "interleaved_1f1b", "virtual": 2, "layers": 4},
                                       {"pp": 2, "schedule": "chimera"}])
def test_the_largest_rank_matches_the_real_model_and_split(overrides, data):
    from plait.models.gpt import GPT
    from plait.parallel.pipeline import build
    from plait.parallel.pipeline.partition import sequential_layers, split_layers
    from plait.train.build import gpt_config

    config = TrainConfig(**{**TINY, "tied_head": False, **overrides})
    model = GPT(gpt_config(config, data.vocab_size))
    layers = sequential_layers(model)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert budget.layer_parameters(config, data.vocab_size) == counts
    virtual = config.virtual if config.schedule == "interleaved_1f1b" else 1
    chunks = split_layers(layers, config.pp, virtual=virtual)
    schedule = build(config.schedule, config.pp, config.microbatches, virtual if virtual > 1 else None)
    real = max(sum(counts[i] for _, stage in schedule.stages_of(rank) for i in chunks[stage])
               for rank in range(config.pp))
    assert budget.process_need(config, data).parameters == real


def _live_state_bytes(rank, world_size, config):
    """Bytes of every parameter, gradient and optimizer-state tensor after one real step."""
    from plait.train.loop import Trainer

    trainer = Trainer(config, log=lambda _: None)
    trainer.train()
    params = list(trainer.hybrid.names.values())
    state = sum(value.numel() * value.element_size() for param in params
                for value in trainer.optimizer.state[param].values() if value.dim() > 0)
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    return weights + grads + state


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{"optimizer": "adamw"}, {"optimizer": "sgd", "pp": 2},
                                       {"optimizer": "sgd", "momentum": 0.0, "dtype": "float64"}])
def test_state_bytes_equal_the_live_tensors_of_a_real_step(overrides, data, tmp_path):
    config = TrainConfig(**{**TINY, **overrides, "out": str(tmp_path / "run")})
    live = run_distributed(_live_state_bytes, config.world_size, config, timeout_s=120)
    assert budget.process_need(config, data).state_bytes == max(live)


def test_the_probes_are_refused_naming_need_and_limit(data):
    """--hidden 65536 passed validation and every rank died in the allocator."""
    config = TrainConfig(hidden=65536, heads=4)
    with pytest.raises(ValueError) as refused:
        budget.check_fits(config, data, local_processes=4, available_bytes=24 << 30)
    message = str(refused.value)
    assert "4 processes need at least" in message and "24 GiB is available" in message
    assert f"{budget.process_need(config, data).parameters:,} parameters on the largest rank" in message
    assert "--layers, --hidden, --seq-len" in message
    budget.check_fits(TrainConfig(), data, local_processes=4, available_bytes=24 << 30)  # the default job fits


def test_attention_over_a_huge_sequence_is_refused(data):
    """s² attention scores of one micro-batch: a small model can still not fit."""
    with pytest.raises(ValueError, match="activations for one micro-batch"):
        budget.check_fits(TrainConfig(seq_len=200_000, data_max_bytes=60_000), data, local_processes=1,
                          available_bytes=24 << 30)


def test_processes_share_the_memory_on_cpu_and_not_on_gpu(data):
    config = TrainConfig(hidden=1024, heads=8, layers=8, dp=1, pp=1)
    need = budget.process_need(config, data)
    one = need.host_bytes + need.device_bytes
    budget.check_fits(config, data, local_processes=1, available_bytes=int(one) + 1)
    with pytest.raises(ValueError, match="2 processes need at least"):
        budget.check_fits(config, data, local_processes=2, available_bytes=int(one) + 1)
    # on GPUs the model lives on each device; only the runtime and data share the host
    budget.check_fits(config, data, local_processes=2, available_bytes=int(2 * need.host_bytes) + 1,
                      gpu_memory_bytes=int(need.device_bytes) + 1)
    with pytest.raises(ValueError, match="does not fit one GPU"):
        budget.check_fits(config, data, local_processes=1, gpu_memory_bytes=int(need.device_bytes) - 1,
                          available_bytes=1 << 40)


def test_checkpoint_bytes_are_what_a_real_checkpoint_takes(data, tmp_path):
    """Within the files' framing: torch.save adds a few KiB per file around the tensors."""
    from plait.train import checkpoint as ckpt

    config = TrainConfig(**{**TINY, "out": str(tmp_path / "run")})
    run_distributed(_live_state_bytes, 1, config, timeout_s=120)
    (directory,) = ckpt.list_checkpoints(tmp_path / "run")
    on_disk = sum(entry["nbytes"] for entry in ckpt.read_manifest(directory)["files"].values())
    predicted = budget.checkpoint_bytes(config, data)
    assert predicted <= on_disk <= predicted + (64 << 10)


def test_available_memory_is_positive_and_at_most_physical():
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < budget.available_memory_bytes() <= physical
    assert torch.tensor(0).element_size() == 8  # sanity: TOKEN_ID_BYTES is int64's size
    assert budget.TOKEN_ID_BYTES == 8
