"""Data parallelism: bucketed all-reduce of gradients, overlapped with backward.

``DataParallel(module)`` keeps one replica per rank. At wrap time the ranks compare
a checksum of every parameter and buffer (names, shapes, dtypes and bits) and rank
0's values are broadcast. Gradients are grouped into buckets in reverse
registration order (``plait.parallel.data.buckets``); a hook on each parameter copies its
gradient into its bucket and, once a bucket is complete (and every bucket before it
has been launched, so all ranks launch in the same order), queues the bucket's
all-reduce on plait's comm thread (``async_op=True``) while backward goes on. At the
end of backward the remaining buckets are launched and waited for, and each
parameter's ``.grad`` is the average over ranks (a view of its bucket).

Cost per step: T_comm = sum over buckets of the all-reduce's alpha-beta cost (ring:
2(p-1)a + 2(p-1)/p n b); what is exposed is what runs after backward has ended,
at least the last bucket's all-reduce. ``stats`` reports both.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.comm.algorithms import algorithms_for, builder
from plait.compress.base import Compressor
from plait.parallel.arguments import check_module, check_wrapper_arguments, wrapper_communicator
from plait.parallel.data.buckets import Bucket, build_buckets, unflatten_into
from plait.parallel.data.ddp_keywords import apply_ddp_keywords
from plait.parallel.data.local_tensors import check_dtensor_groups, grad_like, local_tensor
from plait.parallel.data.model_keys import ModelKeys
from plait.parallel.data.tp_grads import tp_grad, tp_groups_of, unwrap
from plait.parallel.data.weak_hooks import weak_method

_INIT_MODES = ("check", "broadcast")


@dataclass
class StepStats:
    """One synchronised backward on this rank.

    bytes_sent: bytes this rank sent in the step's collectives (measured by the comm
        layer); payload_nbytes: the gradients' bytes as they go on the wire before
        the algorithm's fan-out (compressed size with compression).
    comm_time_s: time the comm thread spent on the step's buckets.
    exposed_comm_s: from the end of backward until the last bucket was done.
    hidden_fraction: 1 - exposed / comm time (the share overlapped with backward).
    bucket_started_s, bucket_finished_s: per bucket, in launch order (bucket 0, the
        last layers, first), when the comm thread began and ended its all-reduce
        (``time.perf_counter()``, from the comm layer's handles).
    backward_end_s: ``time.perf_counter()`` when autograd's backward had ended.
    """

    step: int
    buckets: int
    bytes_sent: int
    payload_nbytes: int
    backward_s: float
    comm_time_s: float
    exposed_comm_s: float
    hidden_fraction: float
    unused_parameters: int
    bucket_started_s: tuple[float, ...] = ()
    bucket_finished_s: tuple[float, ...] = ()
    backward_end_s: float = 0.0


def _checksum(module: nn.Module) -> tuple[int, int, int]:
    """(structure, parameter values, buffer values) CRC32s, in registration order."""
    structure, values = 0, {"param": 0, "buffer": 0}
    for kind, items in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in items:
            structure = zlib.crc32(f"{kind}:{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode(), structure)
            # a DTensor: its local shard; 0-dim tensors too (num_batches_tracked)
            data = local_tensor(tensor.detach()).cpu().contiguous().reshape(-1)
            values[kind] = zlib.crc32(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"",
                                      values[kind])
    return structure, values["param"], values["buffer"]


def _rank_groups(column: list[int]) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(column):
        groups.setdefault(value, []).append(rank)
    return list(groups.values())


def _flat_broadcast(tensors: list[torch.Tensor], src: int, group, algorithm: str) -> None:
    """Broadcast tensors from global rank ``src``, one flat message per dtype."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for tensor in map(local_tensor, tensors):  # a DTensor: its local shard (the same on every dp rank)
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for members in by_kind.values():
        flat = torch.cat([tensor.detach().reshape(-1) for tensor in members])
        comm.broadcast(flat, src=src, group=group, algorithm=algorithm)
        unflatten_into(flat, members)


def verify_replicas(module: nn.Module, group, init: str, who: str) -> None:
    """Every rank of ``group`` must hold the same model: the structure (names, shapes,
    dtypes) always, the values too under init="check" (else rank 0's are broadcast);
    the error names ``who`` and the ranks that differ."""
    communicator = comm.communicator_for(group)  # a wrapper passes its own
    world_size = communicator.size
    if init not in _INIT_MODES:
        raise ValueError(f"{who}: init={init!r} must be one of {_INIT_MODES}")
    if world_size == 1:
        return
    mine = torch.tensor(_checksum(module), dtype=torch.int64)
    table = torch.zeros(3 * world_size, dtype=torch.int64)
    comm.all_gather_into_tensor(table, mine, group=group, algorithm="bruck")
    rows = table.view(world_size, 3).tolist()
    structures = _rank_groups([row[0] for row in rows])
    if len(structures) > 1:
        raise ValueError(
            f"{who}: the model's parameters and buffers (names, shapes, dtypes) differ between ranks "
            f"{structures}; every rank must build the same model")
    for column, what in ((1, "parameter"), (2, "buffer")):
        values = _rank_groups([row[column] for row in rows])
        if len(values) > 1 and init == "check":
            differing = [rank for rank, row in enumerate(rows) if row[column] != rows[0][column]]
            raise ValueError(
                f"{who}: {what} values differ from rank 0's on ranks {differing} (checksum groups "
                f"{values}); seed the model identically on every rank (torch.manual_seed before building "
                "it), or pass init='broadcast' to overwrite them with rank 0's")
    tensors = [param.data for param in module.parameters()] + list(module.buffers())
    if tensors:
        _flat_broadcast(tensors, communicator.ranks[0], group, "torch")


class NoSync:
    """``no_sync()`` for a wrapper whose backward reduces gradients across ranks while
    its ``_require_sync`` is true (DataParallel, ZeRO): gradient accumulation."""

    @contextlib.contextmanager
    def no_sync(self):
        """Inside: backward only accumulates local gradients (gradient accumulation);
        the next backward outside reduces (averages) the accumulated sums."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous


class DataParallel(ModelKeys, NoSync, nn.Module):
    """Wraps ``module`` for data-parallel training over ``group`` (default: world).

    algorithm: the all-reduce algorithm ("auto": the tuner's choice; any name from
        ``plait.comm.ALGORITHMS`` or "torch").
    bucket_mb: bucket cap in MiB (25, as DDP; the first bucket is capped at 1 MiB,
        as in DDP); smaller buckets start earlier.
    ddp_keywords: torch DDP's keywords, in plait's spelling where plait has their
        meaning (``process_group=``, ``bucket_cap_mb=``, ``device_ids=[the parameters'
        device]``), else refused by name (``plait.parallel.data.ddp_keywords``).
    compression: a ``plait.compress.Compressor`` (or a spec like "topk:0.01+ef");
        each bucket is then averaged by ``compressor.reduce`` on the comm thread.
    broadcast_buffers: re-broadcast rank 0's buffers (e.g. BatchNorm statistics)
        before every forward, as DDP does.
    init: "check" (default) refuses parameters that differ across ranks at wrap
        time, naming the ranks; "broadcast" overwrites them with rank 0's. Either
        way the structure (names, shapes, dtypes) must agree.
    find_unused_parameters: parameters without a gradient on a rank always count as
        zeros in the average. With True, one more small all-reduce per step finds
        the parameters no rank used, and their ``.grad`` stays None (as DDP's
        find_unused_parameters), so optimisers skip them; with False they get the
        averaged gradient (zeros if no rank used them).
    """

    def __init__(self, module: nn.Module, group=None, *, algorithm: str = "auto", bucket_mb: float = 25,
                 compression=None, broadcast_buffers: bool = True, init: str = "check",
                 find_unused_parameters: bool = False, **ddp_keywords):
        super().__init__()
        check_module(module, "DataParallel")
        group, bucket_mb = apply_ddp_keywords(module, group, bucket_mb, ddp_keywords)  # DDP's spellings
        check_wrapper_arguments(module, group, "DataParallel", dtensor_parameters=True)
        problems = []
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0 \
                or math.isinf(bucket_mb):
            problems.append(f"bucket_mb={bucket_mb!r} must be a finite number of MiB > 0 (DDP's default is 25)")
        if init not in _INIT_MODES:
            problems.append(f"init={init!r} must be one of {_INIT_MODES}")
        if algorithm not in ("auto", None, "torch"):
            try:
                builder("all_reduce", algorithm)
            except (ValueError, TypeError) as error:
                problems.append(f"algorithm={algorithm!r}: {error}")
        if isinstance(compression, str):
            from plait.compress import from_spec

            compression = from_spec(compression)
        if compression is not None and not isinstance(compression, Compressor):
            problems.append(f"compression={compression!r} must be a plait.compress.Compressor, a spec string "
                            "such as 'topk:0.01+ef', or None")
        if problems:
            raise ValueError("DataParallel: " + "; ".join(problems))
        named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
        if compression is not None:
            compression.validate([(name, tuple(local_tensor(param).shape)) for name, param in named])
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed to be initialised "
                               "(torch.distributed.init_process_group, or run under torchrun)")
        self.module = module
        self.group = group  # as given (None: the world), as before
        self.communicator = group = wrapper_communicator(group, "DataParallel")  # every call goes through it
        self.algorithm = algorithm
        # buffers and compressed payloads use other collectives: the same algorithm where
        # it implements them, else the tuner's choice
        self._broadcast_algorithm = self._also_for(("broadcast",))
        self._compress_algorithm = self._also_for(("all_reduce", "all_gather"))
        # a private copy: error-feedback residuals and PowerSGD factors are this model's
        self.compression = copy.deepcopy(compression)
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.world_size, self.rank, self._src = group.size, group.rank, group.ranks[0]
        check_dtensor_groups(named, group.ranks, "DataParallel")  # DTensor parameters: their local shards
        self._named = named
        self._placement = [(param.dtype, param.device) for _, param in named]  # what the buckets were built for
        self._tp_groups = tp_groups_of(module)  # tp-sharded parameters' groups, for torch's clip (tp_grads)
        self._verify_and_broadcast(init)
        self.buckets: list[Bucket] = build_buckets(self._named, int(bucket_mb * (1 << 20)))
        self._where = {id(param): (bucket, slot) for bucket in self.buckets for slot, param in enumerate(bucket.params)}
        self._require_sync = True
        self._in_backward = False
        self._next_launch = 0
        self._handles: list = []
        self._backward_start_s = 0.0
        self.step_count = 0
        self.history: list[StepStats] = []
        self._hooks = [param.register_post_accumulate_grad_hook(weak_method(self._on_grad_ready)) for _, param in self._named]

    # ----- wrap time -------------------------------------------------------------------
    def _also_for(self, collectives) -> str:
        if self.algorithm in ("auto", None, "torch"):
            return self.algorithm or "auto"
        ok = all(self.algorithm in algorithms_for(collective, with_topology=True) for collective in collectives)
        return self.algorithm if ok else "auto"

    def _verify_and_broadcast(self, init: str) -> None:
        verify_replicas(self.module, self.communicator, init, "DataParallel")

    # ----- forward ---------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._in_backward:
            raise RuntimeError("DataParallel: the previous backward did not finish its gradient all-reduce "
                               "(it raised or was interrupted); rebuild the wrapper to recover")
        self._check_placement()
        if self.broadcast_buffers and self.world_size > 1 and self._require_sync:
            buffers = list(self.module.buffers())
            if buffers:
                _flat_broadcast(buffers, self._src, self.communicator, self._broadcast_algorithm)
        return self.module(*args, **kwargs)

    def _check_placement(self) -> None:
        """The parameters still have the dtype and device the buckets were built for
        (``wrapped.to(torch.float64)`` after wrapping would stop at the first gradient with
        torch's unrelated grad-dtype message)."""
        for (name, param), (dtype, device) in zip(self._named, self._placement):
            if param.dtype != dtype or param.device != device:
                raise RuntimeError(f"DataParallel: parameter '{name}' is {param.dtype} on {param.device}, it was "
                                   f"{dtype} on {device} when wrapped: cast or move the model before wrapping it "
                                   "(or autocast the forward)")

    def register_comm_hook(self, state, hook) -> None:
        """DDP's communication hook has no place here: refused by name, with plait's spelling."""
        raise TypeError("DataParallel: register_comm_hook is DDP's; plait's DataParallel reduces with algorithm= "
                        "(a plait collective algorithm) and compression= (e.g. 'powersgd:2', 'topk:0.01+ef'); to "
                        "keep DDP, register plait.comm.ddp_comm_hook(...) on torch's DistributedDataParallel")

    # ----- backward hooks --------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._require_sync:
            return
        if self.world_size == 1:  # nothing to average; a tp-sharded gradient still needs its tp norms
            group = self._tp_groups.get(id(param))
            if group is not None:
                param.grad = tp_grad(unwrap(param.grad), group)
            return
        if not self._in_backward:
            self._begin_backward()
        bucket, slot = self._where[id(param)]
        if bucket.ready[slot]:
            return  # a second backward through the same graph before the callback ran
        self._take_grad(bucket, slot)
        self._launch_ready()

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._backward_start_s = time.perf_counter()
        self._next_launch = 0
        self._handles = []
        self._unused = 0
        self._unused_slots: set[tuple[int, int]] = set()
        for bucket in self.buckets:
            bucket.reset()
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _take_grad(self, bucket: Bucket, slot: int) -> None:
        view, param = bucket.views[slot], bucket.params[slot]
        if param.grad is None:
            view.zero_()
            self._unused += 1
            self._unused_slots.add((bucket.index, slot))
        elif local_tensor(unwrap(param.grad)).data_ptr() != view.data_ptr():
            view.copy_(local_tensor(unwrap(param.grad)))
        bucket.ready[slot] = True
        bucket.pending -= 1

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._handles.append(self._launch(self.buckets[self._next_launch]))
            self._next_launch += 1

    def _launch(self, bucket: Bucket):
        # the comm layer checks sizes and order in-band, in the call's own messages
        if self.compression is None:
            return comm.all_reduce(bucket.buffer, op=comm.ReduceOp.AVG, group=self.communicator, async_op=True,
                                   algorithm=self.algorithm)
        grad_bucket = bucket.as_grad_bucket(self.step_count)
        compressor, group, algorithm = self.compression, self.communicator, self._compress_algorithm

        communicator = comm.communicator_for(group)

        def job():  # on the group's comm thread, after every collective queued on it before
            before = sum(entry["bytes_sent"] for entry in communicator.stats().values())
            payload = compressor.reduce(grad_bucket, communicator, algorithm=algorithm)
            sent = sum(entry["bytes_sent"] for entry in communicator.stats().values()) - before
            return sent, payload

        return communicator.enqueue(job, f"DataParallel bucket {bucket.index} ({compressor.describe()})")

    def _finish_backward(self) -> None:
        """Runs once at the end of backward: launch what is left, wait, expose .grad."""
        for bucket in self.buckets:  # parameters that got no gradient this backward
            for slot, ready in enumerate(bucket.ready):
                if not ready:
                    self._take_grad(bucket, slot)
        self._launch_ready()
        backward_end_s = time.perf_counter()
        errors = []
        try:
            for handle in self._handles:  # every one, so no job still writes a bucket after we return
                try:
                    handle.wait()
                except BaseException as error:  # noqa: BLE001 - the first is raised below
                    errors.append(error)
        finally:
            self._in_backward = False
        if errors:
            raise errors[0]
        done_s = time.perf_counter()
        unused_everywhere = self._unused_everywhere() if self.find_unused_parameters else set()
        for bucket in self.buckets:
            for slot, (param, view) in enumerate(zip(bucket.params, bucket.views)):
                param.grad = None if (bucket.index, slot) in unused_everywhere else \
                    tp_grad(grad_like(param, view), self._tp_groups.get(id(param)))  # torch's norms: tp_grads
        self._record(backward_end_s, done_s)

    def _unused_everywhere(self) -> set[tuple[int, int]]:
        """(bucket, slot) of the parameters that no rank gave a gradient this step."""
        slots = [(bucket.index, slot) for bucket in self.buckets for slot in range(len(bucket.params))]
        used = torch.tensor([0 if key in self._unused_slots else 1 for key in slots], dtype=torch.int32)
        comm.all_reduce(used, group=self.communicator, algorithm=self._compress_algorithm)
        return {key for key, count in zip(slots, used.tolist()) if count == 0}

    def _record(self, backward_end_s: float, done_s: float) -> None:
        comm_time_s = sum(handle.finished_s - handle.started_s for handle in self._handles)
        bytes_sent = payload = 0
        for handle, bucket in zip(self._handles, self.buckets):
            if self.compression is None:
                bytes_sent += handle.result or 0
                payload += bucket.nbytes
            else:
                bytes_sent += handle.result[0]
                payload += handle.result[1]
        exposed = max(done_s - backward_end_s, 0.0)
        hidden = 1.0 - exposed / comm_time_s if comm_time_s > 0 else 0.0
        self.history.append(StepStats(
            step=self.step_count, buckets=len(self.buckets), bytes_sent=bytes_sent, payload_nbytes=payload,
            backward_s=backward_end_s - self._backward_start_s, comm_time_s=comm_time_s, exposed_comm_s=exposed,
            hidden_fraction=min(max(hidden, 0.0), 1.0), unused_parameters=self._unused,
            bucket_started_s=tuple(handle.started_s for handle in self._handles),
            bucket_finished_s=tuple(handle.finished_s for handle in self._handles), backward_end_s=backward_end_s))
        self.step_count += 1

    @property
    def last_stats(self) -> StepStats | None:
        return self.history[-1] if self.history else None

    def summary(self) -> dict:
        """Totals over the synchronised steps so far (bytes, times, mean hidden fraction)."""
        if not self.history:
            return {"steps": 0}
        comm_s = sum(s.comm_time_s for s in self.history)
        exposed_s = sum(s.exposed_comm_s for s in self.history)
        return {
            "steps": len(self.history),
            "buckets": len(self.buckets),
            "bytes_sent_per_step": sum(s.bytes_sent for s in self.history) / len(self.history),
            "payload_nbytes_per_step": sum(s.payload_nbytes for s in self.history) / len(self.history),
            "comm_time_s": comm_s,
            "exposed_comm_s": exposed_s,
            "hidden_fraction": min(max(1.0 - exposed_s / comm_s, 0.0), 1.0) if comm_s > 0 else 0.0,
        }

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
