"""Bucketed gradient all-reduce of an auto-parallel plan's replicated parameters, as
DDP does it: the parameters that every reading node splits its work over along the
same mesh axes (data parallelism's weights under a batch-split input) get no per-node
``wrap_replicated``; instead a hook on each local parameter takes this backward's
gradient contribution BEFORE it reaches ``.grad`` (it returns zeros there), copies it
into a flat bucket of its (axes, dtype, device) group, and each bucket is all-reduced
once per axis:

- a bucket is launched (asynchronously, on the axis group's comm thread) as soon as
  all its parameters' contributions have arrived and every bucket before it has been
  launched, so every rank issues the same collectives in the same order (buckets are
  numbered in reverse reading order: backward fills the last layers' buckets first);
- at the end of backward (an autograd engine callback) the buckets not launched yet
  are launched with zeros for the contributions that did not arrive (an unused
  parameter does not hang the others), every bucket is waited for, its remaining axes
  all-reduced, and the SUM is ADDED to ``.grad`` (created when None and some rank gave
  a contribution). Gradient accumulation over several backward passes stays exact:
  each backward's contribution is reduced once, never the accumulated ``.grad``.

Cost per backward: for a bucket of n elements on an axis of p ranks, one ring
all-reduce of 2(p-1)/p n elements (the same bytes as the per-node wraps, in
ceil(total / cap) messages instead of one per node), and one copy of each gradient
into its bucket and one add into ``.grad`` (memory traffic ~3x the gradients').
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from plait import comm

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "GradBucket", "GradBuckets", "assign_grad_buckets"]

DEFAULT_BUCKET_CAP_BYTES = 25 << 20  # DDP's bucket_cap_mb=25
FIRST_BUCKET_CAP_BYTES = 1 << 20  # DDP's first bucket (the last layers'): communication starts early in backward


@dataclass
class GradBucket:
    """One flat buffer of parameters of one dtype and device, reduced over the mesh
    ``axes`` (indices, increasing): ``views`` are the buffer's pieces shaped like each
    local parameter; ``arrived``/``pending``: this backward's contributions."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    axes: tuple[int, ...]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    arrived: list[bool] = field(default_factory=list)
    pending: int = 0
    handle: object = None  # the first axis' async all-reduce, once launched

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        self.arrived = [False] * len(self.params)
        self.pending = len(self.params)
        self.handle = None


def assign_grad_buckets(entries: list[tuple[str, torch.Tensor, tuple[int, ...]]], cap_bytes: int,
                        first_cap_bytes: int = FIRST_BUCKET_CAP_BYTES) -> list[list[int]]:
    """Indices into ``entries`` (name, local parameter, axes) per bucket, in the given
    order: a parameter joins the open bucket of its (axes, dtype, device) group unless
    that would pass the cap (``min(first_cap_bytes, cap_bytes)`` for bucket 0,
    ``cap_bytes`` after; then the group opens a new bucket; a parameter over the cap
    gets one of its own). Buckets are numbered by their first parameter."""
    if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes <= 0:
        raise ValueError(f"bucket cap {cap_bytes!r} must be a whole number of bytes > 0 (DDP's is 25 MiB)")
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[int, int]] = {}  # group -> (bucket index, its bytes)
    for index, (_, param, axes) in enumerate(entries):
        group = (tuple(axes), param.dtype, param.device)
        nbytes = param.numel() * param.element_size()
        current = open_bucket.get(group)
        cap = min(first_cap_bytes, cap_bytes) if current is not None and current[0] == 0 else cap_bytes
        if current is not None and current[1] + nbytes <= cap:
            buckets[current[0]].append(index)
            open_bucket[group] = (current[0], current[1] + nbytes)
        else:
            buckets.append([index])
            open_bucket[group] = (len(buckets) - 1, nbytes)
    return buckets


class _BackwardStart(torch.autograd.Function):
    """Identity on the step's output whose backward opens the buckets' backward (so
    every rank queues the end-of-backward callback, whichever gradients arrive)."""

    @staticmethod
    def forward(ctx, x, buckets):
        ctx.buckets = buckets
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.buckets.begin_backward()
        return grad, None


class GradBuckets:
    """The buckets of ``entries`` (name, local nn.Parameter, mesh axes to reduce over)
    on the per-axis ``axes`` (reshard.AxisComm), hooks registered (see the module
    docstring). ``mark(output)`` in the forward; the rest runs inside backward."""

    def __init__(self, entries: list[tuple[str, nn.Parameter, tuple[int, ...]]], axes, *,
                 cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES):
        self._axes = list(axes)
        self.buckets: list[GradBucket] = []
        for index, members in enumerate(assign_grad_buckets(entries, cap_bytes)):
            params = [entries[i][1] for i in members]
            buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            views, offset = [], 0
            for param in params:
                views.append(buffer[offset:offset + param.numel()].view(param.shape))
                offset += param.numel()
            bucket = GradBucket(index, [entries[i][0] for i in members], params, tuple(entries[members[0]][2]),
                                buffer, views)
            bucket.reset()
            self.buckets.append(bucket)
        self._in_backward = False
        self._next_launch = 0
        # one parameter's AccumulateGrad node (held, so it stays the one autograd runs): tells
        # backward from torch.autograd.grad, whose hooks' zeros would be returned to the caller
        self._probe = self.buckets[0].params[0].view_as(self.buckets[0].params[0]).grad_fn.next_functions[0][0] \
            if self.buckets else None
        self._hooks = [param.register_hook(self._hook(bucket, slot))
                       for bucket in self.buckets for slot, param in enumerate(bucket.params)]

    def describe(self) -> list[tuple[tuple[str, ...], tuple[int, ...], int]]:
        """(parameter names, mesh axes, bytes) per bucket, in launch order."""
        return [(tuple(bucket.names), bucket.axes, bucket.nbytes) for bucket in self.buckets]

    def check_idle(self) -> None:
        """Before a forward: the last backward finished, and the parameters still have
        the dtype and device their buckets were built for."""
        if self._in_backward:
            raise RuntimeError("AutoParallelModule: the previous backward did not finish its bucketed gradient "
                               "all-reduce (it raised or was interrupted); rebuild the module to recover")
        for bucket in self.buckets:
            for name, param in zip(bucket.names, bucket.params):
                if (param.dtype, param.device) != (bucket.buffer.dtype, bucket.buffer.device):
                    raise RuntimeError(f"AutoParallelModule: parameter {name!r} is {param.dtype} on {param.device}, "
                                       f"its gradient bucket {bucket.buffer.dtype} on {bucket.buffer.device}: cast or "
                                       "move the model before auto-parallelizing it")

    def mark(self, output: torch.Tensor) -> torch.Tensor:
        """The step's output, through an identity whose backward starts the buckets'."""
        if not self.buckets or not output.requires_grad:
            return output
        return _BackwardStart.apply(output, self)

    # ----- inside backward ---------------------------------------------------------------------
    def begin_backward(self) -> None:
        if self._in_backward:
            return  # a second output of the same backward (losses summed) or a hook after the start
        try:  # torch's private probe (as torch.utils.checkpoint uses it): it refuses a leaf under autograd.grad
            torch._C._will_engine_execute_node(self._probe)
        except RuntimeError as error:
            raise RuntimeError("AutoParallelModule: torch.autograd.grad of a step whose data-parallel gradients "
                               "are bucketed is not supported (the buckets reduce into .grad at the end of "
                               "backward): call loss.backward() and read each parameter's .grad") from error
        self._in_backward = True
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.reset()
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _hook(self, bucket: GradBucket, slot: int):
        def take(grad: torch.Tensor) -> torch.Tensor:
            self.begin_backward()
            if bucket.arrived[slot]:
                raise RuntimeError(f"AutoParallelModule: parameter {bucket.names[slot]!r} got two gradients in one "
                                   "backward; its bucket may already be on the wire")
            with torch.no_grad():
                bucket.views[slot].copy_(grad)
            bucket.arrived[slot] = True
            bucket.pending -= 1
            self._launch_ready()
            return torch.zeros_like(grad)  # kept out of .grad: the reduced sum is added at the end

        return take

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            bucket = self.buckets[self._next_launch]
            axis = self._axes[bucket.axes[0]]
            bucket.handle = comm.all_reduce(bucket.buffer, comm.ReduceOp.SUM, group=axis.group, async_op=True,
                                            algorithm=axis.algorithm)
            self._next_launch += 1

    def _finish_backward(self) -> None:
        """The end of backward: zeros for what did not arrive, launch the rest in order,
        wait, reduce over the remaining axes, add into ``.grad``."""
        try:
            with torch.no_grad():
                for bucket in self.buckets:
                    for slot, arrived in enumerate(bucket.arrived):
                        if not arrived:
                            bucket.views[slot].zero_()
                    bucket.pending = 0
                self._launch_ready()
                errors = []
                for bucket in self.buckets:  # every one, so no job still writes a bucket after we return
                    try:
                        bucket.handle.wait()
                    except BaseException as error:  # noqa: BLE001 - the first is raised below
                        errors.append(error)
                if errors:
                    raise errors[0]
                for bucket in self.buckets:
                    for axis_index in bucket.axes[1:]:
                        axis = self._axes[axis_index]
                        comm.all_reduce(bucket.buffer, comm.ReduceOp.SUM, group=axis.group, algorithm=axis.algorithm)
                    for param, view, arrived in zip(bucket.params, bucket.views, bucket.arrived):
                        if param.grad is not None:
                            param.grad.add_(view)
                        elif arrived or bool(view.any()):
                            param.grad = view.clone()
        finally:
            self._in_backward = False
