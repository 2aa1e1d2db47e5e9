"""Gradient buckets: parameters grouped, in reverse registration order, into flat
buffers of at most ``bucket_nbytes`` so that each bucket's all-reduce can start as
soon as backward has produced all of its gradients (backward visits the last
layers first). A parameter larger than the cap gets a bucket of its own; a bucket
holds one dtype and one device. As in DDP, the first bucket (the last layers) is
capped at 1 MiB so that communication starts early in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from plait.compress.base import GradBucket
from plait.parallel.data.local_tensors import local_tensor

FIRST_BUCKET_NBYTES = 1 << 20


@dataclass
class Bucket:
    """One bucket: its parameters (in buffer order), the flat buffer, and per-backward
    bookkeeping."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    buffer: torch.Tensor  # (sum of the parameters' numel,)
    views: list[torch.Tensor]  # views of buffer shaped like each parameter
    pending: int = 0  # gradients still to arrive in this backward
    ready: list[bool] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        self.pending = len(self.params)
        self.ready = [False] * len(self.params)

    def as_grad_bucket(self, step: int) -> GradBucket:
        return GradBucket(index=self.index, buffer=self.buffer, views=list(zip(self.names, self.views)), step=step)


def assign_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_nbytes: int,
                   first_bucket_nbytes: int = FIRST_BUCKET_NBYTES) -> list[list[int]]:
    """Indices into ``named_params`` per bucket: reverse order, cut when adding the
    next parameter would pass the cap (``min(first_bucket_nbytes, bucket_nbytes)``
    for the first bucket, ``bucket_nbytes`` after) or change dtype/device."""
    if bucket_nbytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_nbytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    current_nbytes = 0
    current_kind = None
    for index in reversed(range(len(named_params))):
        param = local_tensor(named_params[index][1])  # a DTensor: its local shard
        nbytes = param.numel() * param.element_size()
        kind = (param.dtype, param.device)
        cap = min(first_bucket_nbytes, bucket_nbytes) if not buckets else bucket_nbytes
        if current and (current_nbytes + nbytes > cap or kind != current_kind):
            buckets.append(current)
            current, current_nbytes = [], 0
        current.append(index)
        current_nbytes += nbytes
        current_kind = kind
    if current:
        buckets.append(current)
    return buckets


def build_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_nbytes: int) -> list[Bucket]:
    buckets = []
    for bucket_index, members in enumerate(assign_buckets(named_params, bucket_nbytes)):
        params = [named_params[i][1] for i in members]
        total = sum(local_tensor(param).numel() for param in params)  # a DTensor: its local shard
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for param in map(local_tensor, params):
            views.append(buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        bucket = Bucket(bucket_index, [named_params[i][0] for i in members], params, buffer, views)
        bucket.reset()
        buckets.append(bucket)
    return buckets


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (no autograd)."""
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
