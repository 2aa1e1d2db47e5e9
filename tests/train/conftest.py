"""The session's one trained run of a HF model under tensor parallelism, shared by the
interchange tests (HF export, DCP, TensorBoard): training it once costs one
run_distributed call of 2 processes."""

import pytest

from plait.testing import run_distributed
from tests.train import runs


@pytest.fixture(scope="session")
def hf_tp2_run(tmp_path_factory):
    """(TrainConfig, one plain torch process's final parameters) of HF GPT-2 (tied head)
    trained by plait train --model hf: --tp 2 --checkpoint-format dcp --log tensorboard
    (float64, 4 steps, a checkpoint at the end), and by test_train_hf.py's reference."""
    # imported when the fixture runs, so that the rest of tests/train collects whatever that module holds
    from tests.train.test_train_hf import _config, _reference, _write_config

    root = tmp_path_factory.mktemp("hf-tp2")
    config = _config(root / "run", _write_config(root / "gpt2", "gpt2"), tp=2, checkpoint_format="dcp",
                     log="tensorboard", log_interval=3)
    run_distributed(runs.train_each, 2, [config], timeout_s=300)
    return config, _reference(config)[1]
