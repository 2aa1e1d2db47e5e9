"""The CPU compute profile (plait.plan.cpu_profile): the fit recovers known parameters
from synthetic timings, the profile round-trips through its file format, and the
DeviceSpec it gives prices a shape (and plait's GPT block) by the synthetic law."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from plait.cost.profile import machine_identity
from plait.plan.cpu_profile import (CPU_EFFICIENCY_OPS, _rescaled, compute_profile_path, fit_cpu_profile, fixed_and_rate,
                                    host_model_from_profile, load_compute_profile, threads_per_rank)
from plait.plan.device_profile import efficiency, profile_device
from plait.plan.layers import backward_matmuls
from plait.plan.transformer import TransformerSpec

# the synthetic machine: asymptotic rates peak·η_max and the scales (m0, n0, k0), fixed costs, memory rates
GEMM_RATE, GEMM_SCALES, T_MM = 40e9, (20.0, 30.0, 10.0), 2e-6
BMM_RATE, BMM_SCALES, T_BMM = 25e9, (5.0, 15.0, 25.0), 3e-6
MEMORY_GBPS = {"copy": 30.0, "add": 40.0, "gelu": 8.0, "layernorm": 10.0, "layernorm.backward": 16.0, "softmax": 5.0,
               "dropout": 1.0, "adamw": 4.0}
FIXED_S = 1.5e-6
EAGER_S, DISPATCH_S = 7e-6, 2e-6
HOST = {"ranks": 4, "cores": 2, "threads_per_rank": 1, "sync_wait_s": 1.2e-3, "sync_wait_per_compute": 0.05,
        "sync_group_size": 4, "source": "synthetic", "rows": []}
# the fit recovers what the rows determine to ~1e-6 relative (least squares with ftol = xtol = gtol = 1e-12 on
# exact data, plait.plan.device_profile.fit_efficiency_curve); 1e-5 leaves a margin
FIT_RTOL = 1e-5


def law_s(rate: float, scales, t_launch: float, count: int, m: int, n: int, k: int) -> float:
    """T = t + count·2mnk / (rate / (1 + m0/m + n0/n + k0/k)): the synthetic kernels' law."""
    return t_launch + 2.0 * count * m * n * k / efficiency((rate, *scales), m, n, k)


def synthetic_kernels(nprocs: int = 4, host: bool = True) -> dict:
    """A compute_calibrate JSON whose every time follows the known law above."""
    dims = (16, 64, 128, 384, 1024)
    gemms = [(m, n, k) for m in dims for n in dims for k in dims][::3]
    cases = [(count, m, n, k) for count in (2, 8) for m in (32, 64, 256) for n in (16, 64, 256) for k in (32, 128)]
    memory = [{"op": op, "numel": numel, "bytes": 12 * numel, "seconds": FIXED_S + 12 * numel / (gbps * 1e9)}
              for op, gbps in MEMORY_GBPS.items() for numel in (1 << 13, 1 << 15, 1 << 17)]
    kernels = {
        "facts": {"nprocs": nprocs, "cores": 2, "threads_per_rank": 1, "memory_bytes": 8.0 * 2**30,
                  "machine": dataclasses.asdict(machine_identity())},
        "dtype": "float32",
        "launch": {"dispatch_s": DISPATCH_S, "kernel_s": DISPATCH_S, "matmul_s": T_MM, "bmm_s": T_BMM,
                   "eager_autograd_kernel_s": EAGER_S},
        "matmul": [{"op": "mm", "m": m, "n": n, "k": k, "seconds": law_s(GEMM_RATE, GEMM_SCALES, T_MM, 1, m, n, k)}
                   for m, n, k in gemms],
        "attention": [{"op": "bmm", "batch": c, "m": m, "n": n, "k": k,
                       "seconds": law_s(BMM_RATE, BMM_SCALES, T_BMM, c, m, n, k)} for c, m, n, k in cases],
        "memory": memory, "copies": []}
    if host:
        kernels["host"] = dict(HOST)
    return kernels


def test_the_fit_recovers_the_known_parameters():
    profile = fit_cpu_profile(synthetic_kernels(), name="cpu-p4", source="synthetic")
    peak = profile["device"]["peak_flops_per_s"]["float32"]
    for key, rate, scales in (("matmul", GEMM_RATE, GEMM_SCALES), ("attention", BMM_RATE, BMM_SCALES)):
        fit = profile[key]
        # peak and η_max are one product (the peak is the best rate, so η_max <= 1); the product is the law's rate
        assert fit["eta_max"] <= 1.0 and fit["peak_flops_per_s"] == peak
        assert peak * fit["eta_max"] == pytest.approx(rate, rel=FIT_RTOL)
        assert (fit["m0"], fit["n0"], fit["k0"]) == pytest.approx(scales, rel=FIT_RTOL)
        assert fit["residuals"]["max_abs_relative"] < FIT_RTOL
    assert peak == pytest.approx(GEMM_RATE, rel=FIT_RTOL)  # the larger asymptote
    memory = profile["memory"]
    # T = c + bytes/rate is linear in (c, 1/rate): exact data give them to float64 rounding
    for op, gbps in MEMORY_GBPS.items():
        assert memory["per_op"][op]["gbps"] == pytest.approx(gbps, rel=1e-9)
        assert memory["per_op"][op]["fixed_s"] == pytest.approx(FIXED_S, rel=1e-6)
    assert memory["bandwidth_bytes_per_s"] == pytest.approx(40e9, rel=1e-9)
    harmonic = len(CPU_EFFICIENCY_OPS) / sum(40.0 / MEMORY_GBPS[op] for op in CPU_EFFICIENCY_OPS)
    assert memory["efficiency"] == pytest.approx(harmonic, rel=1e-9)
    assert memory["optimizer_efficiency"] == pytest.approx(4.0 / 40.0, rel=1e-9)
    launch = profile["launch"]
    assert launch["used"] == "eager_autograd_kernel_s" and launch["kernel_overhead_s"] == EAGER_S
    assert profile["matmul"]["t_launch_s"] == T_MM and profile["attention"]["t_launch_s"] == T_BMM
    assert profile["device"]["memory_bytes"] == 2.0 * 2**30  # the machine's RAM over the 4 ranks
    assert profile["vendor"] is None and profile["host"]["sync_wait_s"] == HOST["sync_wait_s"]


def test_fixed_and_rate_of_one_size_is_its_rate():
    assert fixed_and_rate([1000.0], [2e-6]) == (0.0, pytest.approx(5e8, rel=1e-12))


def test_the_profile_round_trips_and_prices_the_synthetic_law(tmp_path):
    profile = fit_cpu_profile(synthetic_kernels(), name="cpu-p4", source="synthetic")
    path = compute_profile_path(4, tmp_path)
    path.write_text(json.dumps(profile))
    loaded, why_not = load_compute_profile(path, nprocs=4, dtype="float32")
    assert why_not == "" and loaded == profile
    device = profile_device(loaded, where=path.name)
    assert device.calibrated and device.kernel_overhead_s == EAGER_S
    for kind, shape, rate, scales in (("gemm", (1, 256, 384, 128), GEMM_RATE, GEMM_SCALES),
                                      ("bmm", (16, 64, 64, 32), BMM_RATE, BMM_SCALES)):
        law = law_s(rate, scales, 0.0, *shape)  # the planner charges the kernel's fixed cost per kernel apart
        assert device.matmul_time_s(((kind, *shape),), "float32") == pytest.approx(law, rel=FIT_RTOL)
    # plait's GPT block carries its products' shapes: its forward and backward are priced by the fitted law
    spec = TransformerSpec(name="gpt", layers=4, hidden=128, heads=4, seq_len=64, vocab=97)
    block = spec.layer_costs(4, tp=2, element_bytes=4, accounting="plait")[1]
    bandwidth = 40e9 * profile["memory"]["efficiency"]

    def priced(matmuls, kernels, nbytes):
        return (kernels * EAGER_S + nbytes / bandwidth
                + sum(law_s(GEMM_RATE if kind == "gemm" else BMM_RATE, GEMM_SCALES if kind == "gemm" else BMM_SCALES,
                            0.0, count, m, n, k) for kind, count, m, n, k in matmuls))

    assert block.forward_matmuls
    assert device.forward_time_s(block, "float32") == pytest.approx(
        priced(block.forward_matmuls, block.forward_kernels, block.forward_bytes), rel=FIT_RTOL)
    assert device.backward_time_s(block, "float32") == pytest.approx(
        priced(backward_matmuls(block.forward_matmuls), block.backward_kernels, block.backward_bytes), rel=FIT_RTOL)


def test_a_profile_for_other_ranks_dtype_or_machine_is_not_used(tmp_path):
    profile = fit_cpu_profile(synthetic_kernels(), name="cpu-p4", source="synthetic")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    assert load_compute_profile(path, nprocs=2, dtype="float32")[1].endswith("measured with 4 ranks, not 2")
    assert "measured 'float32', not 'bfloat16'" in load_compute_profile(path, nprocs=4, dtype="bfloat16")[1]
    profile["facts"]["machine"]["cpu_model"] = "another CPU"
    path.write_text(json.dumps(profile))
    assert "measured on another machine (cpu_model: stored 'another CPU'" in load_compute_profile(
        path, nprocs=4, dtype="float32")[1]
    assert load_compute_profile(tmp_path / "none.json", nprocs=4, dtype="float32")[0] is None
    # a CPU's profile runs the optimizer and the norm eagerly (DeviceSpec.eager), one saved
    # before the field too; a GPU's profile (bench/gpu's) is fused
    assert profile_device(fit_cpu_profile(synthetic_kernels(), name="cpu-p4")).eager is True
    profile["facts"]["machine"]["cpu_model"] = machine_identity().cpu_model
    del profile["device"]["eager"]
    path.write_text(json.dumps(profile))
    loaded, why = load_compute_profile(path, nprocs=4, dtype="float32")
    assert why == "" and profile_device(loaded).eager is True
    assert profile_device({**profile, "name": "gpu-like"}).eager is False
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        load_compute_profile(path, nprocs=4, dtype="float32")


def test_the_host_model_takes_the_measured_wait():
    profile = fit_cpu_profile(synthetic_kernels(), name="cpu-p4", source="synthetic")
    host = host_model_from_profile(profile, nprocs=4, cores=2)
    assert (host.ranks, host.cores, host.threads_per_rank) == (4, 2, 1)
    assert (host.sync_wait_s, host.sync_wait_per_compute, host.sync_group_size) == (1.2e-3, 0.05, 4)
    assert host.wait_s(4, 0.01) == pytest.approx(1.2e-3 + 0.05 * 0.01, rel=1e-12)
    bare = host_model_from_profile(None, nprocs=4, cores=8)
    assert (bare.threads_per_rank, bare.sync_wait_s, bare.sync_wait_per_compute) == (2, 0.0, 0.0)
    assert bare.source.startswith("no compute profile")
    # measured on 2 cores: not the wait of 8
    assert host_model_from_profile(profile, nprocs=4, cores=8).sync_wait_s == 0.0
    assert [threads_per_rank(n, 2) for n in (1, 2, 4)] == [2, 1, 1] and math.isclose(threads_per_rank(3, 16), 5)


def test_rows_that_do_not_determine_the_asymptote_still_give_a_device():
    """Times that do not grow with the FLOPs (a noisy, tiny calibration) leave η_max at its
    bound: the profile says so and stays a valid DeviceSpec (η_max <= 1 after rescaling)."""
    kernels = synthetic_kernels()
    for row in kernels["matmul"]:
        row["seconds"] = 1e-4
    profile = fit_cpu_profile(kernels, name="cpu-p4", source="flat")
    assert profile["matmul"]["asymptote_bounded"] and not profile["attention"]["asymptote_bounded"]
    assert 0 < profile["matmul"]["eta_max"] <= 1.0
    assert profile_device(profile).matmul_fit[0] == profile["matmul"]["eta_max"]


def test_a_scale_rounded_below_zero_is_zero():
    """The solver can leave a scale at its bound 0 less rounding (a calibration gave n0 =
    -3.5e-15, which DeviceSpec refuses): the rescaled fit holds 0."""
    fit = {"eta_max": 0.5, "m0": 3.5, "n0": -3.469446951953614e-15, "k0": 4.9, "efficiency_flop_weighted": 0.4}
    rescaled = _rescaled(fit, 2.0, 1.0)
    assert (rescaled["eta_max"], rescaled["m0"], rescaled["n0"], rescaled["k0"]) == (1.0, 3.5, 0.0, 4.9)
