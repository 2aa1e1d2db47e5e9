"""plait on a CUDA GPU: the device-sensitive paths with CUDA tensors (issue 22).

Skipped on a machine without CUDA (CI has none); run on the lent GPU machine by
bench/gpu/run_device.sh. The oracles are the CPU suite's, on the same GPU:

- plait.comm: every algorithm of every collective at p = 2 and 3, the ranks sharing
  one GPU over gloo (tensors pass through host memory), against the float64
  reference, the virtual executor bit for bit, and torch's collective where gloo
  runs it on CUDA tensors (tests/comm/gloo_checks.py).
- plait train: dp2 x pp2, tp2 and dp2 x tp2 sharing the GPU against one process on
  the same GPU, loss curves within 1e-5 in float32 (the argument of
  tests/train/test_train_parity.py: the layouts differ only in the order of float32
  sums; TF32 is off, torch's default for matmuls).
- mixed precision on tensor cores: one process under bf16 / fp16 autocast on CUDA
  equals plain torch's autocast (and, for fp16, torch.amp.GradScaler's scale
  sequence) bit for bit: the same kernels in the same order.
- recomputation (full, selective, with dropout: the CUDA RNG is replayed) and
  activation offload to pinned host memory give the same losses bit for bit as
  storing the activations.
- ZeRO stages 1-3 over dp2 on the shared GPU against stage 0 (plain data parallel),
  within 1e-5.
"""

from __future__ import annotations

import json

import pytest
import torch

from plait.comm.algorithms import COLLECTIVES
from plait.testing import run_distributed
from tests.comm.gloo_checks import check_collective
from tests.train.test_mixed_precision import _config as precision_config, _reference as autocast_reference
from tests.train.test_train_parity import _config, _records, _train_rank, _worst, STEPS, TOLERANCE

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine "
                                                                       "by bench/gpu/run_device.sh)")]


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("p", [2, 3])
def test_every_algorithm_moves_cuda_tensors_over_gloo(p, collective):
    for dtype in ("float32", "int64"):
        results = run_distributed(check_collective, p, collective, dtype, [0, 1, 5, 1031], device="cuda")
        failures = [f for rank_failures in results for f in rank_failures]
        assert not failures, "\n".join(map(str, failures[:10]))


def _losses(tmp_path, name, world_size, **overrides) -> list[float]:
    config = _config(tmp_path / name, **overrides)
    run_distributed(_train_rank, world_size, config, timeout_s=300)
    report = json.loads((tmp_path / name / "report.json").read_text())
    assert report["run"]["device"].startswith("cuda"), report["run"]["device"]
    return [record["loss"] for record in _records(tmp_path / name)]


@pytest.fixture(scope="module")
def one_gpu_process(tmp_path_factory):
    path = tmp_path_factory.mktemp("one")
    return _losses(path, "one", 1)


@pytest.mark.parametrize("layout", [dict(dp=2, pp=2), dict(tp=2), dict(dp=2, tp=2)],
                         ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()))
def test_layouts_sharing_the_gpu_match_one_process(layout, one_gpu_process, tmp_path):
    losses = _losses(tmp_path, "run", 4 if len(layout) == 2 else 2, **layout)
    assert _worst(losses, one_gpu_process, STEPS) <= TOLERANCE


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_on_tensor_cores_equals_torch_autocast(precision, tmp_path):
    config = precision_config(tmp_path / "run", precision=precision)
    run_distributed(_train_rank, 1, config, timeout_s=300)
    records = _records(tmp_path / "run")
    losses, scales = autocast_reference(config, "cuda")
    assert [record["loss"] for record in records] == losses
    if precision == "fp16-mixed":
        assert [record["loss_scale"] for record in records] == scales


@pytest.mark.parametrize("option", [dict(recompute="full"), dict(recompute="selective"),
                                    dict(offload_activations=True)], ids=lambda d: "-".join(map(str, d.values())))
def test_recompute_and_offload_are_bitwise(option, tmp_path):
    stored = _losses(tmp_path, "stored", 1, dropout=0.1)
    changed = _losses(tmp_path, "changed", 1, dropout=0.1, **option)
    assert changed == stored


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_on_the_shared_gpu_trains_as_data_parallel(stage, tmp_path):
    plain = _losses(tmp_path, "plain", 2, dp=2)
    sharded = _losses(tmp_path, "zero", 2, dp=2, zero_stage=stage)
    assert _worst(sharded, plain, STEPS) <= TOLERANCE
