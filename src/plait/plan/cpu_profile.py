"""This machine's CPU as a calibrated device: `plait calibrate --compute`'s profile.

``plait.bench.compute_calibrate`` times this CPU's kernels in every one of N ranks at
once (the sharing plait train's N processes see: on 2 cores one process alone is
about twice as fast as each of 4 running together), at the threads plait train gives
a rank (``threads_per_rank``), into a kernels JSON of the GPU's layout
(``bench/gpu/kernels.py``); ``fit_cpu_profile`` fits it into a device profile of the
GPU's format (``plait.device_profile/1``, ``plait.plan.device_profile``), which
``profile_device`` turns into the DeviceSpec the planner prices ``--cluster local``
with. Saved per rank count as ``device-cpu-p{N}.json`` in the CLI's cache directory
(``compute_profile_path``). The model, per op class (no vendor: every rate is measured):

- GEMMs (the profile's dtype, float32 by default, plait train's): T = t_mm +
  F/(peak·η(m, n, k)), η(m, n, k) = η_max/(1 + m0/m + n0/n + k0/k), F = 2mnk, fitted on
  log T (``fit_efficiency_curve``) with t_mm the measured fixed cost of one tiny
  ``torch.mm`` (the fit is then the matmul term alone: the planner charges each kernel
  its eager cost separately). ``peak`` is max(the best rate measured on any GEMM or
  attention row, the fitted asymptotes peak·η_max of both curves), so η_max <= 1
  (the fit runs against a nominal peak with headroom, then is rescaled: peak·η, the
  only product the model uses, is unchanged).
- attention (the batched products QKᵀ, PV and their gradients): the same form, its own
  fit, F = count·2mnk, against the same peak.
- memory-bound kernels: per op, T = c + bytes/rate fitted over the measured sizes
  (``fixed_and_rate``; the sizes default to those of plait train's GPT, whose arrays sit
  in the CPU's caches, so the rate is a cache rate, not DRAM's; c, the kernel's fixed
  cost, is what the planner charges per kernel apart); bandwidth = the best op's rate,
  efficiency = rate/bandwidth; η_mem the harmonic mean (equal bytes through each op:
  on a CPU the rates differ tenfold, GELU's erf and LayerNorm's reductions being
  compute-bound in one thread) over add, gelu, layernorm, layernorm.backward and softmax (``CPU_EFFICIENCY_OPS``: dropout, on by default only
  for Megatron's GPUs, is recorded, not averaged); AdamW its own (on its one-tensor
  steps: the ``optimizer_efficiency`` a profile must carry).
- the optimizer by tensor size (``memory.optimizer_law``): T = c_step + Σ_t [c_tensor +
  d_t·c_decay + b_t·beta(b_t)], beta with a fitted cache knee
  (``plait.plan.optimizer_cost``), fitted on every AdamW step the calibration timed
  (the size sweep, the tiny steps, plait train's GPT); the planner prices a CPU's
  optimizer with it (``DeviceSpec.optimizer_law``). Absent (null, and
  ``optimizer_law_why`` says why) when the steps do not determine it.
- kernel cost: ``kernel_overhead_s`` = ``eager_autograd_kernel_s`` (dispatch plus
  autograd per kernel of an eager step): an eager CPU run is host bound, nothing
  queues ahead, so every kernel pays it (the GPU profile uses the device gap instead).
- host: the wait for the slowest rank at a synchronising call, measured after the
  kernels (``plait.bench.sync_drift``), fitted as wait = sync_wait_s +
  sync_wait_per_compute·segment (``plait.plan.host``), when the run measured it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path

import numpy as np

from plait.cost.profile import machine_identity
from plait.plan.device_profile import FORMAT, MEMORY_EFFICIENCY_OPS, OPTIMIZER_OP, fit_efficiency_curve
from plait.plan.host import HostModel
from plait.plan.optimizer_cost import fit_optimizer_law

__all__ = ["COMPUTE_PROFILE_STEM", "CPU_EFFICIENCY_OPS", "compute_profile_path", "threads_per_rank",
           "fit_cpu_profile", "load_compute_profile", "host_model_from_profile", "machine_problems"]

COMPUTE_PROFILE_STEM = "device-cpu"
# the memory-bound kernels η_mem averages: the GPU's less dropout (plait train's GPT runs without dropout by
# default, and a CPU's dropout is bound by its Bernoulli draws, not by memory; its rate is recorded all the same)
CPU_EFFICIENCY_OPS = tuple(op for op in MEMORY_EFFICIENCY_OPS if op != "dropout")
# the machine facts a compute profile's numbers depend on (the hostname and plait's version do not change a rate)
MACHINE_FIELDS = ("cpu_model", "cpu_count", "torch_version")
# nominal peaks the GEMM and attention curves are fitted against, in units of the best measured rate
HEADROOMS = (4.0, 64.0)


def compute_profile_path(nprocs: int, cache_dir) -> Path:
    """``cache_dir``/device-cpu-p{nprocs}.json: where `plait calibrate --compute --nprocs N`
    saves and `plait plan --cluster local --nprocs N` looks."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be a whole number >= 1")
    return Path(cache_dir).expanduser() / f"{COMPUTE_PROFILE_STEM}-p{nprocs}.json"


def threads_per_rank(nprocs: int, cores: int) -> int:
    """The intra-op threads plait train gives each of ``nprocs`` ranks on ``cores`` cores:
    max(1, cores // nprocs) (plait.train.world.threads_per_process)."""
    return max(1, int(cores) // max(int(nprocs), 1))


def _scaled_fit(rows, *, t_launch: float) -> tuple[dict, float]:
    """fit_efficiency_curve against a nominal peak of HEADROOMS × the best measured rate
    (the next only when η_max reached its bound of 1); returns the fit and its nominal
    peak. An asymptote beyond the last headroom (rows that do not determine it) stays at
    the bound, and the fit says so (``asymptote_bounded``)."""
    best = max(2.0 * count * m * n * k / seconds for count, m, n, k, seconds in rows)
    for headroom in HEADROOMS:
        nominal = headroom * best
        fit = fit_efficiency_curve(rows, peak=nominal, t_launch=t_launch)
        if fit["eta_max"] < 0.999:
            break
    return {**fit, "asymptote_bounded": fit["eta_max"] >= 0.999}, nominal


def _rescaled(fit: dict, nominal: float, peak: float) -> dict:
    """``fit`` relative to ``peak`` instead of ``nominal``: η and the flop-weighted η scale
    by nominal/peak, peak·η (what the model uses) is unchanged."""
    ratio = nominal / peak
    # peak >= eta_max·nominal, so eta_max·ratio <= 1 but for rounding (DeviceSpec requires eta_max <= 1); a scale
    # the solver left at -1e-15 (its bound 0 less rounding) is 0 (DeviceSpec requires m0, n0, k0 >= 0)
    return {**fit, "eta_max": min(fit["eta_max"] * ratio, 1.0), "peak_flops_per_s": peak,
            **{key: max(float(fit[key]), 0.0) for key in ("m0", "n0", "k0")},
            "efficiency_flop_weighted": fit["efficiency_flop_weighted"] * ratio}


def _require(container, key: str, where: str):
    if not isinstance(container, dict) or key not in container:
        raise ValueError(f"{where}: missing key {key!r}")
    return container[key]


def fixed_and_rate(nbytes, seconds) -> tuple[float, float]:
    """T = c + bytes/rate fitted to one op's sizes by least squares on relative error,
    c >= 0 (c = 0 and rate = bytes/T for a single size); returns (c, rate in bytes/s)."""
    x, y = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(x) > 1:
        (c, per_byte), *_ = np.linalg.lstsq(np.stack([1.0 / y, x / y], axis=1), np.ones(len(y)), rcond=None)
        if c >= 0.0 and per_byte > 0.0:
            return float(c), float(1.0 / per_byte)
    per_byte = float(np.sum(x / y) / np.sum((x / y) ** 2))  # c = 0: min Σ (b·x/y − 1)²
    return 0.0, 1.0 / per_byte


def _memory(rows, where: str) -> dict:
    """Per op its streaming rate (``fixed_and_rate`` over the measured sizes: the fixed
    cost is the per-kernel cost the planner charges apart), bandwidth = the best rate,
    efficiency = rate/bandwidth; η_mem the harmonic mean over CPU_EFFICIENCY_OPS."""
    by_op: dict[str, list[dict]] = {}
    for index, row in enumerate(rows):
        for key in ("op", "numel", "bytes", "seconds"):
            _require(row, key, f"{where}: memory[{index}]")
        by_op.setdefault(row["op"], []).append(row)
    missing = [op for op in (*MEMORY_EFFICIENCY_OPS, OPTIMIZER_OP) if op not in by_op]
    if missing:
        raise ValueError(f"{where}: 'memory' has no rows for {', '.join(missing)}")
    per_op = {}
    # AdamW's rate on its one-tensor steps (its many-tensor steps are the size law's: _optimizer_law)
    by_op[OPTIMIZER_OP] = [row for row in by_op[OPTIMIZER_OP] if row.get("tensors", 1) == 1] or by_op[OPTIMIZER_OP]
    for op, found in by_op.items():
        fixed_s, rate = fixed_and_rate([row["bytes"] for row in found], [row["seconds"] for row in found])
        per_op[op] = {"numels": sorted(row["numel"] for row in found), "fixed_s": fixed_s, "gbps": rate / 1e9}
    bandwidth = max(entry["gbps"] for entry in per_op.values()) * 1e9
    for entry in per_op.values():
        entry["efficiency"] = entry["gbps"] * 1e9 / bandwidth
    return {"per_op": per_op, "efficiency_ops": list(CPU_EFFICIENCY_OPS),
            # equal bytes through each op take Σ 1/η_i: the harmonic mean (the rates differ tenfold on a CPU)
            "efficiency": statistics.harmonic_mean([per_op[op]["efficiency"] for op in CPU_EFFICIENCY_OPS]),
            "optimizer_op": OPTIMIZER_OP, "optimizer_efficiency": per_op[OPTIMIZER_OP]["efficiency"],
            "bandwidth_bytes_per_s": bandwidth}


def _optimizer_law(rows) -> tuple[dict | None, str]:
    """(law as a dict with its fit's report, '') fitted to the AdamW steps that carry
    their tensor groups; (None, why) when they do not determine it."""
    steps = [row for row in rows if row.get("op") == OPTIMIZER_OP and row.get("groups")]
    try:
        law, report = fit_optimizer_law(steps)
    except ValueError as error:
        return None, str(error)
    return {**law.as_dict(), "fit": report}, ""


def fit_cpu_profile(kernels: dict, *, name: str, source: str = "") -> dict:
    """The device profile (a JSON-able dict, ``plait.device_profile/1``, no vendor) fitted
    to ``kernels`` (``plait.bench.compute_calibrate``'s JSON; module docstring: the model)."""
    where = f"compute kernels {source or 'measurement'}"
    dtype = str(_require(kernels, "dtype", where))
    launch = _require(kernels, "launch", where)
    eager_s = float(_require(launch, "eager_autograd_kernel_s", f"{where}: launch"))
    dispatch_s = float(_require(launch, "dispatch_s", f"{where}: launch"))
    matmul_rows = [(1, r["m"], r["n"], r["k"], r["seconds"]) for r in _require(kernels, "matmul", where)]
    attention_rows = [(r["batch"], r["m"], r["n"], r["k"], r["seconds"]) for r in _require(kernels, "attention", where)]
    if not matmul_rows:
        raise ValueError(f"{where}: 'matmul' has no rows to fit")
    mm_s = float(_require(launch, "matmul_s", f"{where}: launch"))
    matmul, matmul_nominal = _scaled_fit(matmul_rows, t_launch=mm_s)
    curves = [(matmul, matmul_nominal)]
    attention = None
    if attention_rows:
        bmm_s = float(_require(launch, "bmm_s", f"{where}: launch"))
        attention, attention_nominal = _scaled_fit(attention_rows, t_launch=bmm_s)
        curves.append((attention, attention_nominal))
    best = max(2.0 * count * m * n * k / seconds for count, m, n, k, seconds in matmul_rows + attention_rows)
    peak = max(best, *(fit["eta_max"] * nominal for fit, nominal in curves))
    matmul = _rescaled(matmul, matmul_nominal, peak)
    if attention is not None:
        attention = _rescaled(attention, attention_nominal, peak)
    memory = _memory(_require(kernels, "memory", where), where)
    memory["optimizer_law"], why = _optimizer_law(kernels["memory"])
    if why:
        memory["optimizer_law_why"] = why
    facts = dict(kernels.get("facts", {}))
    nprocs = int(_require(facts, "nprocs", f"{where}: facts"))
    profile = {
        "format": FORMAT, "name": name, "vendor": None, "source": source, "facts": facts, "dtype": dtype,
        "device": {"peak_flops_per_s": {dtype: peak},
                   "memory_bytes": float(_require(facts, "memory_bytes", f"{where}: facts")) / nprocs,
                   "memory_bandwidth_bytes_per_s": memory["bandwidth_bytes_per_s"],
                   "eager": True,  # a kernel per tensor: the optimizer and the norm run eagerly (DeviceSpec.eager)
                   "vendor_source": f"measured: best rates of {len(matmul_rows) + len(attention_rows)} products and "
                                    f"{len(memory['per_op'])} memory-bound kernels, {nprocs} ranks at once"},
        "launch": {"kernel_overhead_s": eager_s, "kernel_s": float(launch.get("kernel_s", dispatch_s)),
                   "dispatch_s": dispatch_s, "eager_autograd_kernel_s": eager_s, "matmul_s": mm_s,
                   "bmm_s": launch.get("bmm_s"), "used": "eager_autograd_kernel_s",
                   "why": "an eager CPU run is host bound: every kernel pays dispatch and autograd, nothing "
                          "queues ahead of the compute"},
        "matmul": matmul, "attention": attention, "memory": memory, "copies": {},
    }
    if kernels.get("host") is not None:
        profile["host"] = kernels["host"]
    return profile


def machine_problems(profile: dict) -> list[str]:
    """'field: stored X, now Y' for each of MACHINE_FIELDS where ``profile``'s machine
    differs from this one (an empty list: measured here)."""
    stored = profile.get("facts", {}).get("machine", {}) if isinstance(profile, dict) else {}
    now = dataclasses.asdict(machine_identity())
    return [f"{key}: stored {stored.get(key)!r}, now {now[key]!r}" for key in MACHINE_FIELDS
            if stored.get(key) != now[key]]


def load_compute_profile(path, *, nprocs: int, dtype: str) -> tuple[dict | None, str]:
    """The compute profile at ``path`` and '' when it is usable for ``nprocs`` ranks in
    ``dtype`` on this machine; else (None, why not). Raises ValueError when the file
    exists but is not a readable profile."""
    path = Path(path)
    if not path.is_file():
        return None, f"no compute profile at {path} (run `plait calibrate --compute --nprocs {nprocs}`)"
    try:
        profile = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"compute profile {path} cannot be read ({error}): re-run "
                         f"`plait calibrate --compute --nprocs {nprocs}`") from None
    if not isinstance(profile, dict) or profile.get("format") != FORMAT:
        raise ValueError(f"compute profile {path} is not a {FORMAT} profile: re-run "
                         f"`plait calibrate --compute --nprocs {nprocs}`")
    measured_nprocs = profile.get("facts", {}).get("nprocs")
    if measured_nprocs != nprocs:
        return None, f"compute profile {path} was measured with {measured_nprocs} ranks, not {nprocs}"
    if dtype not in profile.get("device", {}).get("peak_flops_per_s", {}):
        return None, (f"compute profile {path} measured {profile.get('dtype')!r}, not {dtype!r} (run `plait "
                      f"calibrate --compute --nprocs {nprocs} --dtype {dtype}`)")
    problems = machine_problems(profile)
    if problems:
        return None, f"compute profile {path} was measured on another machine ({'; '.join(problems)})"
    profile["device"]["eager"] = True  # a CPU's: profiles fitted before the field was written run eagerly too
    return profile, ""


def host_model_from_profile(profile: dict | None, *, nprocs: int, cores: int | None = None) -> HostModel:
    """How ``nprocs`` ranks share this machine's ``cores`` (default os.cpu_count()) at the
    threads plait train gives each, with the wait for the slowest rank from the
    profile's "host" section when it was measured for these ranks and cores (else 0,
    and the source says so)."""
    cores = cores or os.cpu_count() or 1
    threads = threads_per_rank(nprocs, cores)
    host = (profile or {}).get("host")
    if isinstance(host, dict) and host.get("ranks") == nprocs and host.get("cores") == cores:
        known = {item.name for item in dataclasses.fields(HostModel)}
        return HostModel(**{key: value for key, value in host.items() if key in known})
    why = ("the compute profile has no sync-wait measurement for these ranks and cores" if profile is not None
           else "no compute profile")
    return HostModel(ranks=nprocs, cores=cores, threads_per_rank=threads,
                     source=f"{why}: the wait for the slowest rank is not priced")
