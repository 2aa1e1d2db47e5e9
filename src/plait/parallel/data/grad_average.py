"""The hybrid trainer's data-parallel gradient average: flat buckets, each all-reduced
as soon as its gradients are final, while the backward goes on (as DDP does).

``GradAverage(named, group, ...)`` holds this rank's trainable parameters cut into
flat buckets (``bucket_layout``) and a post-accumulate-grad hook on each. Between
``begin_step()`` and ``finish()`` a hook counts the gradient accumulations of its
parameter; at the ``expected`` count (a pipeline stage's parameter accumulates once
per micro-batch: only the last micro-batch's backward can finish it, which is DDP's
``no_sync`` for the micro-batches before) the parameter is final, and once every
parameter of a bucket is, and every bucket before it in launch order has been
launched (so every rank issues the same all-reduces in the same order), the bucket
is flattened, cast to the reduce dtype and its all-reduce queued on plait's comm
thread (``async_op=True``). ``finish()`` launches what is left (parameters the
backward did not reach, or whose gradient changes after the backward: ``late``, e.g.
a weight shared with another pipeline rank, summed over them after the flush),
waits for every bucket, divides by dp and sets each ``.grad`` to its view of the
averaged bucket.

Exactness (the losses of a run are bit-identical to the non-overlapped average):
every element is summed by the same all-reduce arithmetic, so what can change the
bits is only the bucket an element sits in and its place there (an algorithm's
chunking decides which rank's value is added first). With two dp ranks each element
is one addition a + b, which IEEE 754 makes commutative: any bucketing gives the same
bits, so DDP's layout is used (reverse parameter order, the first bucket capped at
1 MiB so the reduction starts early in the backward: ``plait.parallel.data.buckets``).
With more ranks the order of the additions depends on the position, so the layout
the trainer has always used is kept (``forward_buckets``: parameter order, 25 MiB),
each bucket launched as soon as it is complete (the last bucket first); a model of
less than 25 MiB is then one bucket, launched when the backward ends.

Cost per step: the same all-reduce bytes as one after the backward (2(p-1)/p · n per
rank with a ring, in ``ceil(n / 25 MiB)`` (+1) calls); a hook call per parameter per
micro-batch (~1 µs); what is exposed is what the comm thread has not finished when
the backward (and the pipeline's flush) ends: at least the last bucket's all-reduce.
Overlap hides waiting (a peer's skew, latency), not the reduction's own CPU work: on a
host whose cores all compute (2 ranks on 2 cores) the comm thread's copies and sums
take the rank's core, and a step alternating with the non-overlapped one measured
2.3-3.3 ms less dp time for 3.3-4.5 ms more compute (dp2, gloo and shm alike).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from plait import comm
from plait.memory.precision import REDUCE_DTYPE
from plait.names.precision import FP32
from plait.compress.base import GradBucket
from plait.parallel.data.buckets import assign_buckets
from plait.parallel.data.weak_hooks import weak_method

BUCKET_BYTES = 25 << 20  # DDP's default bucket cap


def forward_buckets(named, bucket_bytes: int = BUCKET_BYTES):
    """``named`` ((name, parameter) pairs) in order, cut when the next parameter would pass
    ``bucket_bytes`` or change dtype: the hybrid trainer's buckets before the overlap."""
    bucket, size, dtype = [], 0, None
    for name, param in named:
        nbytes = param.numel() * param.element_size()
        if bucket and (size + nbytes > bucket_bytes or param.dtype != dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, param))
        size, dtype = size + nbytes, param.dtype
    if bucket:
        yield bucket


def bucket_layout(named, dp: int) -> tuple[list[list[tuple[str, nn.Parameter]]], list[int]]:
    """(buckets, launch order) for ``dp`` ranks (module docstring: exact either way).
    dp = 2: DDP's layout, launched in index order; else ``forward_buckets`` launched
    last first (the order the backward completes them)."""
    named = list(named)
    if dp == 2:
        buckets = [[named[index] for index in members] for members in assign_buckets(named, BUCKET_BYTES)]
        return buckets, list(range(len(buckets)))
    buckets = list(forward_buckets(named))
    return buckets, list(reversed(range(len(buckets))))


def reduce_dtype_for(flat_dtype: torch.dtype, grad_reduce_dtype: str) -> torch.dtype:
    """What the all-reduce sends: "fp32" at least float32 (a float64 model's gradients are
    not rounded); bf16 / fp16: a 16-bit copy."""
    reduce_dtype = REDUCE_DTYPE[grad_reduce_dtype]
    return torch.promote_types(flat_dtype, reduce_dtype) if grad_reduce_dtype == FP32 else reduce_dtype


def flat_gradient(bucket) -> torch.Tensor:
    """The bucket's gradients in one flat tensor (zeros for a parameter without one)."""
    return torch.cat([(param.grad if param.grad is not None else torch.zeros_like(param)).reshape(-1)
                      for _, param in bucket])


def set_gradients(bucket, flat: torch.Tensor) -> None:
    """Each parameter's ``.grad`` := its slice of ``flat`` (a view: ``flat`` is this step's own)."""
    offset = 0
    for _, param in bucket:
        param.grad = flat[offset:offset + param.numel()].view_as(param)
        offset += param.numel()


def average_after_backward(named, group, dp: int, *, algorithm: str, grad_reduce_dtype: str, compressor,
                           step: int) -> None:
    """The average after the backward, bucket after bucket (``forward_buckets``: one
    all-reduce each, 2(dp-1)/dp · n bytes per rank with a ring), or through the
    compressor, which reports its own bytes."""
    if compressor is not None:
        # tp-replicated parameters in buckets of their own, first: every tp rank then
        # compresses them identically (same bucket index, seed and residual), so lossy
        # compression cannot make the replicas drift apart
        sharded = [(name, param) for name, param in named if getattr(param, "tp_shard", None) is not None]
        replicated = [(name, param) for name, param in named if getattr(param, "tp_shard", None) is None]
        buckets = [*forward_buckets(replicated), *forward_buckets(sharded)]
    else:  # an exact average needs no such split: as few all-reduces as the 25 MiB cap allows
        buckets = list(forward_buckets(named))
    for index, bucket in enumerate(buckets):
        flat = flat_gradient(bucket)
        if compressor is not None:
            views, offset = [], 0
            for name, param in bucket:
                views.append((name, flat[offset:offset + param.numel()].view_as(param)))
                offset += param.numel()
            compressor.reduce(GradBucket(index, flat, views, step), group, algorithm=algorithm)
        else:
            sent = flat.to(reduce_dtype_for(flat.dtype, grad_reduce_dtype))
            comm.all_reduce(sent, group=group, algorithm=algorithm)
            flat = sent.to(flat.dtype) if sent is not flat else flat
            flat /= dp
        offset = 0
        for _, param in bucket:
            param.grad = flat[offset:offset + param.numel()].view_as(param).clone()
            offset += param.numel()


class GradAverage:
    """The overlapped dp average of one rank's gradients (see the module docstring).

    ``named``: (name, parameter) pairs, the trainable ones, in model order; ``group``:
    the dp group of ``dp`` ranks; ``expected``: name -> accumulations per step after
    which the gradient is final (absent: ``late``, launched in ``finish``)."""

    def __init__(self, named, group, dp: int, *, algorithm: str, grad_reduce_dtype: str, expected: dict[str, int]):
        self.group, self.dp, self.algorithm = group, dp, algorithm
        self.grad_reduce_dtype = grad_reduce_dtype
        self.buckets, self.order = bucket_layout(named, dp)
        self._where = {id(param): (index, name) for index, bucket in enumerate(self.buckets)
                       for name, param in bucket}
        self._expected = {id(param): expected.get(name) for bucket in self.buckets for name, param in bucket}
        # parameters of each bucket not yet final: a hook finalises its own; a bucket holding a late
        # one (summed over other pipeline ranks after the flush, or not reached) never reaches 0 in
        # the backward, so it and every bucket after it in launch order go in finish
        self._hooked = [len(bucket) for bucket in self.buckets]
        self._armed = False
        self._calls: dict[int, int] = {}
        self._pending: list[int] = []
        self._next = 0
        self._in_flight: dict[int, tuple] = {}
        self.handles: list = []  # this step's, in launch order (Handle.started_s: when the comm thread began)
        self.launched_s: list[float] = []  # time.perf_counter() at each launch, in launch order
        self._hooks = [param.register_post_accumulate_grad_hook(weak_method(self._on_grad))
                       for bucket in self.buckets for _, param in bucket]

    def begin_step(self) -> None:
        """Before the step's first backward: counts reset, hooks armed."""
        self._calls = {key: 0 for key in self._expected}
        self._pending = list(self._hooked)
        self._next = 0
        self._in_flight = {}
        self.handles, self.launched_s = [], []
        self._armed = True

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        key = id(param)
        index, name = self._where[key]
        if index in self._in_flight:
            raise RuntimeError(f"the gradient of {name!r} was accumulated again after its bucket's data-parallel "
                               f"all-reduce was launched ({self._calls[key]} accumulations expected per step): "
                               "its average would miss it; run one backward per micro-batch of the schedule")
        self._calls[key] += 1
        if self._calls[key] == self._expected[key]:
            self._pending[index] -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._pending[self.order[self._next]] == 0:
            self._launch(self.order[self._next])

    def _launch(self, index: int) -> None:
        flat = flat_gradient(self.buckets[index])
        sent = flat.to(reduce_dtype_for(flat.dtype, self.grad_reduce_dtype))
        handle = comm.all_reduce(sent, group=self.group, algorithm=self.algorithm, async_op=True)
        self._in_flight[index] = (flat, sent, handle)
        self.handles.append(handle)
        self.launched_s.append(time.perf_counter())
        self._next += 1

    def finish(self) -> None:
        """After the backward (and the pipeline's closing sums): the buckets not yet
        launched go now, in launch order; every one is waited for, averaged and each
        parameter's ``.grad`` set to its view."""
        self._armed = False
        while self._next < len(self.order):
            self._launch(self.order[self._next])
        for index in self.order:
            flat, sent, handle = self._in_flight[index]
            handle.wait()
            flat = sent.to(flat.dtype) if sent is not flat else flat
            flat /= self.dp
            set_gradients(self.buckets[index], flat)
        self._in_flight = {}

    def abort(self) -> None:
        """A failed step: disarmed, in-flight reductions forgotten (the comm layer's
        deadlines end them)."""
        self._armed = False
        self._in_flight = {}
