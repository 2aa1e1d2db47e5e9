"""PowerSGD: rank-r gradient compression by one step of power iteration (Vogels et al. 2019).

Each gradient with two or more dims is read as an n x m matrix (n = shape[0],
m = the product of the rest). With the error e left over from the last step and a
Q (m x r) shared by all ranks, one step is

    M_i   = G_i + e_i                    (n x m, rank i's gradient plus its error)
    P     = mean_i(M_i Q)                (n x r, all-reduce #1)
    P^    = orthonormalise(P)            (reduced QR; identical on every rank)
    Q     = mean_i(M_i^T P^)             (m x r, all-reduce #2)
    G~    = P^ Q^T = P^ P^^T mean_i(M_i) (the average, projected onto span(P^))
    e_i   = M_i - G~                     (error feedback is built in)

so when r = min(n, m) the projection is the identity and G~ is the exact average.
Every matrix of a bucket travels in one flat buffer per all-reduce, and the
bucket's 1-D tensors (biases, norms) ride uncompressed in the first one: two
all-reduces per bucket, of Σ n·r + (vector elements) and Σ m·r elements. Bytes per
matrix: (n + m)·r·itemsize instead of n·m·itemsize.

Q is drawn from a generator seeded (seed, bucket index, matrix position, step) on
the CPU, so every rank draws the same Q; with ``warm_start`` the averaged Q of one
step seeds the next (one more power step per training step), else it is redrawn.
Before step ``start_iter`` whole buckets are all-reduced uncompressed.

Matrix products run in the gradient's dtype; the QR runs in float32 for 16-bit
dtypes (LAPACK has no half precision). Elements of the buffer that no view covers
(padding) are left as they are.
"""

from __future__ import annotations

import math

import torch

from plait import comm
from plait.compress.base import Compressor, GradBucket, check_floating, check_int, generator_for, group_rank_and_size


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(n, m) of a gradient read as a matrix, or None for tensors sent uncompressed (< 2 dims, empty)."""
    shape = tuple(shape)
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    return shape[0], math.prod(shape[1:])


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with built-in error feedback; two all-reduces per bucket."""

    name = "powersgd"

    def __init__(self, rank: int = 2, warm_start: bool = True, start_iter: int = 0, seed: int = 0):
        self.rank = check_int("PowerSGD", "rank", rank, 1, hint=" (the approximation rank; 1 to 4 is typical)")
        if not isinstance(warm_start, bool):
            raise ValueError(f"PowerSGD warm_start must be True or False, got {warm_start!r}")
        self.warm_start = warm_start
        self.start_iter = check_int("PowerSGD", "start_iter", start_iter, 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"PowerSGD seed must be an int, got {seed!r}")
        self.seed = seed
        self.q_factors: dict[tuple[int, str], torch.Tensor] = {}  # (bucket, name) -> Q (m x r)
        self.errors: dict[tuple[int, str], torch.Tensor] = {}  # (bucket, name) -> e (n x m)

    def reset(self) -> None:
        """Forget every Q and error (e.g. when the model or the bucketing changes)."""
        self.q_factors.clear()
        self.errors.clear()

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """ValueError when ``rank`` exceeds the rank min(n, m) a gradient can have."""
        dims = matrix_shape(shape)
        if dims is None or self.rank <= min(dims):
            return
        n, m = dims
        as_matrix = "" if len(shape) == 2 else f"read as a {n}x{m} matrix, "
        raise ValueError(
            f"PowerSGD rank {self.rank} is larger than the {'x'.join(map(str, shape))} gradient of {name!r} "
            f"({as_matrix}its rank is at most {min(n, m)}); use rank <= {min(n, m)}"
        )

    def validate(self, named_shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        for name, shape in named_shapes:
            self.check_shape(name, tuple(shape))

    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """For a flat tensor of ``numel`` elements, read as a near-square n x m matrix with
        n = ceil(sqrt(numel)), m = ceil(numel / n): (n + m)·rank·itemsize. An estimate for
        sizing; :meth:`bucket_wire_nbytes` gives a bucket's exact figure."""
        check_floating(self.describe(), dtype)
        if numel <= 0:
            return 0
        n = math.isqrt(numel - 1) + 1
        m = -(-numel // n)
        return (n + m) * self.rank * torch.empty((), dtype=dtype).element_size()

    def bucket_wire_nbytes(self, bucket: GradBucket) -> int:
        """This rank's bytes for ``bucket`` at ``bucket.step``: Σ (n + m)·rank over its
        matrices plus its 1-D elements, times itemsize; the whole buffer before start_iter."""
        itemsize = bucket.buffer.element_size()
        if bucket.step < self.start_iter or not bucket.views:
            return bucket.buffer.numel() * itemsize
        elements = 0
        for _, view in bucket.views:
            dims = matrix_shape(view.shape)
            elements += view.numel() if dims is None else (dims[0] + dims[1]) * self.rank
        return elements * itemsize

    def _state(self, key, table, shape, dtype, device, make):
        """table[key], created by ``make()`` and checked against ``shape``."""
        value = table.get(key)
        if value is not None and (tuple(value.shape) != shape or value.dtype != dtype):
            raise ValueError(
                f"{self.describe()}: bucket {key[0]} parameter {key[1]!r} changed from {tuple(value.shape)} "
                f"{value.dtype} to {shape} {dtype}; call PowerSGD.reset() after changing the model or buckets"
            )
        if value is None:
            value = make().to(device=device, dtype=dtype)
        return value

    def _draw_q(self, bucket: GradBucket, position: int, m: int, dtype: torch.dtype) -> torch.Tensor:
        generator = generator_for(torch.device("cpu"), self.seed, bucket.index, position, bucket.step)
        draw_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        return torch.randn((m, self.rank), generator=generator, dtype=draw_dtype)

    def reduce(self, bucket: GradBucket, group=None, *, algorithm="auto") -> int:
        """Two all-reduces (AVG) of Σ(n·r) + vector and Σ(m·r) elements; see the module docstring."""
        _, world_size = group_rank_and_size(group)
        if world_size == 1:
            return 0
        buffer = bucket.buffer
        check_floating(self.describe(), buffer.dtype)
        itemsize = buffer.element_size()
        if bucket.step < self.start_iter or not bucket.views:
            comm.all_reduce(buffer, comm.ReduceOp.AVG, group, algorithm=algorithm)
            return buffer.numel() * itemsize
        r, dtype, device = self.rank, buffer.dtype, buffer.device
        matrices, vectors = [], []
        for position, (name, view) in enumerate(bucket.views):
            dims = matrix_shape(view.shape)
            if dims is None:
                vectors.append(view)
                continue
            self.check_shape(name, tuple(view.shape))
            key = (bucket.index, name)
            error = self._state(key, self.errors, dims, dtype, device, lambda: torch.zeros(dims))
            if self.warm_start:  # last step's averaged Q, or a fresh one the first time
                q = self._state(key, self.q_factors, (dims[1], r), dtype, device,
                                lambda: self._draw_q(bucket, position, dims[1], dtype))
            else:
                q = self._draw_q(bucket, position, dims[1], dtype).to(device=device, dtype=dtype)
            matrices.append((key, view, view.reshape(dims) + error, q))  # M = G + e, (n x m)

        # all-reduce #1: every P = M Q (n x r) and the uncompressed vectors, one flat buffer
        vector_numel = sum(v.numel() for v in vectors)
        first = torch.empty(sum(m.shape[0] * r for _, _, m, _ in matrices) + vector_numel, dtype=dtype, device=device)
        offset = 0
        for _, _, matrix, q in matrices:
            first[offset : offset + matrix.shape[0] * r].view(matrix.shape[0], r).copy_(matrix @ q)
            offset += matrix.shape[0] * r
        for vector in vectors:
            first[offset : offset + vector.numel()].copy_(vector.reshape(-1))
            offset += vector.numel()
        if first.numel():
            comm.all_reduce(first, comm.ReduceOp.AVG, group, algorithm=algorithm)
        offset = first.numel() - vector_numel
        for vector in vectors:
            vector.copy_(first[offset : offset + vector.numel()].view(vector.shape))
            offset += vector.numel()

        # orthonormalise each averaged P (identical on all ranks), then all-reduce #2: Q = M^T P^ (m x r)
        second = torch.empty(sum(m.shape[1] * r for _, _, m, _ in matrices), dtype=dtype, device=device)
        p_hats, offset, q_offset = [], 0, 0
        for _, _, matrix, _ in matrices:
            n, m = matrix.shape
            p_avg = first[offset : offset + n * r].view(n, r)
            qr_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
            p_hat = torch.linalg.qr(p_avg.to(qr_dtype), mode="reduced").Q.to(dtype)
            p_hats.append(p_hat)
            second[q_offset : q_offset + m * r].view(m, r).copy_(matrix.T @ p_hat)
            offset += n * r
            q_offset += m * r
        if matrices:  # a bucket of biases only needs no second round
            comm.all_reduce(second, comm.ReduceOp.AVG, group, algorithm=algorithm)

        q_offset = 0
        for (key, view, matrix, _), p_hat in zip(matrices, p_hats):
            m = matrix.shape[1]
            q_avg = second[q_offset : q_offset + m * r].view(m, r)
            approx = p_hat @ q_avg.T  # (n x m), the same on every rank
            view.copy_(approx.view(view.shape))
            self.errors[key] = matrix.sub_(approx)  # e = M - P^ Q^T, reusing M's memory
            if self.warm_start:
                self.q_factors[key] = q_avg.clone()
            q_offset += m * r
        return (first.numel() + second.numel()) * itemsize

    def describe(self) -> str:
        extras = "" if self.start_iter == 0 else f",start_iter={self.start_iter}"
        extras += "" if self.warm_start else ",warm_start=False"
        return f"powersgd(rank={self.rank}{extras})"
