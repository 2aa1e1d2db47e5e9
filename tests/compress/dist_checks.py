"""Rank functions for the multi-process compression tests (top-level, so the harness
can pickle them). Each rank rebuilds every rank's gradient from seeds, runs the
compressor's reduce() on its own and checks it against an oracle computed locally;
it returns (failures, results) so the test can also check that ranks agree."""

from __future__ import annotations

import math

import torch

from plait import comm
from plait.compress import BF16, FP16, QSGD, ErrorFeedback, GradBucket, PowerSGD, RandomK, Sign, TopK

BUCKET_INDEX = 7


def payload_compressors() -> dict:
    """Fresh instances, so ErrorFeedback replicas start with empty residuals."""
    return {
        "topk": TopK(0.05),
        "topk+ef": ErrorFeedback(TopK(0.05)),
        "randomk+ef": ErrorFeedback(RandomK(0.05, seed=5)),
        "sign": Sign(),
        "sign+ef": ErrorFeedback(Sign(scaled=True)),
        "qsgd2": QSGD(2),
        "qsgd4": QSGD(4, seed=1),
        "qsgd8+ef": ErrorFeedback(QSGD(8)),
        "fp16": FP16(),
        "bf16": BF16(),
    }


def gradient(rank: int, step: int, numel: int, dtype=torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)


UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24, torch.float64: 2.0**-53}


def check_payload_reduce(rank, world_size, numel, steps, dtype=torch.float64, algorithm="auto"):
    """reduce() == aggregate() of every rank's payload, replayed here; casts within rounding."""
    failures, results = [], {}
    for name, compressor in payload_compressors().items():
        replicas = [payload_compressors()[name] for _ in range(world_size)]  # one per simulated rank
        for step in range(steps):
            bucket = GradBucket(BUCKET_INDEX, gradient(rank, step, numel, dtype).clone(), [], step)
            if step % 2 == 0:
                sent = compressor.reduce(bucket, algorithm=algorithm)
            else:  # as DataParallel calls it: a job on the comm thread, its collectives inline
                job = lambda: compressor.reduce(bucket, algorithm=algorithm)  # noqa: B023, E731
                handle = comm.enqueue(job, f"{name} reduce")
                handle.wait(60)
                sent = handle.result
            inputs = [gradient(r, step, numel, dtype) for r in range(world_size)]
            payloads = [replicas[r].compress(inputs[r], rank=r, step=step, key=BUCKET_INDEX)
                        for r in range(world_size)]
            if sent != payloads[rank].nbytes or sent != compressor.wire_nbytes(numel, dtype):
                failures.append(f"{name} step {step}: reduce returned {sent} bytes, payload holds "
                                f"{payloads[rank].nbytes}, wire_nbytes {compressor.wire_nbytes(numel, dtype)}")
            if name in ("fp16", "bf16"):
                # reduce sums c_r = cast(x_r / p) in the 16-bit dtype: each of the p-1 additions
                # rounds with unit roundoff u, so |result - Σ c_r| <= (p-1)·u·Σ|c_r| (first order;
                # the 1.01 covers the second-order terms), plus u_buffer·|Σ c_r| for the copy back
                # into the buffer's dtype. u = 2^-11 (fp16), 2^-8 (bf16).
                wire = torch.float16 if name == "fp16" else torch.bfloat16
                casts = [(x / world_size).to(wire).to(torch.float64) for x in inputs]
                exact = sum(casts)
                bound = 1.01 * ((world_size - 1) * UNIT_ROUNDOFF[wire] * sum(c.abs() for c in casts)
                                + UNIT_ROUNDOFF[dtype] * exact.abs())
                if not bool(((bucket.buffer.to(torch.float64) - exact).abs() <= bound).all()):
                    failures.append(f"{name} step {step}: beyond (p-1)·u·Σ|c_r| of the exact sum")
            elif not torch.equal(bucket.buffer, replicas[0].aggregate(payloads)):
                failures.append(f"{name} step {step}: reduce differs from the local aggregate")
            results[f"{name}/{step}"] = bucket.buffer.clone()
    return failures, results


def _bucket(index, step, shapes, rank, dtype=torch.float64, scale=None):
    """A bucket holding rank ``rank``'s gradients for ``shapes`` (name -> shape)."""
    numel = sum(math.prod(shape) for shape in shapes.values())
    buffer = torch.empty(numel, dtype=dtype)
    views, offset = [], 0
    for position, (name, shape) in enumerate(shapes.items()):
        size = math.prod(shape)
        view = buffer[offset : offset + size].view(shape)
        if scale is None:
            generator = torch.Generator().manual_seed(10_000 * step + 100 * rank + position)
            view.copy_(torch.randn(shape, generator=generator, dtype=torch.float64))  # the same values in any dtype
        else:
            view.copy_(scale(name, shape, rank, step))
        views.append((name, view))
        offset += size
    return GradBucket(index, buffer, views, step)


# every matrix has min(n, m) = 4, so rank 4 is full rank for all of them
FULL_RANK_SHAPES = {"fc1.weight": (4, 10), "fc1.bias": (4,), "conv.weight": (4, 2, 3, 3), "fc2.weight": (12, 4),
                    "gain": ()}


def check_powersgd_full_rank(rank, world_size, steps, dtype=torch.float64, tolerance=1e-10, algorithm="auto"):
    """rank = min(n, m): every step reproduces the exact mean of all ranks' gradients
    (the only error is rounding, amplified by cond(P) of a random Q: in float64 a
    relative 1e-10 leaves several orders of margin). Also start_iter and cold start."""
    failures, results = [], {}
    for label, compressor in {"warm": PowerSGD(4), "cold": PowerSGD(4, warm_start=False),
                              "start_iter": PowerSGD(1, start_iter=2)}.items():
        for step in range(steps):
            bucket = _bucket(0, step, FULL_RANK_SHAPES, rank, dtype)
            expected = sum(_bucket(0, step, FULL_RANK_SHAPES, r, torch.float64).buffer
                           for r in range(world_size)) / world_size
            predicted = compressor.bucket_wire_nbytes(bucket)
            sent = compressor.reduce(bucket, algorithm=algorithm)
            if sent != predicted:
                failures.append(f"{label} step {step}: sent {sent} bytes, bucket_wire_nbytes {predicted}")
            if label == "start_iter" and step >= 2:
                continue  # rank 1 after start_iter is lossy; only the uncompressed steps are exact
            error = float((bucket.buffer.to(torch.float64) - expected).norm() / expected.norm())
            if error > tolerance:
                failures.append(f"{label} step {step}: relative error {error:.3g} > {tolerance:g}")
            results[f"{label}/{step}"] = bucket.buffer.clone()
    # a bucket of 1-D tensors only: one all-reduce, uncompressed, exact
    biases = {"b1": (5,), "b2": (3,)}
    bucket = _bucket(3, 0, biases, rank, dtype)
    expected = sum(_bucket(3, 0, biases, r, torch.float64).buffer for r in range(world_size)) / world_size
    sent = PowerSGD(2).reduce(bucket)
    if sent != 8 * bucket.buffer.element_size() or not torch.allclose(bucket.buffer.to(torch.float64), expected,
                                                                     rtol=tolerance, atol=0):
        failures.append(f"biases-only bucket: sent {sent} bytes, got {bucket.buffer} for {expected}")
    results["biases"] = bucket.buffer.clone()
    return failures, results


def _rank_one(name, shape, rank, step):
    """G_r = a_r · u v^T (u, v shared by the ranks at this step): the mean is rank 1."""
    generator = torch.Generator().manual_seed(500 + step)
    u = torch.randn(shape[0], 1, generator=generator, dtype=torch.float64)
    v = torch.randn(1, math.prod(shape[1:]), generator=generator, dtype=torch.float64)
    return ((rank + 1.5) * u @ v).view(shape)


def _decaying(name, shape, rank, step):
    """G_r = U diag(10^-k) V^T + N_r - mean(N): the mean has singular values 1, 0.1, 0.01, ...
    so the best rank-r error drops tenfold per extra rank."""
    n, m = shape
    generator = torch.Generator().manual_seed(900 + step)
    u = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(m, n, generator=generator, dtype=torch.float64)).Q
    mean = u @ torch.diag(10.0 ** -torch.arange(n, dtype=torch.float64)) @ v.T
    noises = [torch.randn(n, m, generator=generator, dtype=torch.float64) for _ in range(3)]  # world size 3
    noise_mean = sum(noises) / 3
    return mean + noises[rank] - noise_mean


def check_powersgd_low_rank(rank, world_size):
    """Rank 1 is exact when the mean gradient has rank 1. On a spectrum decaying tenfold
    per singular value the error falls strictly with the rank, never beats the best
    rank-r error (Eckart-Young: ||tail singular values|| / ||all||), and vanishes at full
    rank. (One power step from a random Q without oversampling can sit well above the
    optimum, so no tighter upper bound is asserted.)"""
    failures, errors = [], {}
    shapes = {"w": (6, 9), "w3": (3, 2, 5)}
    compressor = PowerSGD(1)
    for step in range(2):
        bucket = _bucket(1, step, shapes, rank, scale=_rank_one)
        expected = sum(_bucket(1, step, shapes, r, scale=_rank_one).buffer for r in range(world_size)) / world_size
        compressor.reduce(bucket)
        error = float((bucket.buffer - expected).norm() / expected.norm())
        if error > 1e-10:
            failures.append(f"rank-1 gradients, step {step}: relative error {error:.3g} > 1e-10")
    assert world_size == 3, "_decaying's noise cancels over 3 ranks"
    singular = 10.0 ** -torch.arange(8, dtype=torch.float64)
    for r in (1, 2, 4, 8):
        bucket = _bucket(2, 0, {"w": (8, 20)}, rank, scale=_decaying)
        expected = sum(_bucket(2, 0, {"w": (8, 20)}, q, scale=_decaying).buffer for q in range(3)) / 3
        PowerSGD(r).reduce(bucket)
        errors[r] = float((bucket.buffer - expected).norm() / expected.norm())
        best = float(singular[r:].norm() / singular.norm())
        if errors[r] < best * (1 - 1e-6):
            failures.append(f"rank {r}: error {errors[r]:.3g} beats the optimum {best:.3g}?")
    for low, high in ((1, 2), (2, 4), (4, 8)):
        if not errors[high] < errors[low]:
            failures.append(f"error did not fall from rank {low} to {high}: {errors}")
    if errors[8] > 1e-10:
        failures.append(f"full rank 8 of an 8x20 matrix is not exact: {errors[8]:.3g}")
    return failures, errors
