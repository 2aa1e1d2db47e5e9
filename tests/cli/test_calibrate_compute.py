"""`plait calibrate --compute` and its use by `plait plan --cluster local`: the saved
compute profile is what the local cluster prices with (a temporary cache directory,
passed explicitly), its host section the cluster's host model; a real 2-rank
calibration of a few kernels gives a profile the planner loads."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from plait.bench.compute_calibrate import ComputeCalibrateConfig, run_compute_calibration
from plait.cli.main import main
from plait.cli.plan import _local_cluster
from plait.cost.link import LinkModel
from plait.cost.profile import DEFAULT_PROFILE_BACKEND, Profile, save_profile
from plait.cost.transport_model import TransportModel
from plait.plan.cpu_profile import compute_profile_path, fit_cpu_profile, load_compute_profile
from plait.testing import run_distributed
from tests.plan.test_cpu_profile import HOST, synthetic_kernels


def _args(nprocs: int) -> argparse.Namespace:
    return argparse.Namespace(nprocs=nprocs, gpus=None, profile=None, topology=None)


def test_the_local_cluster_prices_with_the_saved_compute_profile(tmp_path):
    profile = fit_cpu_profile(synthetic_kernels(nprocs=4), name="cpu-p4", source="synthetic")
    profile["host"]["cores"] = os.cpu_count()  # measured on this machine's cores
    path = compute_profile_path(4, tmp_path)
    path.write_text(json.dumps(profile))
    lines = []
    cluster = _local_cluster(_args(4), "fp32", lines.append, cache_directory=tmp_path)
    device = cluster.device
    assert device.matmul_fit == tuple(profile["matmul"][key] for key in ("eta_max", "m0", "n0", "k0"))
    assert device.kernel_overhead_s == profile["launch"]["eager_autograd_kernel_s"]
    assert lines[0].startswith(f"compute: calibrated profile {path} (4 ranks at once")
    host = cluster.host
    assert (host.ranks, host.cores, host.sync_wait_s, host.sync_wait_per_compute, host.source) == (
        4, os.cpu_count(), HOST["sync_wait_s"], HOST["sync_wait_per_compute"], "synthetic")
    assert "wait for the slowest rank 1.2 ms + 0.05 x compute per call [synthetic]" in lines[1]


def test_a_pipeline_message_pays_the_link_profiles_fitted_p2p_cost(tmp_path):
    compute_profile_path(2, tmp_path).write_text(json.dumps(fit_cpu_profile(synthetic_kernels(nprocs=2),
                                                                            name="cpu-p2")))
    model = TransportModel(alpha_s=20e-6, beta_cache_s_per_byte=1e-10, beta_dram_s_per_byte=2e-10, cache_bytes=1e6,
                           gamma_s_per_byte=1e-10, base_call_s=5e-6, call_s={"all_reduce": 300e-6, "p2p": 30e-6})
    save_profile(Profile(link=LinkModel(alpha_s=20e-6, beta_s_per_byte=1e-10), call_overhead_s=300e-6,
                         backend=DEFAULT_PROFILE_BACKEND, device="cpu", world_size=2, sizes_nbytes=(1024, 2048),
                         samples=(), transport_model=model), cache_dir=tmp_path)
    lines = []
    cluster = _local_cluster(_args(2), "fp32", lines.append, cache_directory=tmp_path)
    assert (cluster.call_overhead_s, cluster.p2p_call_s) == (300e-6, 30e-6)
    assert lines[2].endswith("300 us per call, 30 us per p2p")
    # the profile's transport model prices within the host: call_s[p2p] + n beta(n), no alpha (rel 1e-12)
    assert cluster.transport == model and lines[3].startswith("transport model (prices the collectives")
    n = 1e6  # beta(n) = 1e-10 + (2e-10 - 1e-10) n / (1e6 + n) = 1.5e-10 s/byte
    assert cluster.p2p_time_s(n, False) == pytest.approx(30e-6 + n * 1.5e-10, rel=1e-12)


def test_without_a_profile_for_these_ranks_the_machine_is_measured_and_the_line_says_why(tmp_path):
    compute_profile_path(4, tmp_path).write_text(json.dumps(fit_cpu_profile(synthetic_kernels(nprocs=4),
                                                                            name="cpu-p4")))
    lines = []
    cluster = _local_cluster(_args(2), "fp32", lines.append, cache_directory=tmp_path)
    assert not cluster.device.calibrated
    assert lines[0].startswith("measured this machine in ") and f"no compute profile at {tmp_path}" in lines[0]
    assert "wait for the slowest rank 0 ms" in lines[1] and "no compute profile" in lines[1]


def test_link_flags_are_refused_with_compute(capsys):
    assert main(["calibrate", "--compute", "--nprocs", "2", "--min-bytes", "2K", "--reps", "3"]) == 2
    assert "--min-bytes, --reps: link calibration flags, not used by --compute" in capsys.readouterr().err


def calibrate_tiny(rank: int, world_size: int) -> list[dict]:
    """Every rank: a few kernels and a short sync-wait measurement, all ranks at once."""
    config = ComputeCalibrateConfig(gemm_shapes=((16, 32, 64), (64, 64, 64), (32, 128, 16), (128, 64, 32),
                                                 (48, 48, 96)),
                                    attention_cases=((2, 32, 32, 16), (2, 32, 16, 32), (4, 16, 32, 32),
                                                     (2, 64, 64, 16)),
                                    memory_numels=(1 << 10, 1 << 12), adamw_params=(1 << 12,), reps=1,
                                    time_budget_s=0.002, sync_segments_s=(0.0, 5e-4, 2e-3), sync_repeats=3)
    return run_compute_calibration(config)


@pytest.mark.slow
def test_a_real_two_rank_calibration_gives_a_profile_the_planner_loads(tmp_path):
    first, second = run_distributed(calibrate_tiny, 2, timeout_s=120.0)
    kernels = first[0]
    # every rank holds the gathered result (but its own wall times)
    assert {**kernels, "seconds": None} == {**second[0], "seconds": None}
    assert kernels["facts"]["nprocs"] == 2 and len(kernels["matmul"]) == 5 and len(kernels["attention"]) == 4
    assert all(row["seconds_max"] >= row["seconds"] > 0 for row in kernels["matmul"] + kernels["memory"])
    assert kernels["host"]["ranks"] == 2 and kernels["host"]["rows"]
    path = compute_profile_path(2, tmp_path)
    path.write_text(json.dumps(fit_cpu_profile(kernels, name="cpu-p2", source="test")))
    profile, why_not = load_compute_profile(path, nprocs=2, dtype="float32")
    assert why_not == "" and profile["host"]["sync_wait_s"] >= 0.0
    lines = []
    cluster = _local_cluster(_args(2), "fp32", lines.append, cache_directory=tmp_path)
    assert cluster.device.calibrated and lines[0].startswith("compute: calibrated profile")
    assert cluster.host.ranks == 2
