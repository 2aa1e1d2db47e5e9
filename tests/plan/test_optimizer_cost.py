"""The optimizer's cost by tensor size (plait.plan.optimizer_cost): the calibration's fit
recovers a synthetic law from the steps `plait calibrate --compute` times, and the
planner prices a known tensor list (and plait's GPT through estimate) by that law."""

from __future__ import annotations

import pytest

from plait.cost import LinkModel
from plait.bench.compute_calibrate import (ADAMW_BYTES_PER_PARAM, ComputeCalibrateConfig, adamw_cases,
                                           gpt_adamw_tensors)
from plait.plan import Layout, cluster_preset, estimate_layout
from plait.plan.cpu_profile import fit_cpu_profile
from plait.plan.device_profile import profile_device
from plait.plan.optimizer_cost import OptimizerLaw, fit_optimizer_law
from plait.plan.precision import precision_for
from plait.plan.transformer import TransformerSpec
from tests.plan.test_cpu_profile import synthetic_kernels

# a synthetic machine: 20 us a step, 30 us a tensor, 3 us a decay, 20 GB/s in cache, 3 GB/s beyond, knee 600 KB
LAW = OptimizerLaw(step_s=20e-6, tensor_s=30e-6, decay_s=3e-6, beta_cache_s_per_byte=1 / 20e9,
                   beta_dram_s_per_byte=1 / 3e9, cache_bytes=600e3)
GPT = dict(layers=4, hidden=128, ffn_hidden=0, vocab=97, seq_len=64)
# exact data: the linear terms are exact at the fitted knee, the knee a golden section to float precision in log L;
# 1e-6 relative leaves a margin over both
FIT_RTOL = 1e-6


def groups_of(tensors):
    """(bytes moved per tensor, tensors, decayed) of a list of (elements, decayed), by hand."""
    return [(ADAMW_BYTES_PER_PARAM * numel, 1, int(decayed)) for numel, decayed in tensors]


def by_hand(tensors) -> float:
    """T = c_step + Σ_t [c_tensor + d_t·c_decay + b_t·beta(b_t)], term by term."""
    seconds = LAW.step_s
    for numel, decayed in tensors:
        b = ADAMW_BYTES_PER_PARAM * numel
        beta = LAW.beta_cache_s_per_byte + (LAW.beta_dram_s_per_byte - LAW.beta_cache_s_per_byte) * b / (600e3 + b)
        seconds += LAW.tensor_s + (LAW.decay_s if decayed else 0.0) + b * beta
    return seconds


def synthetic_profile() -> dict:
    """A calibration whose AdamW steps (the ones `plait calibrate --compute` times: the size
    sweep, the tiny steps, plait train's GPT) all follow LAW."""
    config = ComputeCalibrateConfig(gemm_shapes=((8, 8, 8),), adamw_lists=(gpt_adamw_tensors(**GPT),))
    kernels = synthetic_kernels()
    steps = []
    for tensors in adamw_cases(config):
        steps.append({"op": "adamw", "numel": tensors[0][0], "tensors": len(tensors),
                      "bytes": ADAMW_BYTES_PER_PARAM * sum(n for n, _ in tensors), "groups": groups_of(tensors),
                      "seconds": by_hand(tensors)})
    kernels["memory"] = [row for row in kernels["memory"] if row["op"] != "adamw"] + steps
    return fit_cpu_profile(kernels, name="cpu-p4", source="synthetic")


def test_the_fit_recovers_the_synthetic_law():
    profile = synthetic_profile()
    fitted = profile["memory"]["optimizer_law"]
    for key, value in LAW.as_dict().items():
        assert fitted[key] == pytest.approx(value, rel=FIT_RTOL), key
    assert fitted["fit"]["max_abs_relative"] < FIT_RTOL and fitted["fit"]["clamped"] == []
    # two sizes do not determine a knee: refused by name, and a profile says why it has none
    with pytest.raises(ValueError, match="cannot fit"):
        fit_optimizer_law([{"groups": [(b, k, k)], "seconds": LAW.time_s([(b, k, k)])}
                           for b in (1e3, 1e6) for k in (1, 2, 4)])
    assert synthetic_kernels()["memory"] and fit_cpu_profile(synthetic_kernels(), name="cpu-p4")["memory"][
        "optimizer_law"] is None


def test_the_priced_optimizer_of_a_known_tensor_list_is_the_law_by_hand():
    device = profile_device(synthetic_profile())
    assert device.optimizer_law is not None
    tensors = gpt_adamw_tensors(**GPT) + ((1 << 22, True), (1 << 20, False))  # the GPT and two big tensors
    # float64 sums of the same terms: 1e-12 relative
    fitted = device.optimizer_time_s(0.0, "float32", tensors=groups_of(tensors))
    assert fitted == pytest.approx(by_hand(tensors), rel=FIT_RTOL)
    assert LAW.time_s(groups_of(tensors)) == pytest.approx(by_hand(tensors), rel=1e-12)


def test_the_planner_prices_plait_trains_optimizer_by_the_law():
    """estimate at pp=1: the rank's parameters spread over its matrices, its vectors priced
    at their fixed cost (plan.trainer_calls.optimizer_tensor_groups); ZeRO 1: two shards a unit."""
    device = profile_device(synthetic_profile())
    cluster = cluster_preset("local", nprocs=2, device=device, local_link=LinkModel(1e-5, 1e-9, 1e-10))
    spec = TransformerSpec(name="gpt", layers=4, hidden=128, heads=4, seq_len=64, vocab=97, tied_head=False)
    precision = precision_for("fp32", "plait", "cpu")
    base = dict(dp=2, micro_batch=1, num_microbatches=1)
    plain = estimate_layout(spec, cluster, Layout(**base), precision=precision, accounting="plait")
    model = gpt_adamw_tensors(**GPT)
    params = sum(n for n, _ in model)
    matrices = sum(d for _, d in model)
    bytes_per_matrix = precision.optimizer_traffic_bytes * params / matrices
    hand = (LAW.step_s + len(model) * LAW.tensor_s + matrices * LAW.decay_s
            + matrices * bytes_per_matrix * LAW.beta_s_per_byte(bytes_per_matrix))
    assert plain.time_s["optimizer"] == pytest.approx(hand, rel=1e-12)
    zero = estimate_layout(spec, cluster, Layout(**base, zero_stage=1), precision=precision, accounting="plait")
    units = 4 + 2  # the blocks and the two end modules
    shard = precision.optimizer_traffic_bytes * params / 2 / units
    hand_zero = LAW.step_s + 2 * units * LAW.tensor_s + units * LAW.decay_s + units * shard * LAW.beta_s_per_byte(shard)
    assert zero.time_s["optimizer"] == pytest.approx(hand_zero, rel=1e-12)


def test_a_gpu_profile_has_no_law_and_prices_as_before():
    for preset in ("dgx-h100", "dgx-a100"):  # calibrated from the H200's profile: no size law, one fused launch
        gpu = cluster_preset(preset, gpus=8).device
        assert gpu.calibrated and gpu.optimizer_law is None
        assert gpu.optimizer_time_s(1e9, "bfloat16", 1, tensors=[(1e6, 10, 5)]) == gpu.optimizer_time_s(1e9, "bfloat16")
