"""Devices: peak FLOP/s by dtype, memory, and how fast a layer runs on one.

The time of work on a device (``plait.plan.layers``):

    T = kernels · t_kernel + matmul FLOPs / (η · peak[dtype]) + other bytes / (η_mem · bandwidth)

Assumptions, stated once: a matmul runs at a fixed fraction η of the dtype's peak
once it is large, and a small one is dominated by the per-kernel cost t_kernel
(launch, dispatch and the tail of the last wave), so its achieved efficiency
F / (T · peak) = η · F / (F + t_kernel · η · peak) falls with its size F; non-matmul
kernels are bound by memory bandwidth at a fraction η_mem; nothing overlaps within one
device's stream. Tile quantisation (dimensions that are not multiples of the tile)
is not modelled.

GPU presets carry vendor peaks (dense, no sparsity) and η assumptions, not
measurements: NVIDIA's cuBLAS reaches roughly 80% of an A100's 312 TFLOP/s on large
bf16 GEMMs and roughly 70% of an H100's 989, which is what η is set to; kernels cost
~4 us each. ``measure_device`` fits t_kernel, η·peak and the bandwidth on the machine
it runs on (this machine's CPU; on a GPU the same code calibrates the preset).

Calibrated devices (``plait.plan.device_profile``): a spec with a ``matmul_fit``
(η_max, m0, n0, k0) prices each matmul a layer names in ``forward_matmuls`` at its own
measured efficiency, η(m, n, k) = η_max / (1 + m0/m + n0/n + k0/k) (small dimensions
waste tiles and waves), ``attention_fit`` the batched products (the attention core;
the GEMM fit when absent):

    matmul term = Σ count·2mnk / (peak · η(m, n, k))

A layer without shapes, or a spec without a fit, keeps flops / (η·peak). The kernel
term kernels·t_kernel is the fit's t_launch (each product is one of the layer's
kernels). ``optimizer_memory_efficiency`` (measured on a fused AdamW step) prices the
optimizer's streaming when given, η_mem otherwise.

This machine (``plait plan --cluster local --nprocs N``): the compute profile `plait
calibrate --compute --nprocs N` saved (``plait.plan.cpu_profile``: every kernel timed
with all N ranks running at once, at the threads plait train gives a rank, fitted into
the GPU's profile format), or, without one, ``measure_device`` (one process alone,
its rates scaled by min(1, cores / N): an assumption, about 2x off on 2 cores).

``DEVICE_PRESETS`` "h100-80gb" is the profile fitted from H100 measurements when
``plait/plan/profiles/h100.json`` is checked in, the A100 (and H200, unless it has
its own ``h200.json``) presets derived from it by peak ratio
(``plait.plan.device_profile.profile_device``); without the file they are the
vendor-peak, assumed-η presets below.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace

import numpy as np

from plait.plan.device_profile import calibrated_presets, load_device_profile
from plait.plan.device_spec import DTYPE_BYTES, GIB, DeviceSpec, matmul_efficiency_fit

__all__ = ["DeviceSpec", "DEVICE_PRESETS", "VENDOR_PRESETS", "device_preset", "measure_device", "autograd_chain", "DTYPE_BYTES",
           "load_device_profile", "matmul_efficiency_fit"]


def _gpu(name, bf16, fp32, tf32, memory_gib, bandwidth, efficiency, source) -> DeviceSpec:
    return DeviceSpec(name=name, peak_flops_per_s=(("bfloat16", bf16), ("float16", bf16), ("tf32", tf32),
                                                   ("float32", fp32)),
                      memory_bytes=memory_gib * GIB, memory_bandwidth_bytes_per_s=bandwidth,
                      matmul_efficiency=efficiency, memory_efficiency=0.8, kernel_overhead_s=4e-6, source=source)


# NVIDIA data sheets: A100 SXM 312 TFLOP/s bf16/fp16 dense, 156 tf32, 19.5 fp32, HBM2 1,555 GB/s
# (40 GB) / HBM2e 2,039 GB/s (80 GB); H100 SXM 989 bf16 dense, 495 tf32, 67 fp32, HBM3 3.35 TB/s;
# H200 SXM the H100's compute with 141 GB HBM3e at 4.8 TB/s. Memory in GiB as nvidia-smi shows it.
VENDOR_PRESETS = {
    "a100-40gb": _gpu("a100-40gb", 312e12, 19.5e12, 156e12, 40, 1555e9, 0.8, "NVIDIA A100 data sheet; eta assumed"),
    "a100-80gb": _gpu("a100-80gb", 312e12, 19.5e12, 156e12, 80, 2039e9, 0.8, "NVIDIA A100 data sheet; eta assumed"),
    "h100-80gb": _gpu("h100-80gb", 989e12, 67e12, 495e12, 80, 3350e9, 0.7, "NVIDIA H100 SXM data sheet; eta assumed"),
    "h200-141gb": _gpu("h200-141gb", 989e12, 67e12, 495e12, 140, 4800e9, 0.7, "NVIDIA H200 data sheet; eta assumed"),
}


# the vendor presets, with those a checked-in profile calibrates replaced
# (plait.plan.device_profile.calibrated_presets)
DEVICE_PRESETS = calibrated_presets(VENDOR_PRESETS)


def device_preset(name: str) -> DeviceSpec:
    spec = DEVICE_PRESETS.get(name)
    if spec is None:
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(DEVICE_PRESETS)} (or 'cpu', measured)")
    return spec


def _least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = a + b·x with a, b >= 0 (relative errors weighted equally)."""

    design = np.array([[1.0 / y, x / y] for x, y in zip(xs, ys)])
    solution, *_ = np.linalg.lstsq(design, np.ones(len(ys)), rcond=None)
    a, b = (max(float(v), 0.0) for v in solution)
    if b == 0.0:
        b = max(y / x for x, y in zip(xs, ys))
    return a, b


def autograd_chain(*, device: str = "cpu", dtype=None, chain: int = 32):
    """(step, kernels): a chain of ``chain`` tiny multiplies run forward and backward, the
    per-kernel cost of eager training (dispatch, autograd bookkeeping and the launch
    together) when timed; ``kernels`` = 3 per link (a multiply forward; its backward a
    multiply and an add)."""
    import torch  # plait.plan stays torch-free at import

    leaf = torch.ones(8, dtype=dtype, device=device, requires_grad=True)

    def step():
        z = leaf
        for _ in range(chain):
            z = z * 1.0001
        z.sum().backward()

    return step, 3 * chain


def measure_device(*, device: str = "cpu", dtype: str = "float32", threads: int | None = 1, processes: int = 1,
                   cores: int | None = None, repeats: int = 5,
                   matmul_shapes: list[tuple[int, int, int]] | None = None) -> DeviceSpec:
    """Measure this machine: time square matmuls (32..512) and elementwise adds (16 KiB..
    64 MiB), fit T = t0 + F / rate and T = t0' + bytes / bandwidth, time a chain of tiny
    autograd ops forward and backward for the per-kernel cost of eager training
    (t_kernel: dispatch, autograd and launch), and return a DeviceSpec with peak = rate
    and η = 1 (the measured rate is achieved).

    ``matmul_shapes`` are the (m, n, k) products to time instead of squares: a CPU
    reaches a very different rate on the skinny products of a small model (a
    (256 x 128)·(128 x 384) runs at about a third of a 512³ square's rate here), so
    ``plait plan --cluster local`` passes the shapes of the model it plans.

    ``processes`` ranks sharing ``cores`` cores (default: os.cpu_count()) each get
    min(1, cores / processes) of the measured single-process rate and bandwidth, as
    ``plait train``'s gloo ranks on this CPU do; memory is the machine's RAM over the
    processes. On ``device="cuda"`` the same fit calibrates a GPU (not run on a
    machine without one).
    """
    import torch

    torch_dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        def timed(call) -> float:
            call()
            if device != "cpu":
                torch.cuda.synchronize()
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                calls = 0
                while True:
                    call()
                    calls += 1
                    if device != "cpu":
                        torch.cuda.synchronize()
                    if time.perf_counter() - start > 0.01:
                        break
                best = min(best, (time.perf_counter() - start) / calls)
            return best

        shapes = matmul_shapes or [(n, n, n) for n in (32, 64, 128, 256, 384, 512)]
        flop_counts, matmul_s = [], []
        for rows, cols, inner in shapes:
            a = torch.randn(rows, inner, dtype=torch_dtype, device=device)
            b = torch.randn(inner, cols, dtype=torch_dtype, device=device)
            flop_counts.append(2.0 * rows * cols * inner)
            matmul_s.append(timed(lambda: a @ b))
        overhead_s, seconds_per_flop = _least_squares(flop_counts, matmul_s)
        byte_counts, add_s = [], []
        for numel in (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24):
            x = torch.randn(numel, dtype=torch_dtype, device=device)
            y = torch.empty_like(x)
            byte_counts.append(2.0 * x.element_size() * numel)
            add_s.append(timed(lambda: torch.add(x, 1.0, out=y)))
        _, seconds_per_byte = _least_squares(byte_counts, add_s)
        # the per-kernel cost of eager training: a chain of tiny autograd ops, forward
        # and backward (dispatch, autograd bookkeeping and the kernel launch together)
        tiny_step, kernels = autograd_chain(device=device, dtype=torch_dtype)
        kernel_s = timed(tiny_step) / kernels
    finally:
        torch.set_num_threads(previous_threads)
    cores = cores or os.cpu_count() or 1
    share = min(1.0, cores / processes) if device == "cpu" else 1.0
    rate = share / seconds_per_flop
    if device == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / processes
    else:
        memory = torch.cuda.get_device_properties(device).total_memory
    spec = DeviceSpec(name=f"{device} (measured)", peak_flops_per_s=((dtype, rate),), memory_bytes=float(memory),
                      memory_bandwidth_bytes_per_s=share / seconds_per_byte, matmul_efficiency=1.0,
                      memory_efficiency=1.0, kernel_overhead_s=max(kernel_s, overhead_s) / share,
                      eager=device == "cpu",
                      source=f"measured: {len(shapes)} matmul {'shapes of the model' if matmul_shapes else 'sizes'}, "
                             f"5 add sizes, an autograd chain, {threads} thread(s), "
                             f"{processes} process(es) on {cores} core(s)")
    return spec


def with_dtype_peak(spec: DeviceSpec, dtype: str, flops_per_s: float) -> DeviceSpec:
    """``spec`` with a peak for one more dtype (e.g. the measured float32 rate for float64 use)."""
    peaks = dict(spec.peak_flops_per_s)
    peaks[dtype] = flops_per_s
    return replace(spec, peak_flops_per_s=tuple(peaks.items()))
