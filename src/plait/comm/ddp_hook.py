"""A communication hook for stock ``torch.nn.parallel.DistributedDataParallel``.

``ddp.register_comm_hook(*plait.comm.ddp_comm_hook(algorithm="ring"))`` makes DDP
average each gradient bucket with plait's all-reduce (any algorithm, or "auto") or
with a plait compressor, instead of its own. Per bucket of n elements the dense hook
costs what the chosen all-reduce costs (ring: 2(p-1) a + 2(p-1)/p · n b) and returns
a Future of the averaged buffer, so DDP overlaps it with the rest of backward as it
does its own.

The compressor is passed as an object (``plait.compress.from_spec("topk:0.01+ef")``,
``TopK(0.01)``, ...): comm sits below compress and never imports it; anything with
``reduce(bucket, group, *, algorithm)`` that averages ``bucket.buffer`` in place works.

The first time a bucket is seen (DDP rebuilds its buckets after the first iteration,
so this happens again then), every rank's (index, numel, dtype) is compared with one
small all-gather; ranks whose models differ get a ValueError naming each rank's
bucket instead of a hang or silently mixed gradients.
"""


from dataclasses import dataclass, field

import torch

from plait.comm.algorithms import DEFAULT_NAMES, TORCH, builder
from plait.comm.collectives import ReduceOp, all_gather_single, all_reduce, enqueue
from plait.comm.communicator import check_group, communicator_for
from plait.names.wire import describe_dtype_code, dtype_code


@dataclass
class CompressedBucket:
    """What a compressor's ``reduce`` reads (the fields of plait.compress.GradBucket):
    ``index`` is a stable key per (DDP bucket index, numel, dtype), so error-feedback
    residuals survive DDP's re-bucketing; ``step`` is the training step."""

    index: int
    buffer: torch.Tensor
    views: list = field(default_factory=list)
    step: int = 0


@dataclass
class DDPHookState:
    """The hook's state (DDP passes it back on every call).

    steps: training steps seen (one per backward: counted at DDP's last bucket).
    buckets: bucket calls seen. checked: (index, numel, dtype) already agreed by all ranks.
    """

    group: object = None
    algorithm: str | None = "auto"
    compressor: object = None
    steps: int = 0
    buckets: int = 0
    checked: set = field(default_factory=set)
    keys: dict = field(default_factory=dict)


def ddp_comm_hook(algorithm="auto", compression=None, group=None):
    """(state, hook) for ``DistributedDataParallel.register_comm_hook(state, hook)``.

    ``algorithm``: plait's all-reduce algorithm for dense buckets (or the algorithm the
    compressor's collectives use). ``compression``: None, or a plait compressor object.
    ``group``: the process group DDP reduces over (None: the world, as DDP's default).
    """
    if compression is not None and not callable(getattr(compression, "reduce", None)):
        raise TypeError(
            f"ddp_comm_hook: compression must be a plait compressor (an object with reduce(bucket, group, "
            f"algorithm=...)), got {compression!r}; build one with plait.compress.from_spec('topk:0.01+ef')"
        )
    if algorithm is not None and not isinstance(algorithm, str):
        raise TypeError(f"ddp_comm_hook: algorithm must be a string such as 'ring' or 'auto', got {algorithm!r}")
    if compression is None and algorithm not in DEFAULT_NAMES and algorithm != TORCH:
        try:
            builder("all_reduce", algorithm)  # refused now, naming the valid ones, not at DDP's first bucket
        except (ValueError, TypeError) as error:
            raise ValueError(f"ddp_comm_hook: algorithm={algorithm!r}: {error}") from None
    try:
        check_group(group)
    except TypeError as error:
        raise TypeError(f"ddp_comm_hook: {error}") from None
    return DDPHookState(group=group, algorithm=algorithm, compressor=compression), plait_hook


def _check_bucket(state: DDPHookState, index: int, buffer: torch.Tensor) -> None:
    """Every rank's bucket ``index`` must have the same numel and dtype."""
    key = (index, buffer.numel(), buffer.dtype)
    if key in state.checked:
        return
    communicator = communicator_for(state.group)
    p = communicator.size
    mine = torch.tensor([index, buffer.numel(), dtype_code(buffer.dtype, "ddp_comm_hook")], dtype=torch.int64)
    table = torch.empty(3 * p, dtype=torch.int64)
    all_gather_single(table, mine, state.group, algorithm="bruck")
    rows = table.view(p, 3).tolist()
    if any(row != rows[0] for row in rows):
        ranks = communicator.ranks
        described = "; ".join(f"rank {ranks[r]}: bucket {row[0]} of {row[1]} elements of {describe_dtype_code(row[2])}"
                              for r, row in enumerate(rows))
        raise ValueError(
            f"plait ddp_comm_hook: the ranks' gradient buckets differ ({described}); every rank must wrap "
            "the same model (same parameters, shapes, dtypes and requires_grad) in DistributedDataParallel "
            "with the same bucket_cap_mb"
        )
    state.checked.add(key)


def plait_hook(state: DDPHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket.buffer()`` across ``state.group``
    with plait; returns a Future of the averaged buffer."""
    buffer = bucket.buffer()
    index = bucket.index()
    _check_bucket(state, index, buffer)
    step = state.steps
    state.buckets += 1
    if bucket.is_last():
        state.steps += 1
    if state.compressor is None:
        handle = all_reduce(buffer, ReduceOp.AVG, state.group, async_op=True, algorithm=state.algorithm)
    else:
        key = state.keys.setdefault((index, buffer.numel(), buffer.dtype), len(state.keys))
        compressed = CompressedBucket(key, buffer, step=step)
        compressor, group, algorithm = state.compressor, state.group, state.algorithm
        handle = enqueue(lambda: compressor.reduce(compressed, group, algorithm=algorithm),
                         f"ddp_comm_hook({compressor!r}, bucket {index})", group=group)
        handle.output = [buffer]
    if handle is None:  # this rank is not in the group: nothing to average
        future = torch.futures.Future()
        future.set_result(buffer)
        return future
    return handle.get_future().then(lambda done: done.value()[0])
