"""Fitting the link to synthetic calibration samples with known parameters.

Tolerances. Samples get multiplicative Gaussian noise of sigma = 5% (seeded). The
fit minimises relative error, so its parameter covariance is sigma^2 (A^T A)^-1
with A = X / t (X the regressors (1, k, k n, r k n), t the true times). For the
default design (17 sizes 1K..64M x {1, 2, 4} steps x copy/reduce) that gives
relative standard errors of about 3.4% (call overhead), 2.1% (alpha), 1.3% (beta)
and 8.8% (gamma); over 200 seeds no estimate was further than 3.4 standard errors
from the truth, so each parameter must lie within 4 of its standard errors
(computed here from sigma, not taken from the fit). Without noise the fit is exact
to 1e-9 relative.
"""

import math

import numpy as np
import pytest

from plait.cost.calibration import (CalibrationReport, fit_link, fit_nonnegative, fit_ping_pong, fit_shift,
                                    make_profile, weighted_r2)
from plait.cost.profile import MachineIdentity, Profile, Sample

TRUE = {"call_overhead_s": 0.9e-3, "alpha_s": 0.8e-3, "beta_s_per_byte": 1.1e-9, "gamma_s_per_byte": 0.25e-9}
SIZES = [1024 << i for i in range(17)]  # 1 KB .. 64 MB
STEPS = (1, 2, 4)
SIGMA = 0.05


def true_time_s(steps, nbytes, reduce, params=TRUE):
    return params["call_overhead_s"] + steps * (params["alpha_s"] + nbytes * params["beta_s_per_byte"]
                                                + reduce * nbytes * params["gamma_s_per_byte"])


def shift_samples(sigma=0.0, seed=0, params=TRUE, sizes=SIZES, steps=STEPS, reduces=(False, True)):
    rng = np.random.default_rng(seed)
    samples = []
    for nbytes in sizes:
        for k in steps:
            for reduce in reduces:
                time_s = true_time_s(k, nbytes, reduce, params) * (1 + sigma * rng.standard_normal())
                samples.append(Sample(kind="shift", steps=k, nbytes=nbytes, reduce=reduce, time_s=time_s))
    return samples


def ping_samples(alpha_s=0.15e-3, beta_s_per_byte=0.5e-9):
    return [Sample(kind="ping_pong", steps=1, nbytes=n, reduce=False, time_s=alpha_s + n * beta_s_per_byte)
            for n in SIZES]


def expected_relative_std_errors(sigma):
    """sigma * sqrt(diag((A^T A)^-1)) / theta, A = X / t_true: the noise's effect."""
    design = np.array([[1.0, k, k * n, r * k * n] for n in SIZES for k in STEPS for r in (0, 1)])
    times = design @ np.array(list(TRUE.values()))
    rows = design / times[:, None]
    covariance = sigma**2 * np.linalg.inv(rows.T @ rows)
    return dict(zip(TRUE, np.sqrt(np.diag(covariance)) / np.array(list(TRUE.values()))))


def test_noise_free_fit_is_exact():
    link, overhead_s, report = fit_link(shift_samples())
    assert isinstance(report, CalibrationReport)
    assert overhead_s == pytest.approx(TRUE["call_overhead_s"], rel=1e-9)
    assert link.as_dict() == pytest.approx({name: TRUE[name] for name in link.as_dict()}, rel=1e-9)
    assert report.r2["shift"] == pytest.approx(1.0)
    assert report.r2["shift_copy"] == pytest.approx(1.0) and report.r2["shift_reduce"] == pytest.approx(1.0)
    assert report.shift.mean_abs_pct_error < 1e-6
    assert report.notes == () and report.shift.clamped == ()
    assert report.ping_pong is None and "ping_pong" not in report.r2


def test_expected_standard_errors_are_the_documented_ones():
    relative = expected_relative_std_errors(SIGMA)
    assert relative["call_overhead_s"] == pytest.approx(0.034, abs=0.005)
    assert relative["alpha_s"] == pytest.approx(0.021, abs=0.004)
    assert relative["beta_s_per_byte"] == pytest.approx(0.013, abs=0.003)
    assert relative["gamma_s_per_byte"] == pytest.approx(0.088, abs=0.01)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_noisy_fit_recovers_parameters_within_four_standard_errors(seed):
    link, overhead_s, report = fit_link(shift_samples(SIGMA, seed))
    fitted = {"call_overhead_s": overhead_s, "alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte,
              "gamma_s_per_byte": link.gamma_s_per_byte}
    relative = expected_relative_std_errors(SIGMA)
    for name, true_value in TRUE.items():
        assert abs(fitted[name] / true_value - 1) <= 4 * relative[name], (name, fitted[name], true_value)
        # the fit's own standard errors estimate the same thing (within a factor 1.5)
        own = report.shift.std_error(name) / true_value
        assert relative[name] / 1.5 < own < relative[name] * 1.5, (name, own, relative[name])
    # the residuals are the noise: mean |relative error| ~ sigma * sqrt(2/pi) ~ 4%
    assert 2.5 < report.shift.mean_abs_pct_error < 6
    assert report.r2["shift"] > 0.95


def test_relative_weighting_fits_small_and_large_sizes_alike():
    # Unweighted least squares would let the 100 ms samples swamp the 1 ms ones; with
    # 1/t weights the relative errors at 1 KB and at 64 MB are of the same size.
    samples = shift_samples(SIGMA, seed=7)
    link, overhead_s, _ = fit_link(samples)

    def errors(subset):
        return [abs(overhead_s + s.steps * (link.alpha_s + s.nbytes * link.beta_s_per_byte + s.reduce * s.nbytes
                                            * link.gamma_s_per_byte) - s.time_s) / s.time_s for s in subset]

    small = errors([s for s in samples if s.nbytes <= 16 << 10])
    large = errors([s for s in samples if s.nbytes >= 4 << 20])
    assert np.mean(small) < 0.08 and np.mean(large) < 0.08


def test_negative_overhead_is_clamped_with_a_note():
    params = {**TRUE, "call_overhead_s": -0.3e-3}  # data that would pull c below 0
    link, overhead_s, report = fit_link(shift_samples(params=params))
    assert overhead_s == 0.0
    assert report.shift.clamped == ("call_overhead_s",)
    assert any("call_overhead_s fitted" in note and "clamped to 0" in note for note in report.notes)
    assert math.isnan(report.shift.std_error("call_overhead_s"))
    assert link.alpha_s > 0 and link.beta_s_per_byte > 0


def test_no_reduction_cost_clamps_gamma_not_beta():
    params = {**TRUE, "gamma_s_per_byte": -0.05e-9}
    link, _, report = fit_link(shift_samples(params=params))
    assert link.gamma_s_per_byte == 0.0 and "gamma_s_per_byte" in report.shift.clamped
    assert link.beta_s_per_byte == pytest.approx(TRUE["beta_s_per_byte"], rel=0.05)


def test_no_per_byte_cost_raises_asking_for_larger_sizes():
    # times that shrink with size (noise at tiny sizes can do that): beta is clamped
    params = {**TRUE, "beta_s_per_byte": 0.0, "gamma_s_per_byte": 0.0}
    samples = [Sample(kind=s.kind, steps=s.steps, nbytes=s.nbytes, reduce=s.reduce,
                      time_s=s.time_s * (1 - 0.01 * s.nbytes / 4096))
               for s in shift_samples(params=params, sizes=[1024, 2048, 4096])]
    with pytest.raises(ValueError, match="no cost per byte.*--max-bytes"):
        fit_link(samples)


def test_without_reduce_samples_gamma_is_zero_and_noted():
    link, _, report = fit_link(shift_samples(reduces=(False,)))
    assert link.gamma_s_per_byte == 0.0
    assert link.alpha_s == pytest.approx(TRUE["alpha_s"], rel=1e-9)
    assert any("no reduce samples" in note for note in report.notes)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"sizes": [4096]}, "1 distinct size"),
    ({"steps": (2,)}, "one step count"),
])
def test_underdetermined_designs_raise(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        fit_shift(shift_samples(**kwargs))


def test_ping_pong_is_fitted_for_reference_only():
    link, _, report = fit_link(shift_samples() + ping_samples())
    assert link.alpha_s == pytest.approx(TRUE["alpha_s"], rel=1e-9)  # the model ignores it
    assert report.ping_pong_link().as_dict() == pytest.approx(
        {"alpha_s": 0.15e-3, "beta_s_per_byte": 0.5e-9, "gamma_s_per_byte": 0.0}, rel=1e-9)
    assert report.r2["ping_pong"] == pytest.approx(1.0)
    assert fit_ping_pong(shift_samples()) is None


def test_fit_nonnegative_checks_its_input():
    with pytest.raises(ValueError, match="2 samples cannot fit 3 parameters"):
        fit_nonnegative(np.ones((2, 3)), [1.0, 2.0], ("a", "b", "c"), name="demo")
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_nonnegative(np.ones((2, 1)), [1.0, 0.0], ("a",), name="demo")
    with pytest.raises(ValueError, match="design is"):
        fit_nonnegative(np.ones((3, 2)), [1.0, 2.0], ("a", "b"), name="demo")


def test_weighted_r2():
    times = np.array([1.0, 10.0, 100.0])
    assert weighted_r2(times, times) == 1.0
    assert weighted_r2(times, times * 1.1) < 1.0
    # a constant model at the weighted mean explains nothing
    weights = 1 / times**2
    mean = np.sum(weights * times) / np.sum(weights)
    assert weighted_r2(times, np.full(3, mean)) == pytest.approx(0.0, abs=1e-12)


def test_make_profile_wraps_the_fit():
    machine = MachineIdentity(hostname="h", cpu_model="cpu", cpu_count=2, torch_version="2.13.0",
                              python_version="3.12.0", plait_version="0.1.0")
    samples = shift_samples() + ping_samples()
    profile, report = make_profile(samples, backend="gloo", device="cpu", world_size=4, machine=machine)
    assert isinstance(profile, Profile)
    assert profile.world_size == 4 and profile.machine is machine
    assert profile.sizes_nbytes == tuple(SIZES)
    assert profile.samples == tuple(samples)
    assert profile.call_overhead_s == pytest.approx(TRUE["call_overhead_s"], rel=1e-9)
    assert profile.r2 == report.r2
    assert profile.ping_pong_link is not None
