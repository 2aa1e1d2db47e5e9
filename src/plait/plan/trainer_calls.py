"""What plait train does after the pipeline flush besides the data-parallel gradient
sync, priced call by call; and the optimizer step's kernel launches.

Closing calls (``plait.parallel.hybrid.train_step`` and the pipeline engine's end of step,
in that order; every one an all-reduce on a group of size > 1, a group of one makes no
call):

1. the engine's loss sum: one float64 (8 bytes) over the pipeline group (pp > 1);
   posted asynchronously, waited for after the shared-parameter sums;
2. the shared parameters' gradient sums (a tied embedding with pp > 1): its
   gradient over the first and the last pipeline rank (2 ranks, ``stride(pp)·(pp-1)``
   apart); plait train's GPT ties only at pp = 1, so it has none;
3. [the dp gradient sync: ``plait.plan.overlap.data_parallel_s``];
4. fp16 (``--precision fp16-mixed``): the loss scaler's overflow flag, one float32 (4
   bytes, a MAX all-reduce) over the world (``LossScaler.found_overflow``);
5. the gradient norm (``clip_grad_norm`` / ``clip_sharded_grad_norm``, computed even
   with ``grad_clip = 0``): Σ g² of this rank's gradients, one float64 (8 bytes)
   all-reduced over tp, then pp (ZeRO >= 1: over dp, tp, pp: each dp rank holds 1/dp
   of the gradient);
6. ZeRO >= 1, in the optimizer step (``plait.parallel.zero.engine.snapshot_unused``): one
   int32 flag per parameter tensor all-reduced over dp (which parameters no rank gave a
   gradient), 4 bytes per tensor;
7. (``train_step(reduce_loss=True)`` only, not plait train: the loss mean over dp.)

Each call is priced T = (its link price with the per-call cost,
``Cluster.collective_time_s``) + ``Cluster.sync_wait_s(group size, compute since that
group last synchronised)``: the loss sum after one micro-batch's backward (the
pipeline's last message precedes it), a tied sum and the overflow flag after the
step's compute (their groups synchronise once a step), a norm sum after the norm's own
compute (its group's previous call came just before it). The norm's local compute is
priced too: one kernel per gradient tensor (torch's ``_foreach_norm`` on a CPU loops
over the tensors) plus 3 (stack, square, sum), reading every gradient once (on a
GPU, fused and at HBM speed, it is left out). plait
train's timers (``StepTimes.dp_comm_s``: the engine's closing time and the whole dp
sync, norm included) put all of it in dp_comm, so the planner does too.

The optimizer (``optimizer_kernels``): torch's AdamW on a CPU is eager and per tensor
(``foreach`` defaults to off for CPU tensors in torch 2.13: ``_single_tensor_adam``):
each parameter tensor launches step += 1, lerp_ (first moment), mul_ and addcmul_
(second moment), item (the step count), sqrt, div and add_ (the denominator) and
addcdiv_ (the update): 9 kernels, plus a mul_ for the decoupled weight decay of a
matrix (plait train decays tensors of >= 2 dims). A GPU step is fused (Megatron's
Adam: one launch per step), so on a GPU the count stays 1 and the norm one launch.
Under ZeRO >= 1 the optimizer steps flat shards, one per unit and parameter group:
2 per unit (decayed and not), one of them decayed (an approximation: a unit of
matrices only has one).

The tensors' sizes (``optimizer_tensor_groups``, for a device that prices its
optimizer by tensor size, ``plait.plan.optimizer_cost``): the planner knows per
pipeline chunk its parameters, tensors and matrices, not each tensor's size, so a
chunk's parameters are spread evenly over its matrices (a transformer's vectors,
biases and LayerNorm scales, hold < 1% of them: priced at their fixed cost, no
bytes); a chunk without matrices spreads them over its tensors. Under ZeRO >= 1 each
unit's decayed shard holds params/(dp·units), the other shard priced empty.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.names.axes import DP, PP, TP
from plait.names.precision import FP16_MIXED

__all__ = ["ClosingCall", "closing_calls", "closing_time_s", "eager_device", "norm_kernels", "optimizer_kernels",
           "optimizer_tensor_groups",
           "ADAMW_KERNELS_PER_TENSOR", "LOSS_BYTES", "NORM_BYTES", "OVERFLOW_FLAG_BYTES", "UNUSED_FLAG_BYTES"]

LOSS_BYTES = 8  # the engine's loss sum: one float64
NORM_BYTES = 8  # the gradient norm's sum of squares: one float64
OVERFLOW_FLAG_BYTES = 4  # the loss scaler's overflow flag: one float32
UNUSED_FLAG_BYTES = 4  # ZeRO's used-parameter flag: one int32 per parameter tensor
ADAMW_KERNELS_PER_TENSOR = 9  # torch's _single_tensor_adam per tensor (module docstring)
NORM_EXTRA_KERNELS = 3  # stack, pow, sum after the per-tensor norms

# segments: which compute precedes a call since its group last synchronised
AFTER_BACKWARD, AFTER_STEP, AFTER_NORM = "one micro-batch's backward", "the step", "the norm"


@dataclass(frozen=True)
class ClosingCall:
    """One synchronising collective plait train makes once per step after the flush."""

    what: str
    collective: str
    group_size: int
    stride: int  # ranks between neighbours of the group
    nbytes: float
    after: str  # AFTER_BACKWARD | AFTER_STEP | AFTER_NORM


def closing_calls(layout, precision_name: str, *, tied_embedding_bytes: float = 0.0,
                  param_tensors: int = 0) -> list[ClosingCall]:
    """The closing calls of one step of ``layout`` (a ``plait.plan.layout.Layout``), in
    the order plait train makes them (module docstring); groups of one make none.
    ``param_tensors``: the parameter tensors of the rank (ZeRO's flags)."""
    p = layout.pp
    calls = []
    if p > 1:
        calls.append(ClosingCall("loss sum (pp)", "all_reduce", p, layout.stride(PP), LOSS_BYTES, AFTER_BACKWARD))
        if tied_embedding_bytes:
            calls.append(ClosingCall("tied embedding", "all_reduce", 2, layout.stride(PP) * (p - 1),
                                     tied_embedding_bytes, AFTER_STEP))
    if precision_name == FP16_MIXED and layout.devices > 1:
        calls.append(ClosingCall("overflow flag (world)", "all_reduce", layout.devices, 1, OVERFLOW_FLAG_BYTES,
                                 AFTER_STEP))
    sizes = {DP: layout.dp, TP: layout.tp, PP: p}
    for axis in ((DP, TP, PP) if layout.zero_stage >= 1 else (TP, PP)):
        if sizes[axis] > 1:
            calls.append(ClosingCall(f"gradient norm ({axis})", "all_reduce", sizes[axis], layout.stride(axis),
                                     NORM_BYTES, AFTER_NORM))
    if layout.zero_stage >= 1 and layout.dp > 1:
        calls.append(ClosingCall("unused flags (dp)", "all_reduce", layout.dp, layout.stride(DP),
                                 UNUSED_FLAG_BYTES * param_tensors, AFTER_NORM))
    return calls


def eager_device(device) -> bool:
    """Whether ``device`` (a DeviceSpec) runs the optimizer and the norm eagerly, one
    kernel per tensor: ``DeviceSpec.eager``, set on a CPU (``measure_device``, a ``plait
    calibrate --compute`` profile as ``load_compute_profile`` reads it); GPUs run them fused."""
    return device.eager


def optimizer_kernels(device, tensors: int, matrices: int) -> int:
    """Kernels of one AdamW step over ``tensors`` parameter tensors, ``matrices`` of them
    decayed: 9·tensors + matrices on an eager device, else 1 (fused)."""
    if not eager_device(device) or tensors <= 0:
        return 1
    return ADAMW_KERNELS_PER_TENSOR * tensors + matrices


def optimizer_tensor_groups(chunks, *, zero_units: int, sharded_params: float,
                            bytes_per_param: float) -> list[tuple[float, int, int]] | None:
    """(bytes moved per tensor, tensors, decayed) groups of one optimizer step of a rank
    holding ``chunks`` ((params, tensors, matrices) per pipeline chunk), the module
    docstring's approximation; under ZeRO (``zero_units`` > 0) two flat shards a unit
    over ``sharded_params``. None when the tensors are not known (a traced model)."""
    if zero_units > 0:
        return [(sharded_params * bytes_per_param / zero_units, zero_units, zero_units), (0.0, zero_units, 0)]
    groups = []
    for params, tensors, matrices in chunks:
        if tensors <= 0:
            return None
        carriers = matrices if matrices > 0 else tensors
        groups.append((params * bytes_per_param / carriers, carriers, matrices))
        if matrices > 0 and tensors > matrices:
            groups.append((0.0, tensors - matrices, 0))
    return groups or None


def norm_kernels(device, tensors: int) -> int:
    """Kernels of the gradient norm's local Σ g²: tensors + 3 eager, else 1 (fused)."""
    if not eager_device(device) or tensors <= 0:
        return 1
    return tensors + NORM_EXTRA_KERNELS


def closing_time_s(cluster, calls: list[ClosingCall], *, dtype: str, backward_s: float, step_compute_s: float,
                   norm_tensors: int, norm_bytes: float, algorithms: dict | None = None) -> float:
    """Seconds of ``calls`` and of the norm's local compute (always run, on every rank)
    on ``cluster``: norm + Σ_call [collective_time_s + sync_wait_s(size, segment)], the
    segment ``backward_s`` (one micro-batch's backward), ``step_compute_s`` or the norm's
    own time as the call's ``after`` says. ``algorithms`` gets the tied embedding's
    algorithm (the only closing call worth naming: the others move one number)."""
    device = cluster.device
    # eager (a CPU): a kernel per tensor, milliseconds; fused (a GPU): one read of the gradients at
    # HBM speed, under 0.1% of a step, not priced (nor a wait after it: the calls run back to back)
    norm_s = (device.time_s(flops=0.0, nbytes=norm_bytes, kernels=norm_kernels(device, norm_tensors), dtype=dtype)
              if eager_device(device) else 0.0)
    segments = {AFTER_BACKWARD: backward_s, AFTER_STEP: step_compute_s, AFTER_NORM: norm_s}
    seconds = norm_s
    for call in calls:
        spent, algorithm = cluster.collective_time_s(call.collective, call.nbytes, call.group_size, call.stride)
        if algorithms is not None and call.what == "tied embedding":
            algorithms[call.what] = algorithm
        seconds += spent + cluster.sync_wait_s(call.group_size, segments[call.after])
    return seconds
