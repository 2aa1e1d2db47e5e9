"""The device a layer runs on, as the planner prices it: ``DeviceSpec`` (peaks by dtype,
memory, bandwidth, efficiencies, and for a calibrated device its η(m, n, k) fits). The
model and the presets are described in ``plait.plan.device``; fitting in
``plait.plan.device_profile``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.names.wire import BY_NAME
from plait.plan.layers import LayerCost, backward_matmuls, weight_gradient_matmuls
from plait.plan.optimizer_cost import OptimizerLaw

__all__ = ["DeviceSpec", "DTYPE_BYTES", "GIB", "matmul_efficiency_fit"]

GIB = 1 << 30
# bytes per element of the dtypes the planner prices (plait.names.wire)
DTYPE_BYTES = {name: BY_NAME[name].itemsize for name in ("bfloat16", "float16", "float32", "float64")}


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU process). ``peak_flops_per_s`` maps a dtype name to
    its dense matmul peak; ``matmul_efficiency`` is η, ``memory_efficiency`` η_mem."""

    name: str
    peak_flops_per_s: tuple[tuple[str, float], ...]
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float = 0.8
    memory_efficiency: float = 0.8
    kernel_overhead_s: float = 4e-6
    source: str = ""
    matmul_fit: tuple[float, float, float, float] | None = None
    attention_fit: tuple[float, float, float, float] | None = None
    optimizer_memory_efficiency: float | None = None
    optimizer_law: OptimizerLaw | None = None  # an eager optimizer's cost by tensor size (a calibrated CPU)
    # runs the optimizer and the gradient norm eagerly, a kernel per tensor (a CPU: measure_device, a compute
    # profile); False: fused (a GPU)
    eager: bool = False

    def __post_init__(self) -> None:
        problems = []
        for key in ("memory_bytes", "memory_bandwidth_bytes_per_s"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                problems.append(f"{key}={value!r} must be a finite number > 0")
        for key in ("matmul_efficiency", "memory_efficiency"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                problems.append(f"{key}={value!r} must be in (0, 1]")
        if not (isinstance(self.kernel_overhead_s, (int, float)) and self.kernel_overhead_s >= 0):
            problems.append(f"kernel_overhead_s={self.kernel_overhead_s!r} must be >= 0 seconds")
        if not self.peak_flops_per_s or any(not (isinstance(v, (int, float)) and v > 0)
                                            for _, v in self.peak_flops_per_s):
            problems.append(f"peak_flops_per_s={self.peak_flops_per_s!r} must map dtypes to FLOP/s > 0")
        for key in ("matmul_fit", "attention_fit"):
            fit = getattr(self, key)
            if fit is None:
                continue
            if not (isinstance(fit, tuple) and len(fit) == 4
                    and all(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) for v in fit)
                    and 0 < fit[0] <= 1 and min(fit[1:]) >= 0):
                problems.append(f"{key}={fit!r} must be (eta_max in (0, 1], m0, n0, k0 >= 0) or None")
        if self.optimizer_memory_efficiency is not None and not (
                isinstance(self.optimizer_memory_efficiency, (int, float)) and 0 < self.optimizer_memory_efficiency <= 1):
            problems.append(f"optimizer_memory_efficiency={self.optimizer_memory_efficiency!r} must be in (0, 1] "
                            "or None")
        if not isinstance(self.eager, bool):
            problems.append(f"eager={self.eager!r} must be True or False")
        if self.optimizer_law is not None and not isinstance(self.optimizer_law, OptimizerLaw):
            problems.append(f"optimizer_law={self.optimizer_law!r} must be a plait.plan.optimizer_cost.OptimizerLaw "
                            "or None")
        if problems:
            raise ValueError(f"invalid device {self.name!r}: " + "; ".join(problems))

    @property
    def calibrated(self) -> bool:
        """Whether matmuls are priced by a fitted η(m, n, k)."""
        return self.matmul_fit is not None

    def peak(self, dtype: str) -> float:
        """Dense matmul peak FLOP/s for ``dtype``."""
        peaks = dict(self.peak_flops_per_s)
        if dtype not in peaks:
            raise ValueError(f"device {self.name!r} has no peak for dtype {dtype!r}; it has {', '.join(peaks)}")
        return peaks[dtype]

    def time_s(self, *, flops: float, nbytes: float, kernels: float, dtype: str, matmuls: tuple = ()) -> float:
        """T = kernels·t_kernel + flops/(η·peak) + bytes/(η_mem·bandwidth); with a fit and
        ``matmuls`` (kind, count, m, n, k) the matmul term is Σ count·2mnk/(peak·η(m,n,k))
        instead (``flops`` is then not used)."""
        if self.matmul_fit is not None and matmuls:
            compute = self.matmul_time_s(matmuls, dtype)
        else:
            compute = flops / (self.matmul_efficiency * self.peak(dtype))
        return (kernels * self.kernel_overhead_s + compute
                + nbytes / (self.memory_efficiency * self.memory_bandwidth_bytes_per_s))

    def matmul_time_s(self, matmuls, dtype: str) -> float:
        """Σ count·2mnk / (peak·η(m,n,k)) by the fits (no kernel cost; needs ``matmul_fit``)."""
        if self.matmul_fit is None:
            raise ValueError(f"device {self.name!r} has no matmul fit (not calibrated from a device profile)")
        peak = self.peak(dtype)
        seconds = 0.0
        for kind, count, m, n, k in matmuls:
            fit = self.attention_fit if kind == "bmm" and self.attention_fit is not None else self.matmul_fit
            seconds += 2.0 * count * m * n * k / (peak * matmul_efficiency_fit(fit, m, n, k))
        return seconds

    def forward_time_s(self, layer: LayerCost, dtype: str) -> float:
        return self.time_s(flops=layer.forward_flops, nbytes=layer.forward_bytes, kernels=layer.forward_kernels,
                           dtype=dtype, matmuls=layer.forward_matmuls)

    def backward_time_s(self, layer: LayerCost, dtype: str) -> float:
        return self.time_s(flops=layer.backward_flops, nbytes=layer.backward_bytes, kernels=layer.backward_kernels,
                           dtype=dtype, matmuls=backward_matmuls(layer.forward_matmuls))

    def weight_gradient_time_s(self, layer: LayerCost, dtype: str) -> float:
        """The weight-gradient half of the backward's matmuls (what zero_bubble defers):
        its (k, n, m) products by the fit, else half the backward FLOPs at η."""
        return self.time_s(flops=layer.backward_flops / 2, nbytes=0.0, kernels=0, dtype=dtype,
                           matmuls=weight_gradient_matmuls(layer.forward_matmuls))

    def core_forward_time_s(self, layer: LayerCost, dtype: str) -> float:
        """The attention core's forward (what selective recomputation re-runs): its
        batched products by the fit, else its FLOPs at η; plus its memory traffic."""
        core = tuple(entry for entry in layer.forward_matmuls if entry[0] == "bmm")
        return self.time_s(flops=layer.core_forward_flops, nbytes=layer.core_forward_bytes, kernels=0, dtype=dtype,
                           matmuls=core)

    def optimizer_time_s(self, nbytes: float, dtype: str, kernels: float = 1, tensors=None) -> float:
        """One optimizer step streaming ``nbytes``. With ``optimizer_law`` (a calibrated
        CPU) and ``tensors``, the (bytes moved per tensor, tensors, decayed tensors)
        groups of the step: the law, T = c_step + Σ_t [c_tensor + d_t·c_decay +
        b_t·beta(b_t)] (``plait.plan.optimizer_cost``; ``nbytes`` and ``kernels`` are then
        not used). Else in ``kernels`` launches (1: a fused step; an eager one launches a
        few per parameter tensor, ``plait.plan.trainer_calls.optimizer_kernels``): T =
        kernels·t_kernel + bytes / (η_opt·bandwidth), η_opt the measured optimizer
        efficiency when the profile has one, else η_mem."""
        if self.optimizer_law is not None and tensors:
            return self.optimizer_law.time_s(tensors)
        if self.optimizer_memory_efficiency is None:
            return self.time_s(flops=0.0, nbytes=nbytes, kernels=kernels, dtype=dtype)
        return kernels * self.kernel_overhead_s + nbytes / (self.optimizer_memory_efficiency
                                                            * self.memory_bandwidth_bytes_per_s)

    def matmul_efficiency_at(self, flops: float, dtype: str) -> float:
        """Achieved fraction of peak of one matmul of ``flops``: η·F / (F + t_kernel·η·peak)."""
        rate = self.matmul_efficiency * self.peak(dtype)
        return flops / (flops + self.kernel_overhead_s * rate) * self.matmul_efficiency

    def describe(self) -> str:
        peaks = ", ".join(f"{k} {v / 1e12:g}" for k, v in self.peak_flops_per_s)
        head = (f"{self.name}: peak TFLOP/s {peaks}; {self.memory_bytes / GIB:.3g} GiB at "
                f"{self.memory_bandwidth_bytes_per_s / 1e9:.4g} GB/s; ")
        if self.matmul_fit is None:
            return (head + f"matmul efficiency {self.matmul_efficiency:.2f}, memory {self.memory_efficiency:.2f}, "
                    f"{self.kernel_overhead_s * 1e6:.3g} us per kernel")

        def fit_text(fit):
            return f"eta_max {fit[0]:.3g}, m0 {fit[1]:.4g}, n0 {fit[2]:.4g}, k0 {fit[3]:.4g}"

        attention = fit_text(self.attention_fit) if self.attention_fit is not None else "the GEMM fit"
        optimizer = ("" if self.optimizer_memory_efficiency is None
                     else f", optimizer {self.optimizer_memory_efficiency:.3g}")
        if self.optimizer_law is not None:
            optimizer += f" (by tensor size: {self.optimizer_law.describe()})"
        return (head + f"calibrated: GEMM eta(m,n,k) {fit_text(self.matmul_fit)}; attention {attention}; "
                f"memory {self.memory_efficiency:.3g}{optimizer}, {self.kernel_overhead_s * 1e6:.3g} us per kernel "
                f"[{self.source}]")


def matmul_efficiency_fit(fit, m: float, n: float, k: float) -> float:
    """η(m, n, k) = η_max / (1 + m0/m + n0/n + k0/k) of a fit (η_max, m0, n0, k0)."""
    eta_max, m0, n0, k0 = fit
    return eta_max / (1.0 + m0 / m + n0 / n + k0 / k)
