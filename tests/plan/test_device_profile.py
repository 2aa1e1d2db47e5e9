"""Device profiles (plait.plan.device_profile): the per-shape compute model's fit, its
use in pricing, the layers' matmul shapes, and the presets and CLI that load profiles."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from plait.plan import Layout, cluster_preset, estimate, precision_for
from plait.plan.device import DEVICE_PRESETS, VENDOR_PRESETS, DeviceSpec, load_device_profile as device_loader
from plait.plan.device_profile import (
    MEMORY_EFFICIENCY_OPS,
    calibrated_presets,
    efficiency,
    fit_profile,
    fitted_seconds,
    load_device_profile,
    profile_device,
)
from plait.plan.layers import LayerCost, backward_matmuls, matmul_flops, total, weight_gradient_matmuls
from plait.plan.models import TransformerModel
from plait.plan.transformer import model_preset

H100 = VENDOR_PRESETS["h100-80gb"]
PEAK = H100.peak("bfloat16")
T_LAUNCH = 3e-6
GEMM_FIT = (0.78, 180.0, 120.0, 250.0)
ATTENTION_FIT = (0.55, 300.0, 40.0, 90.0)
MEMORY_EFFICIENCY = {"copy": 0.9, "add": 0.88, "gelu": 0.8, "layernorm": 0.7, "layernorm.backward": 0.6,
                     "softmax": 0.75, "dropout": 0.65, "adamw": 0.5}
BIG_NUMEL = 1 << 27


def layer_gemms(h, t, tokens):
    forward = [("qkv", tokens, 3 * h // t, h), ("proj", tokens, h, h // t), ("fc1", tokens, 4 * h // t, h),
               ("fc2", tokens, h, 4 * h // t)]
    return [entry for name, m, n, k in forward
            for entry in ((name, m, n, k), (name + ".dgrad", m, k, n), (name + ".wgrad", k, n, m))]


def synthetic_kernels(noise=None, head_dims=(64, 128)) -> dict:
    """A kernels.py JSON generated from the model itself (bench/gpu/kernels.py's grid,
    thinned): times exactly T = t_launch + F / (peak·η(m,n,k)), times ``noise(i)``."""
    noise = noise or (lambda i: 1.0)
    matmul, seen = [], set()
    for h in (1024, 4096, 12288):
        for t in (1, 4, 8):
            for tokens in (2048, 16384):
                for op, m, n, k in layer_gemms(h, t, tokens):
                    if (m, n, k) in seen:
                        continue
                    seen.add((m, n, k))
                    seconds = fitted_seconds(GEMM_FIT, t_launch=T_LAUNCH, peak=PEAK, count=1, m=m, n=n, k=k)
                    seconds *= noise(len(matmul))
                    matmul.append({"op": op, "hidden": h, "tp": t, "tokens": tokens, "m": m, "n": n, "k": k,
                                   "flops": 2.0 * m * n * k, "seconds": seconds,
                                   "tflops": 2.0 * m * n * k / seconds / 1e12})
    attention = []
    for batch, s, d in itertools.product((8, 32, 96), (1024, 2048, 4096), head_dims):
        for op, m, n, k in (("bmm.qk", s, s, d), ("bmm.pv", s, d, s)):
            seconds = fitted_seconds(ATTENTION_FIT, t_launch=T_LAUNCH, peak=PEAK, count=batch, m=m, n=n, k=k)
            attention.append({"op": op, "batch": batch, "m": m, "n": n, "k": k, "flops": 2.0 * batch * m * n * k,
                              "seconds": seconds * noise(len(attention))})
        attention.append({"op": "sdpa.causal", "batch": batch, "m": s, "n": s, "k": d, "flops": 1.0,
                          "seconds": 1.0})  # not part of the fit: a wild time must not move it
    memory = []
    for numel in (1 << 20, BIG_NUMEL):
        for op, eff in MEMORY_EFFICIENCY.items():
            # the small size runs at a tenth: only the largest size counts
            gbps = eff * H100.memory_bandwidth_bytes_per_s / 1e9 * (1.0 if numel == BIG_NUMEL else 0.1)
            memory.append({"op": op, "numel": numel, "bytes": 2 * numel, "seconds": 2 * numel / gbps / 1e9,
                           "gbps": gbps})
    copies = [{"kind": kind, "pinned": pinned, "bytes": size, "seconds": 1.0, "gbps": gbps * (size >> 20)}
              for kind in ("h2d", "d2h") for pinned, gbps in ((True, 0.05), (False, 0.02))
              for size in (1 << 20, 1 << 30)]
    return {"facts": {"name": "synthetic H100", "multiprocessors": 132, "memory_bytes": 85e9},
            "dtype": "torch.bfloat16",
            "launch": {"kernel_s": T_LAUNCH, "dispatch_s": 5e-6, "eager_autograd_kernel_s": 2e-5},
            "memory": memory, "copies": copies, "attention": attention, "matmul": matmul}


@pytest.fixture(scope="module")
def profile():
    return fit_profile(synthetic_kernels(), name="synthetic", vendor=H100, source="synthetic-kernels.json")


# ----- the fit --------------------------------------------------------------------------------------
def test_fit_recovers_the_parameters_that_generated_the_measurements(profile):
    # fit_efficiency_curve's stated tolerance on noiseless rows of its own model: ~1e-6 relative
    for key, fitted, truth in (("matmul", profile["matmul"], GEMM_FIT), ("attention", profile["attention"],
                                                                          ATTENTION_FIT)):
        got = tuple(fitted[name] for name in ("eta_max", "m0", "n0", "k0"))
        assert got == pytest.approx(truth, rel=1e-5), key
        assert fitted["residuals"]["max_abs_relative"] < 1e-6, key
        assert fitted["t_launch_s"] == T_LAUNCH and not fitted["underdetermined"]
        assert fitted["degenerate_directions"] == 0
    assert profile["attention"]["rows"] == 36  # bmm.qk and bmm.pv; sdpa rows are not fitted
    assert profile["matmul"]["rows"] == len(synthetic_kernels()["matmul"])


def test_attention_at_one_head_dimension_is_fitted_on_its_flat_direction():
    # kernels.py times attention at head dim 128 only: QK^T (s, s, d) and PV (s, d, s) leave a
    # line of (eta_max, m0, n0, k0) fitting every row alike; the fit says so, reproduces the
    # rows and takes the smallest dimension scales on the line (one of them at its bound 0)
    fitted = fit_profile(synthetic_kernels(head_dims=(128,)), name="one-d", vendor=H100)["attention"]
    assert fitted["degenerate_directions"] == 1 and fitted["rows"] == 18
    assert fitted["residuals"]["max_abs_relative"] < 1e-6
    fit = tuple(fitted[name] for name in ("eta_max", "m0", "n0", "k0"))
    assert min(fit[1:]) == 0.0 and sum(v * v for v in fit[1:]) < sum(v * v for v in ATTENTION_FIT[1:])
    for s in (1024, 4096):
        for m, n, k in ((s, s, 128), (s, 128, s)):
            assert efficiency(fit, m, n, k) == pytest.approx(efficiency(ATTENTION_FIT, m, n, k), rel=1e-6)


def test_fit_under_noise_stays_close_and_reports_its_residuals():
    # ±3% alternating noise: the curve is still found, and the residuals say how far off the rows are
    noisy = synthetic_kernels(noise=lambda i: 1.03 if i % 2 else 0.97)
    fitted = fit_profile(noisy, name="noisy", vendor=H100)
    assert fitted["matmul"]["eta_max"] == pytest.approx(GEMM_FIT[0], rel=0.05)
    residuals = fitted["matmul"]["residuals"]
    assert 0.01 < residuals["median_abs_relative"] <= residuals["max_abs_relative"] < 0.08


def test_memory_launch_and_copies_are_taken_at_the_largest_size(profile):
    memory = profile["memory"]
    for op, eff in MEMORY_EFFICIENCY.items():
        assert memory["per_op"][op]["numel"] == BIG_NUMEL
        assert memory["per_op"][op]["efficiency"] == pytest.approx(eff, rel=1e-12)
    assert memory["efficiency"] == pytest.approx(sum(MEMORY_EFFICIENCY[op] for op in MEMORY_EFFICIENCY_OPS) / 6)
    assert "copy" not in MEMORY_EFFICIENCY_OPS and memory["optimizer_efficiency"] == pytest.approx(0.5)
    launch = profile["launch"]
    assert launch["kernel_overhead_s"] == T_LAUNCH and launch["eager_autograd_kernel_s"] == 2e-5
    assert profile["copies"]["h2d_pinned"] == {"bytes": 1 << 30, "gbps": 0.05 * 1024}
    assert profile["copies"]["d2h_pageable"]["gbps"] == pytest.approx(0.02 * 1024)
    assert profile["source"] == "synthetic-kernels.json" and profile["facts"]["multiprocessors"] == 132


def test_fit_names_what_the_measurement_lacks():
    kernels = synthetic_kernels()
    del kernels["launch"]["kernel_s"]
    with pytest.raises(ValueError, match=r"launch: missing key 'kernel_s'"):
        fit_profile(kernels, name="x", vendor=H100)
    kernels = synthetic_kernels()
    kernels["memory"] = [row for row in kernels["memory"] if row["op"] != "adamw"]
    with pytest.raises(ValueError, match="no rows for adamw"):
        fit_profile(kernels, name="x", vendor=H100)
    kernels = synthetic_kernels()
    del kernels["matmul"][3]["seconds"]
    with pytest.raises(ValueError, match=r"matmul\[3\]: missing key 'seconds'"):
        fit_profile(kernels, name="x", vendor=H100)


# ----- profiles to DeviceSpecs ---------------------------------------------------------------------
def test_load_device_profile_round_trips(profile, tmp_path):
    path = tmp_path / "synthetic.json"
    path.write_text(json.dumps(profile))
    spec = load_device_profile(path)
    assert isinstance(spec, DeviceSpec) and spec == device_loader(path)
    assert spec.matmul_fit == tuple(profile["matmul"][k] for k in ("eta_max", "m0", "n0", "k0"))
    assert spec.attention_fit == tuple(profile["attention"][k] for k in ("eta_max", "m0", "n0", "k0"))
    assert spec.matmul_fit == pytest.approx(GEMM_FIT, rel=1e-5)
    assert spec.peak("bfloat16") == PEAK and spec.memory_bandwidth_bytes_per_s == H100.memory_bandwidth_bytes_per_s
    assert spec.memory_bytes == H100.memory_bytes
    assert spec.memory_efficiency == pytest.approx(profile["memory"]["efficiency"])
    assert spec.optimizer_memory_efficiency == pytest.approx(0.5) and spec.kernel_overhead_s == T_LAUNCH
    assert spec.matmul_efficiency == pytest.approx(profile["matmul"]["efficiency_flop_weighted"])
    assert spec.calibrated and "calibrated: device profile synthetic.json" in spec.describe()
    assert spec == profile_device(json.loads(path.read_text()), where="synthetic.json")


@pytest.mark.parametrize("path, named", [(("matmul", "k0"), "matmul.k0"), (("launch",), "launch"),
                                         (("memory", "optimizer_efficiency"), "memory.optimizer_efficiency"),
                                         (("device", "peak_flops_per_s"), "device.peak_flops_per_s"),
                                         (("format",), "format")])
def test_a_profile_missing_a_key_names_it(profile, tmp_path, path, named):
    broken = copy.deepcopy(profile)
    holder = broken
    for part in path[:-1]:
        holder = holder[part]
    del holder[path[-1]]
    file = tmp_path / "broken.json"
    file.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=f"device profile broken.json: missing key '{named}'"):
        load_device_profile(file)


def test_a_missing_or_garbled_file_says_so(tmp_path):
    with pytest.raises(ValueError, match="no device profile at"):
        load_device_profile(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_device_profile(tmp_path / "bad.json")


# ----- pricing --------------------------------------------------------------------------------------
def _block(micro_batch=2, tp=2, name="gpt-1.3b"):
    return model_preset(name).layer_costs(micro_batch, tp=tp)[1]


def test_a_spec_without_a_fit_prices_exactly_as_before():
    # the old formula, term for term: shapes on the layer change nothing without a fit
    layer = _block()
    bare = replace(layer, forward_matmuls=())
    for spec in VENDOR_PRESETS.values():
        eta, peak = spec.matmul_efficiency, spec.peak("bfloat16")
        bandwidth = spec.memory_efficiency * spec.memory_bandwidth_bytes_per_s
        assert spec.forward_time_s(layer, "bfloat16") == (layer.forward_kernels * spec.kernel_overhead_s
                                                          + layer.forward_flops / (eta * peak)
                                                          + layer.forward_bytes / bandwidth)
        assert spec.backward_time_s(layer, "bfloat16") == spec.backward_time_s(bare, "bfloat16")
        assert spec.weight_gradient_time_s(layer, "bfloat16") == layer.backward_flops / 2 / (eta * peak)
        assert spec.core_forward_time_s(layer, "bfloat16") == (layer.core_forward_flops / (eta * peak)
                                                               + layer.core_forward_bytes / bandwidth)
        assert spec.optimizer_time_s(1e9, "bfloat16") == spec.kernel_overhead_s + 1e9 / bandwidth


def test_a_whole_estimate_without_a_fit_is_unchanged_by_the_shapes():
    # the vendor (uncalibrated) H100: a spec without a fit must price exactly as before
    cluster = replace(cluster_preset("dgx-h100", gpus=16), device=VENDOR_PRESETS["h100-80gb"])
    precision = precision_for("bf16-mixed", "megatron")
    model = TransformerModel(model_preset("gpt-1.3b"))
    layout = Layout(tp=2, pp=2, dp=4, micro_batch=2, num_microbatches=4, schedule="zero_bubble", recompute="selective")
    groups = model.groups(2, 2, False, precision, "megatron")
    bare = [[replace(unit, cost=replace(unit.cost, forward_matmuls=())) for unit in group] for group in groups]
    flops = dict(model_flops=1e18, hardware_flops=1.2e18)
    with_shapes, without = estimate(groups, layout, cluster, precision, **flops), estimate(bare, layout, cluster,
                                                                                          precision, **flops)
    assert with_shapes.step_time_s == without.step_time_s and with_shapes.time_s == without.time_s


def test_a_calibrated_spec_prices_each_product_by_its_shape(profile):
    spec = profile_device(profile)
    layer = _block()
    fit, attention = spec.matmul_fit, spec.attention_fit

    def seconds(products):
        return sum(2.0 * c * m * n * k / (PEAK * efficiency(attention if kind == "bmm" else fit, m, n, k))
                   for kind, c, m, n, k in products)

    bandwidth = spec.memory_efficiency * spec.memory_bandwidth_bytes_per_s
    forward = layer.forward_kernels * T_LAUNCH + seconds(layer.forward_matmuls) + layer.forward_bytes / bandwidth
    assert spec.forward_time_s(layer, "bfloat16") == pytest.approx(forward, rel=1e-12)
    backward = (layer.backward_kernels * T_LAUNCH + seconds(backward_matmuls(layer.forward_matmuls))
                + layer.backward_bytes / bandwidth)
    assert spec.backward_time_s(layer, "bfloat16") == pytest.approx(backward, rel=1e-12)
    assert spec.weight_gradient_time_s(layer, "bfloat16") == pytest.approx(
        seconds(weight_gradient_matmuls(layer.forward_matmuls)), rel=1e-12)
    core = [entry for entry in layer.forward_matmuls if entry[0] == "bmm"]
    assert spec.core_forward_time_s(layer, "bfloat16") == pytest.approx(
        seconds(core) + layer.core_forward_bytes / bandwidth, rel=1e-12)
    assert spec.optimizer_time_s(1e9, "bfloat16") == pytest.approx(T_LAUNCH + 1e9 / (0.5 * spec.memory_bandwidth_bytes_per_s))
    # a layer without shapes keeps the scalar η (the fit's FLOP-weighted mean)
    bare = replace(layer, forward_matmuls=())
    assert spec.forward_time_s(bare, "bfloat16") == pytest.approx(
        layer.forward_kernels * T_LAUNCH + layer.forward_flops / (spec.matmul_efficiency * PEAK)
        + layer.forward_bytes / bandwidth, rel=1e-12)
    # a small product runs further from peak than a large one
    small, large = (("gemm", 1, 256, 256, 256),), (("gemm", 1, 16384, 16384, 16384),)
    achieved = [matmul_flops(p) / spec.matmul_time_s(p, "bfloat16") / PEAK for p in (small, large)]
    assert achieved[0] < 0.5 * achieved[1] and achieved[1] == pytest.approx(efficiency(fit, 16384, 16384, 16384))


def test_the_estimate_prices_with_the_calibrated_device(profile):
    # the weight-gradient share (zero_bubble), the selective recompute's core and the
    # optimizer step go through the calibrated spec
    from plait.plan.estimate import summarize

    device = profile_device(profile)
    cluster = cluster_preset("dgx-h100", gpus=8, device=device)
    precision = precision_for("bf16-mixed", "megatron")
    model = TransformerModel(model_preset("gpt-350m"))
    groups = model.groups(2, 1, False, precision, "megatron")
    summaries = summarize(groups, tp=1, recompute="selective", cluster=cluster, dtype=precision.dtype)
    for group, summary in zip(groups, summaries):
        units = [unit.cost for unit in group]
        assert summary.weight_s == pytest.approx(sum(device.weight_gradient_time_s(c, "bfloat16") for c in units))
        compute = sum(device.forward_time_s(c, "bfloat16") + device.backward_time_s(c, "bfloat16")
                      + (device.core_forward_time_s(c, "bfloat16") if c.core_activation_bytes else 0.0)
                      for c in units)
        assert summary.compute_s == pytest.approx(compute, rel=1e-12)
    layout = Layout(tp=1, pp=1, dp=8, micro_batch=2, num_microbatches=2, recompute="selective")
    est = estimate(groups, layout, cluster, precision, model_flops=1e15, hardware_flops=1e15)
    params = sum(unit.cost.params for group in groups for unit in group)
    assert est.time_s["optimizer"] == pytest.approx(
        device.optimizer_time_s(params * precision.optimizer_traffic_bytes, "bfloat16"), rel=1e-12)


# ----- the layers' shapes -----------------------------------------------------------------------------
@pytest.mark.parametrize("name, micro_batch, tp", [("gpt-125m", 1, 1), ("gpt-1.3b", 4, 2), ("gpt-175b", 1, 8),
                                                   ("gpt-1t", 2, 8)])
def test_the_shapes_flops_are_the_layers_flops(name, micro_batch, tp):
    spec = model_preset(name)
    costs = spec.layer_costs(micro_batch, tp=tp)
    embedding, block, head = costs[0], costs[1], costs[-1]
    assert embedding.forward_matmuls == () and embedding.forward_flops == 0
    for layer in (block, head):
        assert matmul_flops(layer.forward_matmuls) == layer.forward_flops
        assert matmul_flops(backward_matmuls(layer.forward_matmuls)) == layer.backward_flops
        assert 2 * matmul_flops(weight_gradient_matmuls(layer.forward_matmuls)) == layer.backward_flops
    core = [entry for entry in block.forward_matmuls if entry[0] == "bmm"]
    assert matmul_flops(core) == block.core_forward_flops
    s, h, a = spec.seq_len, spec.hidden, spec.heads
    assert core == [("bmm", micro_batch * a // tp, s, s, h // a), ("bmm", micro_batch * a // tp, s, h // a, s)]
    assert block.forward_matmuls[0] == ("gemm", 1, micro_batch * s, 3 * h // tp, h)
    assert head.forward_matmuls == (("gemm", 1, micro_batch * s, spec.padded_vocab(tp) // tp, h),)


def test_the_backward_products_are_the_input_and_weight_gradients():
    # C[m, n] = A[m, k]·B[k, n]: dA = dC·Bᵀ is (m, k, n), dB = Aᵀ·dC is (k, n, m)
    forward = (("gemm", 1, 2, 3, 5), ("bmm", 7, 11, 13, 17))
    assert backward_matmuls(forward) == (("gemm", 1, 2, 5, 3), ("gemm", 1, 5, 3, 2),
                                         ("bmm", 7, 11, 17, 13), ("bmm", 7, 17, 13, 11))
    assert weight_gradient_matmuls(forward) == (("gemm", 1, 5, 3, 2), ("bmm", 7, 17, 13, 11))


def test_scaled_and_total_keep_the_shapes_consistent():
    block = _block(micro_batch=1, tp=2)
    tripled = block.scaled(3)
    assert matmul_flops(tripled.forward_matmuls) == pytest.approx(tripled.forward_flops, rel=1e-15)
    assert tripled.forward_flops == 3 * block.forward_flops
    for before, after in zip(block.forward_matmuls, tripled.forward_matmuls):
        kind, count, m, n, k = before
        assert after == ((kind, 3 * count, m, n, k) if kind == "bmm" else (kind, count, 3 * m, n, k))
    assert tripled.forward_matmuls == model_preset("gpt-1.3b").layer_costs(3, tp=2)[1].forward_matmuls
    costs = model_preset("gpt-1.3b").layer_costs(1, tp=2)
    summed = total(costs)
    assert summed.forward_matmuls == tuple(e for layer in costs for e in layer.forward_matmuls)
    assert matmul_flops(summed.forward_matmuls) == pytest.approx(summed.forward_flops, rel=1e-15)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="forward_matmuls entry"):
        LayerCost(name="x", forward_matmuls=(("conv", 1, 2, 3, 4),))
    with pytest.raises(ValueError, match="forward_matmuls entry"):
        LayerCost(name="x", forward_matmuls=(("gemm", 1, 0, 3, 4),))
    with pytest.raises(ValueError, match="must be a tuple"):
        LayerCost(name="x", forward_matmuls=[("gemm", 1, 2, 3, 4)])
    with pytest.raises(ValueError, match="matmul_fit"):
        replace(H100, matmul_fit=(1.5, 0.0, 0.0, 0.0))


# ----- presets, CLI, bench ---------------------------------------------------------------------------
def test_presets_load_a_checked_in_profile_and_derive_the_others_by_peak_ratio(profile, tmp_path):
    assert calibrated_presets(VENDOR_PRESETS, tmp_path) == VENDOR_PRESETS  # no files: the vendor presets
    (tmp_path / "h200.json").write_text(json.dumps({**profile, "vendor": "h200-141gb"}))  # the lent GPU: an H200
    presets = calibrated_presets(VENDOR_PRESETS, tmp_path)
    h200, h100, a100 = presets["h200-141gb"], presets["h100-80gb"], presets["a100-80gb"]
    assert h200.name == "h200-141gb" and h200.calibrated and "h200.json" in h200.describe()
    for derived in (h100, a100):
        assert derived.matmul_fit == h200.matmul_fit and derived.attention_fit == h200.attention_fit
        assert derived.memory_efficiency == h200.memory_efficiency
        assert derived.kernel_overhead_s == h200.kernel_overhead_s
        assert "derived by peak ratio from h200-141gb" in derived.describe()
    assert a100.peak_flops_per_s == VENDOR_PRESETS["a100-80gb"].peak_flops_per_s
    assert a100.memory_bandwidth_bytes_per_s == 2039e9 and a100.memory_bytes == VENDOR_PRESETS["a100-80gb"].memory_bytes
    assert h100.memory_bandwidth_bytes_per_s == 3350e9
    # a matmul-only layer takes the peak ratio longer on the A100
    layer = LayerCost(name="gemm", forward_flops=2.0 * 8192 ** 3, forward_matmuls=(("gemm", 1, 8192, 8192, 8192),))
    ratio = a100.forward_time_s(layer, "bfloat16") / h100.forward_time_s(layer, "bfloat16")
    assert ratio == pytest.approx(989 / 312, rel=1e-12)
    # the package's presets: calibrated exactly when the profile is checked in
    shipped = Path(__file__).resolve().parents[2] / "src" / "plait" / "plan" / "profiles" / "h200.json"
    assert DEVICE_PRESETS["h100-80gb"].calibrated == shipped.is_file()


def test_plan_cli_prices_with_a_device_profile(profile, tmp_path, capsys):
    from plait.cli.main import main

    path = tmp_path / "h100-profile.json"
    path.write_text(json.dumps(profile))
    argv = ["plan", "--model", "gpt-1.3b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64",
            "--tp", "1", "--pp", "1", "--micro-batch", "2", "--zero-stage", "0", "--recompute", "none", "--json"]
    assert main(argv + ["--device-profile", str(path)]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    preset = json.loads(capsys.readouterr().out)
    assert calibrated[0]["step_time_s"] != preset[0]["step_time_s"]
    assert main(argv[:-1] + ["--device-profile", str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "calibrated: device profile h100-profile.json (fitted from synthetic-kernels.json)" in out
    assert main(argv[:-1] + ["--device-profile", str(tmp_path / "absent.json")]) == 2
    assert "no device profile at" in capsys.readouterr().err
    assert main(["plan", "--cluster", "local", "--nprocs", "2", "--global-batch", "4", "--device-profile",
                 str(path)]) == 2
    assert "--device-profile is for a preset cluster" in capsys.readouterr().err


def test_megatron_layouts_takes_a_device_profile(profile, tmp_path, capsys):
    script = Path(__file__).resolve().parents[2] / "bench" / "megatron_layouts.py"
    spec = importlib.util.spec_from_file_location("megatron_layouts_profile", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    device = bench.load_device(str(path))
    assert device.calibrated and device.matmul_fit == pytest.approx(GEMM_FIT, rel=1e-5)
    rows = bench.compare("dgx-h100", device)
    assert all(math.isfinite(row["predicted_tflops_per_gpu"]) for row in rows)
    assert bench.main(["--device-profile", str(tmp_path / "absent.json")]) == 2
    assert "no device profile at" in capsys.readouterr().err
