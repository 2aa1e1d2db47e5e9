"""Device profiles: the planner's compute model calibrated from measured kernels.

``bench/gpu/kernels.py`` times one GPU's kernels (GEMMs of transformer layers, the
attention's batched products, memory-bound kernels, launch costs, host copies) into a
JSON; ``fit_profile`` fits a roofline per op class to it and returns a profile (a
JSON-able dict), ``profile_device`` / ``load_device_profile`` turn a profile into the
``DeviceSpec`` the planner prices with. ``bench/gpu/fit_profile.py`` runs the fit and
writes ``plait/plan/profiles/<name>.json``.

The model, per op class (peak and bandwidth are the vendor's, from the preset named
as ``vendor``; efficiencies are relative to them):

- GEMMs (bf16, C[m, n] = A[m, k]·B[k, n]): T = t_launch + F / (peak · η(m, n, k)) with
  η(m, n, k) = η_max / (1 + m0/m + n0/n + k0/k): a dimension much larger than its
  scale costs nothing, a small one wastes partly filled tiles and waves. η_max, m0,
  n0, k0 >= 0 are fitted by least squares on log T (relative errors weighted alike),
  t_launch fixed to the measured launch gap (below), so the fitted η is the matmul
  term alone, as ``DeviceSpec.time_s`` adds the kernel term separately.
- attention (the batched QKᵀ and PV of unfused attention, ``count`` = batch products
  in one kernel): the same form, its own fit, F = count·2mnk.
- memory-bound kernels: per op, efficiency = achieved GB/s at the largest measured
  size / vendor bandwidth. The scalar η_mem is the mean over add, gelu, layernorm,
  layernorm.backward, softmax and dropout (the kernels of a layer's non-matmul
  traffic; copy is left out as it is not one of them); the optimizer step (fused
  AdamW) has its own, ``optimizer_memory_efficiency``.
- kernel cost: ``kernel_overhead_s`` is ``launch.kernel_s``, the device-side gap between
  back-to-back launches. ``eager_autograd_kernel_s`` (host dispatch plus autograd per
  kernel of an eager PyTorch step) is recorded beside it, not used: Megatron-LM runs
  fused kernels queued back to back ahead of the GPU, so the host cost is hidden and
  the device gap is what a step pays; that is the comparison the presets serve (an
  eager, host-bound run would use the other figure).
- host copies: pinned and pageable, h2d and d2h GB/s at the largest size, recorded
  for an offload model (the planner does not price offload transfers yet).

The profile records every fitted number, the fit's residuals (median and largest
|relative error| of the fitted time on the measured rows), the device facts and the
source file's name.

A CPU's profile (``plait.plan.cpu_profile``, `plait calibrate --compute`) has the same
format with no vendor: ``vendor`` is null, ``device.peak_flops_per_s`` holds the best
rate measured in its own dtype (float32), the bandwidth the best memory-bound rate, and
``launch.used`` is ``eager_autograd_kernel_s`` (an eager CPU step is host bound);
``profile_device`` reads it as it reads a GPU's (its own peaks, no vendor needed).

Derived devices (``profile_device(profile, vendor=...)``, the A100 presets): the same
η(m, n, k) curve relative to peak, the same memory efficiencies and launch cost, with
the other chip's vendor peaks, bandwidth and memory. Assumed, not measured: that
cuBLAS reaches the same fraction of peak at the same shapes on both chips (the A100
has 108 SMs to the H100's 132, so wave quantisation differs somewhat) and that the
launch gap is the same.
"""

from __future__ import annotations

import json
import os
import statistics
from importlib import resources
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from plait.plan.device_spec import DeviceSpec
from plait.plan.optimizer_cost import OptimizerLaw

__all__ = ["FORMAT", "MEMORY_EFFICIENCY_OPS", "OPTIMIZER_OP", "PROFILE_FILES", "DERIVED_PRESETS", "fit_profile",
           "fit_efficiency_curve", "profile_device", "load_device_profile", "calibrated_presets", "efficiency",
           "fitted_seconds"]

FORMAT = "plait.device_profile/1"
FIT_DTYPE = "bfloat16"
MEMORY_EFFICIENCY_OPS = ("add", "gelu", "layernorm", "layernorm.backward", "softmax", "dropout")
OPTIMIZER_OP = "adamw"
ATTENTION_OPS = ("bmm.qk", "bmm.pv")
# preset -> the checked-in profile that calibrates it (plait/plan/profiles/)
PROFILE_FILES = {"h100-80gb": "h100.json", "h200-141gb": "h200.json"}
# preset -> the calibrated preset whose profile it is derived from by peak ratio, when it has none of its own
DERIVED_PRESETS = {"a100-40gb": "h200-141gb", "a100-80gb": "h200-141gb", "h100-80gb": "h200-141gb"}


# ----- the model ---------------------------------------------------------------------------------
def efficiency(fit, m: float, n: float, k: float) -> float:
    """η(m, n, k) = η_max / (1 + m0/m + n0/n + k0/k) of ``fit`` (η_max, m0, n0, k0)."""
    eta_max, m0, n0, k0 = fit
    return eta_max / (1.0 + m0 / m + n0 / n + k0 / k)


def fitted_seconds(fit, *, t_launch: float, peak: float, count: float, m: float, n: float, k: float) -> float:
    """T = t_launch + count·2mnk / (peak·η(m, n, k))."""
    return t_launch + 2.0 * count * m * n * k / (peak * efficiency(fit, m, n, k))


def fit_efficiency_curve(rows, *, peak: float, t_launch: float) -> dict:
    """Fit (η_max, m0, n0, k0) to ``rows`` of (count, m, n, k, seconds) by least squares
    on log T, η_max in (0, 1], m0, n0, k0 >= 0 (scipy's trust-region reflective
    solver with ftol = xtol = gtol = 1e-12, from a few starts, the best kept): on rows
    the model generated itself it recovers the parameters to ~1e-6 relative, where the
    rows determine them (``_canonical``: where they do not)."""
    rows = [tuple(float(v) for v in row) for row in rows]
    if not rows:
        raise ValueError("no rows to fit")
    data = np.array(rows)
    count, m, n, k, seconds = data.T
    if np.any(data <= 0) or not np.all(np.isfinite(data)):
        raise ValueError("every row's count, m, n, k and seconds must be finite and > 0")
    flops = 2.0 * count * m * n * k
    log_seconds = np.log(seconds)

    def model(x):
        eta_max, m0, n0, k0 = x[0], x[1] * 1e3, x[2] * 1e3, x[3] * 1e3  # dimensions fitted in thousands
        return t_launch + flops * (1.0 + m0 / m + n0 / n + k0 / k) / (peak * eta_max)

    def residual(x):
        return np.log(model(x)) - log_seconds

    compute_s = np.maximum(seconds - t_launch, seconds * 1e-3)
    achieved = float(np.max(flops / (peak * compute_s)))
    eta_start = min(1.0, max(achieved * 1.05, 1e-8))
    best = None
    for start_dims in (0.0, 0.064, 0.256, 1.0):
        x0 = np.array([eta_start, start_dims, start_dims, start_dims])
        result = least_squares(residual, x0, bounds=([1e-12, 0.0, 0.0, 0.0], [1.0, np.inf, np.inf, np.inf]),
                               method="trf", ftol=1e-12, xtol=1e-12, gtol=1e-12, max_nfev=2000)
        if best is None or result.cost < best.cost:
            best = result
    x, degenerate = _canonical(best, residual)
    eta_max, m0, n0, k0 = float(x[0]), *(float(v) * 1e3 for v in x[1:])
    relative = np.abs(model(x) / seconds - 1.0)
    fit = (eta_max, m0, n0, k0)
    etas = np.array([efficiency(fit, a, b, c) for a, b, c in zip(m, n, k)])
    return {"eta_max": eta_max, "m0": m0, "n0": n0, "k0": k0, "t_launch_s": t_launch, "peak_flops_per_s": peak,
            "rows": len(rows), "underdetermined": len(rows) < 4, "degenerate_directions": degenerate,
            "residuals": {"median_abs_relative": float(np.median(relative)),
                          "max_abs_relative": float(np.max(relative))},
            # the FLOP-weighted harmonic mean of η over the measured rows: the scalar η for
            # a layer whose shapes are unknown
            "efficiency_flop_weighted": float(flops.sum() / (flops / etas).sum())}


def _canonical(result, residual) -> tuple[np.ndarray, int]:
    """The solution, moved along the fit's flat direction (if it has one) to the
    smallest m0² + n0² + k0² within the bounds, and how many flat directions there are.

    The rows can leave a direction undetermined: attention measured at one head dimension
    d (kernels.py times QKᵀ (s, s, d) and PV (s, d, s) at d = 128 only) fixes
    (1 + k0/d)/η, (m0 + n0)/η, (1 + n0/d)/η and (m0 + k0)/η, and those four are one
    equation short (a line of (η, m0, n0, k0) fits every row equally). On that line
    the smallest dimension scales are taken; the profile records the count, as the
    curve then predicts shapes off the measured family (the backward's (d, s, s)) by
    that choice, not by measurement."""
    x = result.x.copy()
    jacobian = np.atleast_2d(result.jac)
    _, singular, vt = np.linalg.svd(jacobian, full_matrices=True)
    scale = singular[0] if singular.size else 0.0
    flat = [vt[i] for i in range(vt.shape[0]) if i >= singular.size or singular[i] <= 1e-7 * scale]
    if len(flat) != 1:
        return x, len(flat)
    direction = flat[0]
    dims = direction[1:]
    if not np.any(dims):
        return x, 1
    step = -float(x[1:] @ dims) / float(dims @ dims)
    # keep η in (0, 1] and the dimensions >= 0 along the step
    low, high = -np.inf, np.inf
    for value, d, lower, upper in zip(x, direction, (1e-12, 0.0, 0.0, 0.0), (1.0, np.inf, np.inf, np.inf)):
        if d > 0:
            low, high = max(low, (lower - value) / d), min(high, (upper - value) / d)
        elif d < 0:
            low, high = max(low, (upper - value) / d), min(high, (lower - value) / d)
    moved = x + min(max(step, low), high) * direction
    before, after = float(np.sum(residual(x) ** 2)), float(np.sum(residual(moved) ** 2))
    return (moved if after <= before + 1e-12 * (1.0 + before) else x), 1


# ----- fitting a kernels.py measurement ---------------------------------------------------------
def _require(container, key: str, where: str):
    if not isinstance(container, dict) or key not in container:
        raise ValueError(f"{where}: missing key {key!r}")
    return container[key]


def _rows(kernels: dict, key: str, fields: tuple[str, ...], where: str) -> list[dict]:
    rows = _require(kernels, key, where)
    if not isinstance(rows, list):
        raise ValueError(f"{where}: {key!r} must be a list of rows")
    for index, row in enumerate(rows):
        for name in fields:
            _require(row, name, f"{where}: {key}[{index}]")
    return rows


def fit_profile(kernels: dict, *, name: str, vendor, source: str = "") -> dict:
    """The profile (a JSON-able dict) fitted to ``kernels`` (bench/gpu/kernels.py's
    JSON) against the vendor DeviceSpec ``vendor`` (its bf16 peak and bandwidth);
    ``source``: the measurement file's name, recorded."""
    where = f"kernels {source or 'measurement'}"
    peak = vendor.peak(FIT_DTYPE)
    bandwidth = vendor.memory_bandwidth_bytes_per_s
    launch = _require(kernels, "launch", where)
    t_launch = float(_require(launch, "kernel_s", f"{where}: launch"))
    matmul_rows = _rows(kernels, "matmul", ("op", "m", "n", "k", "seconds"), where)
    if not matmul_rows:
        raise ValueError(f"{where}: 'matmul' has no rows to fit")
    attention_rows = [row for row in _rows(kernels, "attention", ("op", "batch", "m", "n", "k", "seconds"), where)
                      if row["op"] in ATTENTION_OPS]
    memory_rows = _rows(kernels, "memory", ("op", "numel", "gbps"), where)

    matmul = fit_efficiency_curve([(1, r["m"], r["n"], r["k"], r["seconds"]) for r in matmul_rows],
                                  peak=peak, t_launch=t_launch)
    attention = (fit_efficiency_curve([(r["batch"], r["m"], r["n"], r["k"], r["seconds"]) for r in attention_rows],
                                      peak=peak, t_launch=t_launch) if attention_rows else None)

    per_op = {}
    for row in memory_rows:
        if row["op"] not in per_op or row["numel"] > per_op[row["op"]]["numel"]:
            per_op[row["op"]] = {"numel": row["numel"], "gbps": row["gbps"],
                                 "efficiency": row["gbps"] * 1e9 / bandwidth}
    missing = [op for op in (*MEMORY_EFFICIENCY_OPS, OPTIMIZER_OP) if op not in per_op]
    if missing:
        raise ValueError(f"{where}: 'memory' has no rows for {', '.join(missing)}")
    memory_efficiency = statistics.fmean(per_op[op]["efficiency"] for op in MEMORY_EFFICIENCY_OPS)

    copies = {}
    for row in _rows(kernels, "copies", ("kind", "pinned", "bytes", "gbps"), where):
        key = f"{row['kind']}_{'pinned' if row['pinned'] else 'pageable'}"
        if key not in copies or row["bytes"] > copies[key]["bytes"]:
            copies[key] = {"bytes": row["bytes"], "gbps": row["gbps"]}

    return {
        "format": FORMAT,
        "name": name,
        "vendor": vendor.name,
        "source": source,
        "facts": kernels.get("facts", {}),
        "dtype": FIT_DTYPE,
        "device": {"peak_flops_per_s": dict(vendor.peak_flops_per_s), "memory_bytes": vendor.memory_bytes,
                   "memory_bandwidth_bytes_per_s": bandwidth, "vendor_source": vendor.source},
        "launch": {"kernel_overhead_s": t_launch, "kernel_s": t_launch,
                   "dispatch_s": launch.get("dispatch_s"),
                   "eager_autograd_kernel_s": launch.get("eager_autograd_kernel_s"),
                   "used": "kernel_s",
                   "why": "the device-side gap between back-to-back launches: Megatron-LM's fused kernels are "
                          "queued ahead of the GPU, hiding host dispatch (eager_autograd_kernel_s is for an "
                          "eager, host-bound run)"},
        "matmul": matmul,
        "attention": attention,
        "memory": {"per_op": per_op, "efficiency_ops": list(MEMORY_EFFICIENCY_OPS),
                   "efficiency": memory_efficiency, "optimizer_op": OPTIMIZER_OP,
                   "optimizer_efficiency": per_op[OPTIMIZER_OP]["efficiency"]},
        "copies": copies,
    }


# ----- profile -> DeviceSpec --------------------------------------------------------------------
def _get(profile: dict, dotted: str, where: str):
    value = profile
    walked = []
    for part in dotted.split("."):
        walked.append(part)
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"device profile {where}: missing key {'.'.join(walked)!r}")
        value = value[part]
    return value


def _fit_of(profile: dict, key: str, where: str) -> tuple[float, float, float, float]:
    return tuple(float(_get(profile, f"{key}.{name}", where)) for name in ("eta_max", "m0", "n0", "k0"))


def _efficiency(value: float) -> float:
    """A measured fraction for DeviceSpec, which takes (0, 1]: above 1 (a kernel beating
    the vendor figure) counts as 1."""
    return min(float(value), 1.0)


def profile_device(profile: dict, *, vendor=None, where: str = "", name: str | None = None):
    """The DeviceSpec of ``profile``. With ``vendor`` (a DeviceSpec), the device derived
    from it by peak ratio: the profile's η curves, memory efficiencies and launch cost
    with the vendor's peaks, bandwidth, memory and name (module docstring: the
    assumption). Raises ValueError naming a missing key."""
    if not where:
        where = repr(profile.get("name", "?")) if isinstance(profile, dict) else "?"
    if not isinstance(profile, dict):
        raise ValueError(f"device profile {where}: must be a JSON object, got {type(profile).__name__}")
    fmt = _get(profile, "format", where)
    if fmt != FORMAT:
        raise ValueError(f"device profile {where}: format {fmt!r} is not {FORMAT!r}")
    matmul_fit = _fit_of(profile, "matmul", where)
    attention = _get(profile, "attention", where)
    attention_fit = _fit_of(profile, "attention", where) if attention is not None else None
    scalar = float(_get(profile, "matmul.efficiency_flop_weighted", where))
    memory_efficiency = _efficiency(_get(profile, "memory.efficiency", where))
    optimizer = _efficiency(_get(profile, "memory.optimizer_efficiency", where))
    law = (profile.get("memory") or {}).get("optimizer_law")  # a CPU profile's AdamW by tensor size (cpu_profile)
    optimizer_law = OptimizerLaw.from_dict(law) if law is not None else None
    overhead = float(_get(profile, "launch.kernel_overhead_s", where))
    label = profile.get("source") or "?"
    if vendor is None:
        peaks = _get(profile, "device.peak_flops_per_s", where)
        if not isinstance(peaks, dict):
            raise ValueError(f"device profile {where}: 'device.peak_flops_per_s' must map dtypes to FLOP/s")
        spec_name = name or str(_get(profile, "name", where))
        return DeviceSpec(name=spec_name, peak_flops_per_s=tuple((k, float(v)) for k, v in peaks.items()),
                          memory_bytes=float(_get(profile, "device.memory_bytes", where)),
                          memory_bandwidth_bytes_per_s=float(_get(profile, "device.memory_bandwidth_bytes_per_s",
                                                                  where)),
                          matmul_efficiency=_efficiency(scalar), memory_efficiency=memory_efficiency,
                          kernel_overhead_s=overhead, matmul_fit=matmul_fit, attention_fit=attention_fit,
                          optimizer_memory_efficiency=optimizer, optimizer_law=optimizer_law,
                          eager=profile["device"].get("eager", False) is True,  # a CPU's (cpu_profile)
                          source=f"calibrated: device profile {where} (fitted from {label})")
    same = vendor.name == profile.get("vendor")
    how = "" if same else f", derived by peak ratio from {profile.get('vendor', '?')}"
    return DeviceSpec(name=name or vendor.name, peak_flops_per_s=vendor.peak_flops_per_s,
                      memory_bytes=vendor.memory_bytes, memory_bandwidth_bytes_per_s=vendor.memory_bandwidth_bytes_per_s,
                      matmul_efficiency=_efficiency(scalar), memory_efficiency=memory_efficiency,
                      kernel_overhead_s=overhead, matmul_fit=matmul_fit, attention_fit=attention_fit,
                      optimizer_memory_efficiency=optimizer,
                      source=f"calibrated: device profile {where} (fitted from {label}){how}")


def _read(path) -> dict:
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"no device profile at {path}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"device profile {path} is not valid JSON: {error}") from None


def load_device_profile(path):
    """The DeviceSpec of the profile JSON at ``path`` (as fitted: the profile's own
    vendor peaks and bandwidth)."""
    return profile_device(_read(path), where=os.path.basename(str(path)))


def _profiles_dir():
    return resources.files("plait.plan").joinpath("profiles")


def calibrated_presets(vendor_presets: dict, directory=None) -> dict:
    """``vendor_presets`` with each preset that has a profile file in ``directory``
    (default the package's ``profiles/``, PROFILE_FILES) replaced by its calibrated
    spec, and each of DERIVED_PRESETS without a profile of its own derived from its
    base's profile by peak ratio. Without profile files: the vendor presets unchanged."""
    directory = _profiles_dir() if directory is None else directory
    if isinstance(directory, (str, os.PathLike)):
        directory = Path(directory)
    presets = dict(vendor_presets)
    profiles = {}
    for preset, filename in PROFILE_FILES.items():
        entry = directory.joinpath(filename)
        if preset in presets and entry.is_file():
            try:
                profiles[preset] = (json.loads(entry.read_text()), filename)
            except json.JSONDecodeError as error:
                raise ValueError(f"device profile {filename} is not valid JSON: {error}") from None
    for preset, (profile, filename) in profiles.items():
        presets[preset] = profile_device(profile, vendor=vendor_presets[preset], where=filename)
    for preset, base in DERIVED_PRESETS.items():
        if preset in presets and preset not in profiles and base in profiles:
            profile, filename = profiles[base]
            presets[preset] = profile_device(profile, vendor=vendor_presets[preset], where=filename)
    return presets

