"""An eager optimizer step's cost by tensor size: the law `plait calibrate --compute`
fits and the planner prices a CPU's AdamW with.

torch's AdamW on a CPU steps one parameter tensor at a time (``_single_tensor_adam``:
9 kernels, plus a mul_ for a decayed one, ``plait.plan.trainer_calls``), so a step over
tensors t of b_t bytes moved each (param, grad and both moments read, all three
written: 28 bytes per float32 parameter) costs

    T = c_step + Σ_t [c_tensor + d_t·c_decay + b_t·beta(b_t)],
    beta(b) = beta_cache + (beta_dram - beta_cache)·b / (L + b),

c_step the Python of one ``optimizer.step()`` (hooks, the group loop), c_tensor the
fixed cost of one tensor's kernels, c_decay the decayed tensor's extra mul_ (d_t = 1
for a matrix, plait train decays tensors of >= 2 dims), and beta(b) the seconds per
byte: a small tensor's nine passes run in the core's caches after its first touch
(1/beta_cache), a tensor far beyond them streams every pass from memory
(1/beta_dram), mixed by b/(L + b) with the knee L fitted — the form of the
shared-memory transport's beta(n) (``plait.cost.transport_model``). A single rate
timed on one big tensor (the profile's old ``adamw`` entry) prices plait train's
small tensors ~40% too slow.

The fit (``fit_optimizer_law``): for a fixed L the law is linear in (c_step,
c_tensor, c_decay, beta_cache, beta_dram - beta_cache), fitted by least squares on
relative error with every term >= 0 (``plait.cost.calibration.fit_nonnegative``);
L minimises the relative squared error over a log grid between the smallest and
largest tensor measured (4 points an octave), refined by a golden section, as
``plait.cost.calibration.fit_cache_link`` does for the transport.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from plait.cost.calibration import fit_nonnegative, minimize_log_knee

__all__ = ["OptimizerLaw", "fit_optimizer_law", "law_design_row", "LAW_PARAMETERS"]

LAW_PARAMETERS = ("step_s", "tensor_s", "decay_s", "beta_cache_s_per_byte", "beta_excess_s_per_byte")


def _groups(groups) -> list[tuple[float, float, float]]:
    """(bytes per tensor, tensors, decayed tensors) triples, checked."""
    out = []
    for group in groups:
        if len(group) != 3:
            raise ValueError(f"optimizer tensor group {group!r} must be (bytes per tensor, tensors, decayed)")
        nbytes, count, decayed = (float(v) for v in group)
        if not (math.isfinite(nbytes) and nbytes >= 0 and count >= 0 and 0 <= decayed <= count):
            raise ValueError(f"optimizer tensor group {group!r}: need bytes >= 0 and 0 <= decayed <= tensors")
        out.append((nbytes, count, decayed))
    return out


@dataclass(frozen=True, kw_only=True)
class OptimizerLaw:
    """T = step_s + Σ_t [tensor_s + d_t·decay_s + b_t·beta(b_t)] (module docstring)."""

    step_s: float
    tensor_s: float
    decay_s: float
    beta_cache_s_per_byte: float
    beta_dram_s_per_byte: float
    cache_bytes: float

    def __post_init__(self) -> None:
        bad = [f"{key}={value!r}" for key, value in asdict(self).items()
               if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
               or value < 0]
        if self.cache_bytes <= 0:
            bad.append(f"cache_bytes={self.cache_bytes!r} (must be > 0)")
        if bad:
            raise ValueError(f"invalid optimizer law: {', '.join(bad)} must be finite numbers >= 0 "
                             "(re-run plait calibrate --compute)")

    def beta_s_per_byte(self, nbytes: float) -> float:
        """beta(b) = beta_cache + (beta_dram - beta_cache)·b/(L + b)."""
        b = max(0.0, float(nbytes))
        return self.beta_cache_s_per_byte + (self.beta_dram_s_per_byte - self.beta_cache_s_per_byte) \
            * b / (self.cache_bytes + b)

    def time_s(self, groups) -> float:
        """Seconds of one step over ``groups`` of (bytes moved per tensor, tensors,
        decayed tensors)."""
        seconds = self.step_s
        for nbytes, count, decayed in _groups(groups):
            seconds += count * (self.tensor_s + nbytes * self.beta_s_per_byte(nbytes)) + decayed * self.decay_s
        return seconds

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, node: dict) -> "OptimizerLaw":
        if not isinstance(node, dict):
            raise ValueError(f"optimizer law must be a JSON object, got {type(node).__name__}")
        missing = [item for item in ("step_s", "tensor_s", "decay_s", "beta_cache_s_per_byte",
                                     "beta_dram_s_per_byte", "cache_bytes") if item not in node]
        if missing:
            raise ValueError(f"optimizer law: missing {', '.join(missing)} (re-run plait calibrate --compute)")
        return cls(**{key: float(node[key]) for key in ("step_s", "tensor_s", "decay_s", "beta_cache_s_per_byte",
                                                       "beta_dram_s_per_byte", "cache_bytes")})

    def describe(self) -> str:
        return (f"{self.step_s * 1e6:.3g} us a step + {self.tensor_s * 1e6:.3g} us a tensor (+{self.decay_s * 1e6:.3g}"
                f" decayed), {1e-9 / max(self.beta_cache_s_per_byte, 1e-30):.3g} GB/s in cache, "
                f"{1e-9 / max(self.beta_dram_s_per_byte, 1e-30):.3g} GB/s beyond, knee {self.cache_bytes / 1e3:.4g} KB"
                " a tensor")


def law_design_row(groups, cache_bytes: float) -> list[float]:
    """The law's columns for one step at knee L: [1, Σ count, Σ decayed, Σ count·b,
    Σ count·b²/(L + b)] (coefficients LAW_PARAMETERS)."""
    row = [1.0, 0.0, 0.0, 0.0, 0.0]
    for nbytes, count, decayed in _groups(groups):
        row[1] += count
        row[2] += decayed
        row[3] += count * nbytes
        row[4] += count * nbytes * nbytes / (cache_bytes + nbytes)
    return row


def fit_optimizer_law(rows) -> tuple[OptimizerLaw, dict]:
    """(law, report) fitted to ``rows``: dicts with "groups" ((bytes per tensor, tensors,
    decayed) triples) and "seconds" of one step (module docstring: the fit). The report
    holds the knee search's range and each row's relative error. Raises ValueError with
    fewer than 6 rows or fewer than 3 tensor sizes (the knee is then not determined)."""
    rows = list(rows)
    sizes = sorted({g[0] for row in rows for g in _groups(row["groups"]) if g[0] > 0})
    if len(rows) < len(LAW_PARAMETERS) + 1 or len(sizes) < 3:
        raise ValueError(f"optimizer law: {len(rows)} steps over {len(sizes)} tensor sizes cannot fit "
                         f"{len(LAW_PARAMETERS)} terms and a knee (need >= 6 steps, >= 3 sizes)")
    times_s = np.array([float(row["seconds"]) for row in rows])

    def fit_at(log_l: float):
        design = np.array([law_design_row(row["groups"], math.exp(log_l)) for row in rows])
        fit = fit_nonnegative(design, times_s, LAW_PARAMETERS, name="optimizer law")
        return float(np.sum(((fit.predict(design) - times_s) / times_s) ** 2)), fit

    log_l = minimize_log_knee(lambda x: fit_at(x)[0], math.log(sizes[0]), math.log(sizes[-1]), steps=60)
    _, fit = fit_at(log_l)
    beta_cache = fit.value("beta_cache_s_per_byte")
    law = OptimizerLaw(step_s=fit.value("step_s"), tensor_s=fit.value("tensor_s"), decay_s=fit.value("decay_s"),
                       beta_cache_s_per_byte=beta_cache,
                       beta_dram_s_per_byte=beta_cache + fit.value("beta_excess_s_per_byte"),
                       cache_bytes=math.exp(log_l))
    errors = [(law.time_s(row["groups"]) - t) / t for row, t in zip(rows, times_s)]
    report = {"rows": len(rows), "sizes_bytes": [sizes[0], sizes[-1]], "clamped": list(fit.clamped),
              "relative_errors": errors, "max_abs_relative": max(abs(e) for e in errors)}
    return law, report
