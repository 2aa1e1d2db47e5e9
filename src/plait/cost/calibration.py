"""Fit the alpha-beta-gamma link and the call overhead to calibration samples.

The samples (``plait.bench.calibrate``) time plait's executor on a ring shift of k
steps, every rank sending n bytes to rank+1 per step, all ranks at once; with
``reduce`` the receiver adds what arrives (r = 1), else copies it (r = 0):

    t(k, n, r) = c + k * (alpha + beta * n + r * gamma * n)

c is the fixed overhead of one collective call, alpha the latency of one step,
beta the time per byte moved, gamma the extra time per byte reduced. That is one
linear model in theta = (c, alpha, beta, gamma) with regressors (1, k, k n, r k n),
fitted jointly over copy and reduce samples.

Weights. Sizes span five orders of magnitude (1 KB to 64 MB), so plain least
squares would fit the 100 ms samples and ignore the 1 ms ones. Each row is
divided by its measured time (weight 1/t), i.e. we minimise the relative error
sum_i ((t_i - x_i . theta) / t_i)^2, the error the predictions are judged by.
R^2 is the weighted one: 1 - sum w^2 (t - t_hat)^2 / sum w^2 (t - t_w)^2 with
w = 1/t and t_w the weighted mean.

Negative parameters have no meaning here; when the fit gives one (noise at small
sizes can push c or gamma below 0) the most negative one is clamped to 0, noted,
and the others refitted, until none is negative. beta must stay > 0: a fit that
finds no per-byte cost raises, asking for larger sizes.

The transport model (``plait.cost.transport_model``) refines both on the same
samples. Copies run at the caches' bandwidth for small messages and at memory's for
large ones, so beta depends on n:

    t(k, n, r) = c + k * (alpha + beta_c n + (beta_d - beta_c) n^2 / (L + n) + r gamma n),

linear in (c, alpha, beta_c, beta_d - beta_c >= 0, gamma) for a fixed L: L is found by
a scan of a log grid (4 points per octave) and a golden-section search around the best
point, each L's fit being the weighted least squares above (:func:`fit_cache_link`).
And the "call" samples (real collectives and p2p exchanges at sizes below any
benchmarked one) give each call kind K its software cost: with x_i the price of the
call's messages (its terms on the cache model's link), the 1/t-weighted least squares
of t_i = c_K + x_i is

    c_K = sum_i (t_i - x_i) / t_i^2 / sum_i 1 / t_i^2,   clamped at 0

(:func:`fit_call_costs`). Pure numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from plait.cost.link import LinkModel
from plait.cost.profile import MachineIdentity, Profile, Sample
from plait.cost.transport_model import TransportModel

__all__ = ["LinearFit", "CalibrationReport", "fit_nonnegative", "fit_shift", "fit_ping_pong",
           "fit_link", "fit_cache_link", "fit_call_costs", "fit_transport_model", "make_profile"]

SHIFT_PARAMETERS = ("call_overhead_s", "alpha_s", "beta_s_per_byte", "gamma_s_per_byte")
PING_PONG_PARAMETERS = ("alpha_s", "beta_s_per_byte")


@dataclass(frozen=True, kw_only=True)
class LinearFit:
    """t ~ X theta, least squares weighted by 1/t, theta >= 0.

    ``std_errors`` are the usual WLS standard errors, s^2 (A^T A)^-1 with A = X / t
    and s^2 the mean squared relative residual (NaN for clamped parameters);
    ``mean_abs_pct_error`` / ``max_abs_pct_error`` are |t_hat - t| / t in percent.
    """

    name: str
    parameter_names: tuple[str, ...]
    values: tuple[float, ...]
    std_errors: tuple[float, ...]
    r2: float
    mean_abs_pct_error: float
    max_abs_pct_error: float
    nsamples: int
    clamped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def value(self, name: str) -> float:
        return self.values[self.parameter_names.index(name)]

    def std_error(self, name: str) -> float:
        return self.std_errors[self.parameter_names.index(name)]

    def predict(self, design) -> np.ndarray:
        return np.asarray(design, dtype=float) @ np.asarray(self.values)


def weighted_r2(times_s, predicted_s) -> float:
    """1 - sum ((t - t_hat)/t)^2 / sum ((t - t_w)/t)^2, t_w the 1/t^2-weighted mean."""
    times_s = np.asarray(times_s, dtype=float)
    predicted_s = np.asarray(predicted_s, dtype=float)
    weights = 1.0 / times_s**2
    mean_s = float(np.sum(weights * times_s) / np.sum(weights))
    total = float(np.sum(weights * (times_s - mean_s) ** 2))
    residual = float(np.sum(weights * (times_s - predicted_s) ** 2))
    return 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)


def fit_nonnegative(design, times_s, parameter_names, *, name: str) -> LinearFit:
    """Least squares of ``times_s`` on the columns of ``design``, weighted by 1/t,
    with every parameter >= 0 (most negative clamped to 0 first, then refit)."""
    design = np.asarray(design, dtype=float)
    times_s = np.asarray(times_s, dtype=float)
    names = tuple(parameter_names)
    if design.ndim != 2 or design.shape != (len(times_s), len(names)):
        raise ValueError(f"{name}: design is {design.shape}, need ({len(times_s)}, {len(names)})")
    if len(times_s) < len(names):
        raise ValueError(f"{name}: {len(times_s)} samples cannot fit {len(names)} parameters "
                         f"({', '.join(names)}); measure more sizes or step counts")
    if np.any(~np.isfinite(times_s)) or np.any(times_s <= 0):
        raise ValueError(f"{name}: every time must be finite and > 0, got {times_s.tolist()}")
    rows = design / times_s[:, None]  # relative error: each row divided by its time
    target = np.ones(len(times_s))
    free = list(range(len(names)))
    values = np.zeros(len(names))
    clamped, notes = [], []
    while free:
        sub = rows[:, free]
        scale = np.linalg.norm(sub, axis=0)
        scale[scale == 0] = 1.0  # a column of zeros (e.g. no reduce samples) stays at 0
        solution, *_ = np.linalg.lstsq(sub / scale, target, rcond=None)
        solution = solution / scale
        worst = int(np.argmin(solution))
        if solution[worst] >= 0:
            values[:] = 0.0
            values[free] = solution
            break
        index = free.pop(worst)
        clamped.append(names[index])
        notes.append(f"{name}: {names[index]} fitted {solution[worst]:.3g} < 0, clamped to 0 and "
                     "the others refitted (the data cannot resolve it from the noise)")
    predicted = design @ values
    relative = (predicted - times_s) / times_s
    std_errors = np.full(len(names), np.nan)
    dof = len(times_s) - len(free)
    if free and dof > 0:
        sub = rows[:, free]
        variance = float(np.sum(relative**2)) / dof
        covariance = variance * np.linalg.pinv(sub.T @ sub)
        std_errors[free] = np.sqrt(np.clip(np.diag(covariance), 0.0, None))
    return LinearFit(name=name, parameter_names=names, values=tuple(float(v) for v in values),
                     std_errors=tuple(float(v) for v in std_errors), r2=weighted_r2(times_s, predicted),
                     mean_abs_pct_error=float(np.mean(np.abs(relative)) * 100),
                     max_abs_pct_error=float(np.max(np.abs(relative)) * 100),
                     nsamples=len(times_s), clamped=tuple(clamped), notes=tuple(notes))


def _shift_design(samples: list[Sample]) -> np.ndarray:
    return np.array([[1.0, s.steps, s.steps * s.nbytes, s.steps * s.nbytes * float(s.reduce)]
                     for s in samples])


def fit_shift(samples) -> LinearFit:
    """Fit t = c + k (alpha + beta n + r gamma n) to the "shift" samples."""
    shift = [s for s in samples if s.kind == "shift"]
    problems = []
    sizes = {s.nbytes for s in shift}
    if len(sizes) < 2:
        problems.append(f"{len(sizes)} distinct size(s), need >= 2 to separate alpha from beta")
    if len({s.steps for s in shift}) < 2:
        problems.append("one step count, need >= 2 (e.g. 1, 2, 4) to separate the call overhead from alpha")
    if not any(not s.reduce for s in shift):
        problems.append("no copy (reduce=False) samples")
    if problems:
        raise ValueError("cannot fit the link: " + "; ".join(problems)
                         + "; run plait calibrate with its default sizes and steps")
    fit = fit_nonnegative(_shift_design(shift), [s.time_s for s in shift], SHIFT_PARAMETERS, name="shift")
    if not any(s.reduce for s in shift):
        fit = _with_note(fit, "shift: no reduce samples, gamma left at 0")
    return fit


def fit_ping_pong(samples) -> LinearFit | None:
    """Fit t = alpha + beta n to the one-way "ping_pong" times; None without them."""
    pings = [s for s in samples if s.kind == "ping_pong"]
    if len({s.nbytes for s in pings}) < 2:
        return None
    design = np.array([[1.0, float(s.nbytes)] for s in pings])
    return fit_nonnegative(design, [s.time_s for s in pings], PING_PONG_PARAMETERS, name="ping_pong")


def _with_note(fit: LinearFit, note: str) -> LinearFit:
    return LinearFit(**{**fit.__dict__, "notes": fit.notes + (note,)})


@dataclass(frozen=True, kw_only=True)
class CalibrationReport:
    """The fits behind a link: ``shift`` (the model), ``ping_pong`` (reference only),
    R^2 per fit and per subset, and every note (clamped parameters)."""

    shift: LinearFit
    ping_pong: LinearFit | None
    r2: dict[str, float]
    notes: tuple[str, ...]
    cache: LinearFit | None = None
    cache_bytes: float | None = None

    def ping_pong_link(self) -> LinkModel | None:
        if self.ping_pong is None or self.ping_pong.value("beta_s_per_byte") <= 0:
            return None
        return LinkModel(self.ping_pong.value("alpha_s"), self.ping_pong.value("beta_s_per_byte"))


def fit_link(samples) -> tuple[LinkModel, float, CalibrationReport]:
    """(link, call_overhead_s, report) from calibration samples.

    Raises ValueError when the shift samples cannot resolve the parameters (one size
    or one step count) or show no cost per byte (beta = 0: sizes too small)."""
    samples = list(samples)
    shift_fit = fit_shift(samples)
    beta = shift_fit.value("beta_s_per_byte")
    if beta <= 0:
        largest = max(s.nbytes for s in samples if s.kind == "shift")
        raise ValueError(f"the shift samples show no cost per byte (beta fitted {beta:.3g}, clamped) up to "
                         f"{largest} bytes: measure larger sizes (--max-bytes 1M or more)")
    link = LinkModel(shift_fit.value("alpha_s"), beta, shift_fit.value("gamma_s_per_byte"))
    r2 = {"shift": shift_fit.r2}
    for label, reduce in (("shift_copy", False), ("shift_reduce", True)):
        subset = [s for s in samples if s.kind == "shift" and s.reduce == reduce]
        if len(subset) >= 2:
            r2[label] = weighted_r2([s.time_s for s in subset], shift_fit.predict(_shift_design(subset)))
    ping_fit = fit_ping_pong(samples)
    notes = list(shift_fit.notes)
    if ping_fit is not None:
        r2["ping_pong"] = ping_fit.r2
        notes += ping_fit.notes
    report = CalibrationReport(shift=shift_fit, ping_pong=ping_fit, r2=r2, notes=tuple(notes))
    return link, shift_fit.value("call_overhead_s"), report


CACHE_PARAMETERS = ("call_overhead_s", "alpha_s", "beta_cache_s_per_byte", "beta_excess_s_per_byte",
                    "gamma_s_per_byte")
_GRID_POINTS_PER_OCTAVE = 4
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def minimize_log_knee(score, lo: float, hi: float, *, steps: int = 60) -> float:
    """The log L in [lo, hi] minimising ``score(log L)`` (a fit's error with its knee at
    L): a scan at 4 points an octave, then a golden-section search between the best
    point's neighbours, ``steps`` times (the bracket shrinks by 0.618 a step: 40 reach
    float precision on a 2^40 range); the best point seen is returned."""
    points = max(2, int(round((hi - lo) / math.log(2) * _GRID_POINTS_PER_OCTAVE)) + 1)
    grid = [lo + (hi - lo) * i / (points - 1) for i in range(points)]
    scores = [score(x) for x in grid]
    best = int(np.argmin(scores))
    a, b = grid[max(0, best - 1)], grid[min(points - 1, best + 1)]
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    score_c, score_d = score(c), score(d)
    for _ in range(steps):
        if score_c < score_d:
            b, d, score_d = d, c, score_c
            c = b - _GOLDEN * (b - a)
            score_c = score(c)
        else:
            a, c, score_c = c, d, score_d
            d = a + _GOLDEN * (b - a)
            score_d = score(d)
    return min([(scores[best], grid[best]), (score_c, c), (score_d, d)])[1]


def _cache_design(shift: list[Sample], cache_bytes: float) -> np.ndarray:
    return np.array([[1.0, s.steps, s.steps * s.nbytes, s.steps * s.nbytes**2 / (cache_bytes + s.nbytes),
                      s.steps * s.nbytes * float(s.reduce)] for s in shift])


def _relative_sse(fit: LinearFit, design: np.ndarray, times_s: np.ndarray) -> float:
    return float(np.sum(((fit.predict(design) - times_s) / times_s) ** 2))


def fit_cache_link(samples) -> tuple[LinearFit, float] | None:
    """(fit, L): t = c + k (alpha + beta_c n + (beta_d - beta_c) n^2 / (L + n) + r gamma n)
    on the "shift" samples, every coefficient >= 0, L minimising the relative squared
    error (log grid between the smallest and largest size, 4 per octave, then a golden
    section on log L between the best point's neighbours). None with < 3 sizes."""
    shift = [s for s in samples if s.kind == "shift"]
    sizes = sorted({s.nbytes for s in shift})
    if len(sizes) < 3:
        return None
    times_s = np.array([s.time_s for s in shift])

    def fit_at(log_l: float) -> tuple[float, LinearFit]:
        design = _cache_design(shift, math.exp(log_l))
        fit = fit_nonnegative(design, times_s, CACHE_PARAMETERS, name="cache")
        return _relative_sse(fit, design, times_s), fit

    log_l = minimize_log_knee(lambda x: fit_at(x)[0], math.log(sizes[0]), math.log(sizes[-1]), steps=40)
    _, fit = fit_at(log_l)
    return fit, math.exp(log_l)


def fit_call_costs(samples, link_at) -> dict[str, float]:
    """{kind: c_K}: per call kind, the 1/t-weighted mean of t - x over its "call"
    samples, x = terms . (alpha, beta(n), gamma) of ``link_at(n)`` (a LinkModel per
    size), clamped at 0."""
    sums: dict[str, list[float]] = {}
    for s in samples:
        if s.kind != "call":
            continue
        link = link_at(s.nbytes)
        rounds, beta_bytes, gamma_bytes = s.terms
        work_s = rounds * link.alpha_s + beta_bytes * link.beta_s_per_byte + gamma_bytes * link.gamma_s_per_byte
        weight = 1.0 / s.time_s**2
        total = sums.setdefault(s.collective, [0.0, 0.0])
        total[0] += weight * (s.time_s - work_s)
        total[1] += weight
    return {kind: max(0.0, num / den) for kind, (num, den) in sorted(sums.items())}


def fit_transport_model(samples, link: LinkModel, call_overhead_s: float) -> tuple[TransportModel, LinearFit | None]:
    """The transport model: the cache fit when the samples resolve it (else the plain
    link, beta the same at every size), and the call costs on its link."""
    samples = list(samples)
    cache = fit_cache_link(samples)
    if cache is None or cache[0].value("beta_cache_s_per_byte") + cache[0].value("beta_excess_s_per_byte") <= 0:
        model = TransportModel(alpha_s=link.alpha_s, beta_cache_s_per_byte=link.beta_s_per_byte,
                               beta_dram_s_per_byte=link.beta_s_per_byte, cache_bytes=1 << 20,
                               gamma_s_per_byte=link.gamma_s_per_byte, base_call_s=call_overhead_s)
        cache_fit = None
    else:
        cache_fit, cache_bytes = cache
        beta_cache = cache_fit.value("beta_cache_s_per_byte")
        model = TransportModel(alpha_s=cache_fit.value("alpha_s"), beta_cache_s_per_byte=beta_cache,
                               beta_dram_s_per_byte=beta_cache + cache_fit.value("beta_excess_s_per_byte"),
                               cache_bytes=cache_bytes, gamma_s_per_byte=cache_fit.value("gamma_s_per_byte"),
                               base_call_s=cache_fit.value("call_overhead_s"))
    calls = fit_call_costs(samples, model.link_at)
    if calls:
        model = TransportModel(**{**model.as_dict(), "call_s": calls})
    return model, cache_fit


def make_profile(samples, *, backend: str, device: str, world_size: int,
                 machine: MachineIdentity | None = None) -> tuple[Profile, CalibrationReport]:
    """Fit ``samples`` and wrap the result, the samples and this machine's identity
    (or ``machine``) in a Profile; returns (profile, report).

    The profile's ``call_overhead_s`` (what the tuner and the planner add to every
    collective) is the mean software cost of the collective kinds the "call" samples
    measured, or the ring shift's bare executor cost c without them."""
    samples = tuple(samples)
    link, overhead_s, report = fit_link(samples)
    model, cache_fit = fit_transport_model(samples, link, overhead_s)
    notes = report.notes
    if cache_fit is not None:
        report.r2["cache"] = cache_fit.r2
        notes += cache_fit.notes
    report = CalibrationReport(shift=report.shift, ping_pong=report.ping_pong, r2=report.r2, notes=notes,
                               cache=cache_fit, cache_bytes=model.cache_bytes if cache_fit is not None else None)
    if model.call_s:
        overhead_s = model.mean_collective_call_s()
    extra = {} if machine is None else {"machine": machine}
    profile = Profile(link=link, call_overhead_s=overhead_s, backend=backend, device=device,
                      world_size=world_size, sizes_nbytes=tuple(sorted({s.nbytes for s in samples})),
                      samples=samples, r2=report.r2, notes=report.notes,
                      ping_pong_link=report.ping_pong_link(), transport_model=model, **extra)
    return profile, report
