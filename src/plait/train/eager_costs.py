"""This process's eager per-kernel cost and elementwise bandwidth, timed in ~50 ms at the
end of a run by every rank at once (so the sharing of the cores is in them): with the
run's matmul rate they make the device the run report's plan is priced on
(``plait.train.plan_compare.run_device``)."""

from __future__ import annotations

import math
import time

import torch

from plait.plan.device import autograd_chain


def measure_eager_costs(*, device="cpu", seconds: float = 0.02) -> tuple[float, float]:
    """(seconds per eager autograd kernel, elementwise bytes/s) of this process: a chain of
    tiny multiplies forward and backward (dispatch, autograd and launch: 3 kernels per link)
    and an out-of-place add over 4 MiB (read + write), each repeated for ``seconds``."""
    tiny_step, kernels = autograd_chain(device=device)
    x = torch.randn(1 << 20, device=device)
    y = torch.empty_like(x)

    def best_s(call) -> float:
        call()
        best, start_s = math.inf, time.perf_counter()
        while time.perf_counter() - start_s < seconds:
            t0 = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t0)
        return best

    kernel_s = best_s(tiny_step) / kernels
    add_s = best_s(lambda: torch.add(x, 1.0, out=y))
    return kernel_s, 2.0 * x.numel() * x.element_size() / add_s
