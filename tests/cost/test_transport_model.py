"""The fitted transport model: the cache-knee fit and the per-call costs recover known
parameters from synthetic samples; the profile keeps them (format 2) and still reads
format 1; bench --predict and the planner's local Cluster price with them."""

import json
import math

import pytest

from plait.bench.collectives import BenchRow
from plait.bench.predict import Predictor
from plait.cost.alpha_beta import predict_time_s
from plait.cost.calibration import fit_cache_link, fit_call_costs, make_profile
from plait.cost.link import LinkModel
from plait.cost.profile import load_profile, Sample, save_profile
from plait.cost.transport_model import TransportModel
from plait.plan.cluster import cluster_preset
from plait.plan.device import device_preset

# 4 ranks sharing the host: the shared-host terms (messages, bytes, reduced bytes) / 4 of
# each call's schedule, as plait.bench.calibrate_calls records them (direct algorithm)
TRUE = TransportModel(alpha_s=45e-6, beta_cache_s_per_byte=0.12e-9, beta_dram_s_per_byte=0.7e-9,
                      cache_bytes=1.37e6,  # between the 4-per-octave grid points: found by the golden section
                      gamma_s_per_byte=0.25e-9, base_call_s=70e-6,
                      call_s={"all_reduce": 400e-6, "all_gather": 250e-6, "reduce_scatter": 380e-6,
                              "broadcast": 600e-6, "p2p": 30e-6})
CALL_TERMS = {"all_reduce": (3.0, 3.0, 3.0), "all_gather": (3.0, 0.75, 0.0), "reduce_scatter": (3.0, 0.75, 0.75),
              "broadcast": (0.75, 0.75, 0.0), "p2p": (0.0, 1.0, 0.0)}  # x (1, n, n): rounds, bytes, reduced


def synthetic_samples(model: TransportModel) -> list[Sample]:
    """Noise-free samples of ``model``: ring shifts of 1, 2, 4 steps at 1 KiB..64 MiB x2,
    copy and reduce; real calls of each kind at 64 and 256 B."""
    samples = []
    for octave in range(17):
        nbytes = 1024 << octave
        for steps in (1, 2, 4):
            for reduce in (False, True):
                samples.append(Sample(kind="shift", steps=steps, nbytes=nbytes, reduce=reduce,
                                      time_s=model.base_call_s + steps * model.step_time_s(nbytes, reduce)))
    for nbytes in (64, 256):
        link = model.link_at(nbytes)
        for kind, (rounds, beta_bytes, gamma_bytes) in CALL_TERMS.items():
            terms = (rounds, beta_bytes * nbytes, gamma_bytes * nbytes)
            time_s = model.call_s[kind] + terms[0] * link.alpha_s + terms[1] * link.beta_s_per_byte \
                + terms[2] * link.gamma_s_per_byte
            samples.append(Sample(kind="call", steps=1, nbytes=nbytes, reduce=gamma_bytes > 0, time_s=time_s,
                                  collective=kind, algorithm="direct", terms=terms))
    return samples


def test_cache_fit_recovers_known_parameters():
    """Noise-free data: the weighted least squares is exact at the true L, and the golden
    section finds L to ~sqrt(machine epsilon) in log L (the relative squared error is
    flat to second order at its minimum): 1e-6 relative on L and on the coefficients
    (whose sensitivity to L is O(1)) is a thousandfold margin over 1.5e-8."""
    fit, cache_bytes = fit_cache_link(synthetic_samples(TRUE))
    assert cache_bytes == pytest.approx(TRUE.cache_bytes, rel=1e-6)
    expected = {"call_overhead_s": TRUE.base_call_s, "alpha_s": TRUE.alpha_s,
                "beta_cache_s_per_byte": TRUE.beta_cache_s_per_byte,
                "beta_excess_s_per_byte": TRUE.beta_dram_s_per_byte - TRUE.beta_cache_s_per_byte,
                "gamma_s_per_byte": TRUE.gamma_s_per_byte}
    for name, value in expected.items():
        assert fit.value(name) == pytest.approx(value, rel=1e-6), name
    assert fit.max_abs_pct_error < 1e-4


def test_call_costs_recovered_exactly_and_the_profile_prices_with_them():
    """Given the link, c_K is a weighted mean of t - x: exact to float64 (1e-12 relative).
    Through make_profile the link is the fitted one (1e-6, as above), so 1e-6 there; the
    profile's call_overhead_s is the mean over the four collectives' costs."""
    samples = synthetic_samples(TRUE)
    assert fit_call_costs(samples, TRUE.link_at) == pytest.approx(TRUE.call_s, rel=1e-12)
    profile, report = make_profile(samples, backend="gloo+shm", device="cpu", world_size=4)
    model = profile.transport_model
    assert model.call_s == pytest.approx(TRUE.call_s, rel=1e-6)
    assert model.cache_bytes == pytest.approx(TRUE.cache_bytes, rel=1e-6)
    assert report.cache is not None and report.cache_bytes == model.cache_bytes
    collectives = [TRUE.call_s[k] for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")]
    assert profile.call_overhead_s == pytest.approx(sum(collectives) / 4, rel=1e-6)
    assert profile.collective_call_s("broadcast") == pytest.approx(600e-6, rel=1e-6)
    # a pipeline message: its own fixed cost + n beta(n) (no executor step: no alpha), beta at 8 MiB
    # mostly memory's
    nbytes = 8 << 20
    assert profile.p2p_time_s(nbytes) == pytest.approx(30e-6 + nbytes * TRUE.beta_s_per_byte(nbytes), rel=1e-6)
    assert TRUE.beta_s_per_byte(nbytes) == pytest.approx(
        0.12e-9 + 0.58e-9 * nbytes / (1.37e6 + nbytes), rel=1e-15)


def test_profile_round_trip_and_format_1_still_read(tmp_path):
    profile, _ = make_profile(synthetic_samples(TRUE), backend="gloo+shm", device="cpu", world_size=4)
    path = save_profile(profile, tmp_path / "p.json")
    loaded = load_profile(path)
    assert loaded == profile  # every field, samples' call terms and the transport model included
    document = json.loads(path.read_text())
    assert document["version"] == 2 and "terms" not in document["samples"][0]
    # a format-1 file (before the transport model): read, priced with the plain link as before
    document.update(version=1)
    document.pop("transport_model")
    document["samples"] = [s for s in document["samples"] if s["kind"] != "call"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(document))
    legacy = load_profile(old)
    assert legacy.transport_model is None
    link = legacy.link
    assert legacy.p2p_time_s(1000) == link.alpha_s + 1000 * link.beta_s_per_byte + legacy.call_overhead_s
    assert legacy.collective_call_s("all_reduce") == legacy.call_overhead_s
    # a newer format is refused by name
    document.update(version=3)
    old.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="field 'version' is 3, this plait reads versions 1, 2"):
        load_profile(old)
    # a broken transport model names the field
    document = json.loads(path.read_text())
    document["transport_model"]["cache_bytes"] = -1.0
    old.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=r"field 'transport_model' is invalid .*cache_bytes=-1.0"):
        load_profile(old)


def test_bench_predict_prices_each_kind_with_its_call_cost_and_beta_at_n():
    """plait bench --predict on a direct all-reduce and broadcast at p = 4: the kind's call
    cost + the shared-host terms of the schedule on the link at n (beta(n)). Direct
    all-reduce, p = 4: 12 messages of n, 12 n reduced, over 4 ranks: 3 alpha + 3 n beta(n)
    + 3 n gamma; direct broadcast: 3 messages of n / 4. Float64: 1e-12 relative."""
    profile, _ = make_profile(synthetic_samples(TRUE), backend="gloo+shm", device="cpu", world_size=4)
    predictor = Predictor(profile, world_size=4, source="synthetic")
    model = profile.transport_model
    nbytes = 4 << 20
    link = model.link_at(nbytes)
    for collective, rounds, beta_bytes, gamma_bytes in (("all_reduce", 3, 3 * nbytes, 3 * nbytes),
                                                         ("broadcast", 0.75, 0.75 * nbytes, 0)):
        row = BenchRow(collective=collective, algorithm="direct", nprocs=4, size_bytes=nbytes, count=nbytes // 4,
                       dtype="float32", op="sum", root=0, time_us=1.0)
        expected_s = model.call_overhead_s(collective) + rounds * link.alpha_s + beta_bytes * link.beta_s_per_byte \
            + gamma_bytes * link.gamma_s_per_byte
        assert predictor.predict_us(row) == pytest.approx(1e6 * expected_s, rel=1e-12)


def test_the_planners_local_cluster_charges_the_fitted_per_call_cost_per_transport():
    """plait plan --cluster local builds its Cluster from the profile's link and
    call_overhead_s (plait.cli.plan._local_cluster): with two transports' profiles of
    different call costs, every collective costs the closed form + that transport's
    fitted mean call cost (1e-12 relative), so the two differ by exactly the difference."""
    gloo = TransportModel(**{**TRUE.as_dict(), "call_s": {k: 2 * v for k, v in TRUE.call_s.items()}})
    device = device_preset("h100-80gb")
    prices = {}
    for name, model in (("shm", TRUE), ("gloo", gloo)):
        profile, _ = make_profile(synthetic_samples(model), backend=name, device="cpu", world_size=4)
        cluster = cluster_preset("local", nprocs=4, device=device, local_link=profile.link,
                                 call_overhead_s=profile.call_overhead_s)
        seconds, algorithm = cluster.collective_time_s("all_reduce", 1 << 20, 4, 1)
        bare_s = predict_time_s("all_reduce", algorithm, 1 << 20, 4, profile.link)
        assert seconds - bare_s == pytest.approx(profile.call_overhead_s, rel=1e-9)
        assert profile.call_overhead_s == pytest.approx(
            sum(model.call_s[k] for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")) / 4, rel=1e-6)
        prices[name] = seconds, profile.call_overhead_s
    assert prices["gloo"][0] - prices["shm"][0] == pytest.approx(prices["gloo"][1] - prices["shm"][1], rel=1e-6)


def test_transport_model_refuses_bad_values_by_name():
    with pytest.raises(ValueError) as error:
        TransportModel(alpha_s=-1.0, beta_cache_s_per_byte=0.0, beta_dram_s_per_byte=math.nan, cache_bytes=0,
                       gamma_s_per_byte=0.0, base_call_s=0.0, call_s={"p2p": -2.0})
    for fragment in ("alpha_s=-1.0", "beta_dram_s_per_byte=nan", "cache_bytes=0", "call_s['p2p']=-2.0"):
        assert fragment in str(error.value)
    with pytest.raises(ValueError, match="a call sample needs a collective"):
        Sample(kind="call", steps=1, nbytes=64, reduce=False, time_s=1e-3)
    assert LinkModel  # the link the model hands out is a plain LinkModel
    assert isinstance(TRUE.link_at(100), LinkModel)
