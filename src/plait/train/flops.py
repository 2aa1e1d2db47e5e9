"""Training FLOPs and the rate they are measured against, for MFU: the GPT's and the
MLP's FLOPs per step (the formulas of DESIGN.md section 6; checked against torch's
FLOP counter in the tests) and this device's measured matmul rate."""

from __future__ import annotations

import time

import torch


def gpt_train_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
                    recompute: bool = False) -> float:
    """FLOPs of one training step (forward + backward) of a GPT on ``batch`` sequences.

    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)), or with full activation recomputation
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)). Pass the global batch to count the whole step."""
    values = {"batch": batch, "seq_len": seq_len, "layers": layers, "hidden": hidden, "vocab": vocab}
    bad = [f"{name}({value!r})" for name, value in values.items()
           if isinstance(value, bool) or not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError(f"gpt_train_flops needs positive ints: {', '.join(bad)}")
    b, s, l, h, v = batch, seq_len, layers, hidden, vocab
    # Expanded, in integers (exact): 72bslh²(1 + s/6h + V/12lh) = 72bslh² + 12bs²lh + 6bshV.
    layer_passes = 4 if recompute else 3  # forward, backward (2×), and the recomputed forward
    return float(layer_passes * 24 * b * s * l * h * h + layer_passes * 4 * b * s * s * l * h + 6 * b * s * h * v)


def mlp_train_flops(batch: int, sizes) -> float:
    """FLOPs of one training step of plait's MLP (Linear widths ``sizes`` = d_0 .. d_L) on
    ``batch`` samples: 6·B·Σ d_i·d_{i+1}, forward 2 and backward 4 per weight and sample
    (the 6N model-FLOPs rule MFU counts; the first layer's input gradient, 2·B·d_0·d_1,
    which autograd skips for a data batch, is counted as for any layer). Biases and
    activations are not matmuls and are not counted."""
    sizes = tuple(sizes)
    values = [("batch", batch), *((f"sizes[{index}]", width) for index, width in enumerate(sizes))]
    bad = [f"{name}({value!r})" for name, value in values
           if isinstance(value, bool) or not isinstance(value, int) or value < 1]
    if len(sizes) < 2:
        bad.append(f"sizes({sizes!r}) needs an input and an output width")
    if bad:
        raise ValueError(f"mlp_train_flops needs positive ints: {', '.join(bad)}")
    return float(6 * batch * sum(a * b for a, b in zip(sizes, sizes[1:])))


def measure_peak_flops(dtype: torch.dtype = torch.float32, size: int = 512, seconds: float = 0.3,
                       *, device: str | torch.device = "cpu") -> float:
    """Achieved FLOP/s of a size×size matmul in this process (2·n³ FLOPs per matmul).

    Not a datasheet number: it is what one process reaches on a large dense matmul with
    its current thread count, the practical ceiling MFU is measured against on CPU.
    Runs warm-up matmuls, then as many as fit in ``seconds``."""
    if not isinstance(size, int) or size < 1 or not seconds > 0:
        raise ValueError(f"measure_peak_flops needs size >= 1 and seconds > 0, got size={size!r}, "
                         f"seconds={seconds!r}")
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    flops_per_matmul = 2.0 * size ** 3
    with torch.no_grad():
        out = torch.empty_like(a)
        for _ in range(3):  # warm-up: allocator, kernel selection, caches
            torch.matmul(a, b, out=out)
        out[0, 0].item()  # waits for queued kernels on an accelerator
        count = 0
        start_s = time.perf_counter()
        while True:
            torch.matmul(a, b, out=out)
            count += 1
            if count % 4 == 0 or count < 4:
                out[0, 0].item()
                elapsed_s = time.perf_counter() - start_s
                if elapsed_s >= seconds:
                    break
    return flops_per_matmul * count / elapsed_s


# ---- aggregation ----------------------------------------------------------------------
