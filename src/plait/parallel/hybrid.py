"""Hybrid (3D) parallelism: one model trained by dp × tp × pp processes.

Every rank builds the model at its tensor-parallel degree (``GPT(config, tp,
seed)`` holds exactly the tp slices of the unsharded model), cuts it into the
pipeline schedule's model chunks (``split_layers``; chunk c on pipeline rank
c mod pp, Chimera's second replica on the mirrored rank) and keeps the chunks its
pipeline rank runs. A training step is then:

1. the pipeline engine runs the schedule over this rank's pp group on its dp
   rank's share of the global batch, split into m micro-batches (tensor-parallel
   collectives run inside each chunk's forward and backward on the tp group);
2. gradients are averaged over the dp group: flat buckets, each bucket's all-reduce
   (the configured algorithm) queued on plait's comm thread as soon as the last
   micro-batch's backward has finished its gradients, while the backward goes on
   (``plait.parallel.data.grad_average``; exactly the sums of one all-reduce after the
   backward); with a plait.compress compressor, or a schedule whose gradients change
   after the backward (Chimera's replica sum, zero bubble's split W), after the flush;
3. the global gradient norm is clipped (sums of squares over tp and pp: sharded
   parameters counted on every tp rank, replicated ones on tp rank 0 only);
4. the optimiser steps.

The gradient is that of the mean loss over the global batch, as one process
computing the whole batch gets (the engine divides each micro-batch's loss by m,
the dp all-reduce divides by dp). Parameters keep their name in the unsharded
model (``names``) wherever they live, which is what checkpoints are keyed by.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from plait import comm
from plait.comm import tags
from plait.memory.loss_scale import LossScaler
from plait.names.schedules import INTERLEAVED_1F1B
from plait.parallel.mesh import DeviceMesh
from plait.memory.offload import ActivationOffloader
from plait.parallel.data.grad_average import average_after_backward, GradAverage
from plait.parallel.pipeline import build as build_schedule, PipelineEngine
from plait.parallel.pipeline.actions import ALL_REDUCE
from plait.parallel.pipeline.partition import build_stage, split_layers
from plait.parallel.step_times import StepTimes, TIMED_PARTS
from plait.memory.precision import AUTOCAST_DTYPE, GRAD_REDUCE_DTYPES, PRECISIONS, autocast
from plait.memory.recompute import set_block_recompute
from plait.comm.ops import dtype_from_code
from plait.names.axes import AXES, DP, PP, TP
from plait.names.wire import dtype_code
from plait.names.precision import FP16_MIXED, FP32
from plait.parallel.tensor.dropout import ConsistentDropout
from plait.parallel.zero.optimizer import ShardedOptimizer

_EVAL_TAG = tags.EVALUATION.start  # evaluation's own tag range (plait.comm.tags)


@dataclass
class HybridModel:
    """This rank's part of the model and what runs it."""

    mesh: DeviceMesh
    engine: PipelineEngine
    chunks: list[list[int]]  # layer indices of every model chunk, in pipeline order
    names: dict[str, nn.Parameter]  # unsharded-model name -> parameter, every one this rank holds
    saved_names: list[str]  # the ones this rank writes to a checkpoint (Chimera's second replica is not)
    tp_rank: int
    tp_size: int
    algorithm: str = "auto"
    compressor: object = None
    dropouts: dict[str, nn.Module] = field(default_factory=dict)  # name -> ConsistentDropout in held chunks
    precision: str = FP32  # fp32 | bf16-mixed | fp16-mixed (plait.names.precision)
    grad_reduce_dtype: str = FP32  # what the dp gradient all-reduce sends
    scaler: LossScaler | None = None  # fp16's dynamic loss scaling, over every rank of the run
    grad_average: GradAverage | None = None  # the overlapped dp average, made by the first step that uses it

    def parameters(self):
        return self.engine.parameters()

    def named_specs(self) -> dict[str, list[int] | None]:
        specs = {}
        for name, param in self.names.items():
            spec = getattr(param, "tp_shard", None)
            specs[name] = None if spec is None else [spec.dim, spec.full_size, *(spec.parts or ())]
        return specs


def build_hybrid(model: nn.Module, layers: list[nn.Module], mesh: DeviceMesh, loss_fn, *, schedule: str,
                 microbatches: int, virtual: int = 1, algorithm: str = "auto", compression=None,
                 timeout_s: float | None = None, tp_rank: int = 0, tp_size: int = 1, recompute: str = "none",
                 recompute_layers: int | None = None, meter=None, precision: str = FP32,
                 grad_reduce_dtype: str = FP32, loss_scaler: LossScaler | None = None,
                 offload_dir=None, layers_are_chunks: bool = False,
                 chunk_layers: list[int] | None = None) -> HybridModel:
    """Cut ``model`` (already built at this rank's tp degree; ``layers`` its
    sequential layers sharing its parameters) into the schedule's chunks and keep
    this pipeline rank's. Parameters of chunks this rank does not run are dropped.
    ``recompute`` (none | selective | full) applies to the first ``recompute_layers``
    transformer blocks of each chunk (None: all). ``meter``: a SavedTensorMeter the
    engine composes with its own saved-tensor hooks (measured activation memory).
    ``layers_are_chunks``: ``layers`` are already the schedule's chunks, one module
    each, in pipeline order (plait.parallel.pipeline.split's stage modules, which take
    and return tuples of boundary tensors); they run as they are. ``chunk_layers``: the
    number of ``layers`` in each chunk, in pipeline order (uneven stages; None: balanced
    by parameters, ``split_layers``)."""
    pp = mesh.size(PP)
    pipeline = build_schedule(schedule, pp, microbatches, virtual if schedule == INTERLEAVED_1F1B else None)
    if layers_are_chunks:
        if len(layers) != pipeline.stages:
            raise ValueError(f"layers_are_chunks: {len(layers)} chunk modules for a schedule of {pipeline.stages} "
                             "chunks: split the model into pp * virtual stages")
        chunks = [[index] for index in range(len(layers))]
    else:
        chunks = split_layers(layers, pp, virtual=virtual if schedule == INTERLEAVED_1F1B else 1,
                              balance="params" if chunk_layers is None else list(chunk_layers))
    pp_rank = mesh.coords[PP]
    held = pipeline.stages_of(pp_rank)
    modules = {stage: layers[stage] if layers_are_chunks else build_stage(layers, chunks[stage]) for _, stage in held}
    for stage, module in modules.items():
        blocks = [layer.block for layer in module if hasattr(getattr(layer, "block", None), "set_recompute")] \
            if isinstance(module, nn.Sequential) else []
        if recompute != "none" and not blocks:
            raise ValueError(f"recompute={recompute!r}: pipeline chunk {stage} has no transformer blocks to recompute "
                             "(recomputation re-runs plait GPT blocks; the MLP and --module models have none): "
                             "use recompute=none")
        set_block_recompute(blocks, recompute, recompute_layers)
    name_of = {id(param): name for name, param in model.named_parameters()}
    names, saved = {}, []
    # in stage order, so both holders of a Chimera stage list its parameters alike
    for replica, stage in sorted(held, key=lambda pair: pair[1]):
        for param in modules[stage].parameters():
            name = name_of[id(param)]
            names[name] = param
            if replica == 0 and name not in saved:
                saved.append(name)

    module_ids = {id(sub) for stage in modules.values() for sub in stage.modules()}
    dropouts = {name: module for name, module in model.named_modules()
                if isinstance(module, ConsistentDropout) and id(module) in module_ids}
    if isinstance(compression, str):
        from plait.compress import from_spec

        compression = None if compression in ("", "none") else from_spec(compression)
    if compression is not None:
        compression.validate([(name, tuple(param.shape)) for name, param in names.items()])
    _drop_unheld(model, module_ids)
    if precision not in PRECISIONS or grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        raise ValueError(f"precision={precision!r}, grad_reduce_dtype={grad_reduce_dtype!r}: valid are "
                         f"{', '.join(PRECISIONS)} and {', '.join(GRAD_REDUCE_DTYPES)}")
    if precision == FP16_MIXED and loss_scaler is None:
        loss_scaler = LossScaler()  # fp16's range needs it; bf16 has fp32's exponent and does not
    offloader = None
    if offload_dir is not None:  # saved activations to files (CPU) or host memory, read back just in time
        offloader = ActivationOffloader(offload_dir, on_loaded=meter.pack if meter is not None else None)
    # model=: the engine finds parameters shared by chunks on different pipeline ranks by
    # their names in the model, and sums their gradients over the ranks holding them
    engine = PipelineEngine(pipeline, modules, loss_fn, group=mesh.group[PP], timeout_s=timeout_s, meter=meter,
                            offloader=offloader, model=model,
                            autocast_dtype=AUTOCAST_DTYPE[precision],
                            loss_scale=loss_scaler.scale_loss if loss_scaler is not None else None)
    return HybridModel(mesh=mesh, engine=engine, chunks=chunks, names=names, saved_names=saved, tp_rank=tp_rank,
                       tp_size=tp_size, algorithm=algorithm, compressor=compression, dropouts=dropouts,
                       precision=precision, grad_reduce_dtype=grad_reduce_dtype, scaler=loss_scaler)


def _drop_unheld(model: nn.Module, held_ids: set[int]) -> None:
    """Free what this pipeline rank does not run: the GPT's blocks of other stages
    (the embedding and head wrappers keep the model object itself alive)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        for index, block in enumerate(blocks):
            if id(block) not in held_ids:
                blocks[index] = nn.Identity()


def _axis_comm_s(hybrid: HybridModel, axis: str) -> float:
    """Seconds plait.comm has recorded in collectives on ``axis``'s group (0 for a group of one)."""
    if hybrid.mesh.size(axis) == 1:
        return 0.0
    return sum(entry["time_s"] for entry in comm.stats(hybrid.mesh.group[axis]).values())


def train_step(hybrid: HybridModel, inputs, targets, optimizer, *, step: int, grad_clip: float = 0.0,
               lr: float | None = None, reduce_loss: bool = True) -> tuple[float, float, StepTimes]:
    """One optimiser step on this dp rank's share of the global batch; returns
    (mean loss over the global batch, gradient norm before clipping, times).
    ``reduce_loss=False``: the loss over this dp rank's share only, and no collective
    for it (the caller averages losses over dp ranks itself, e.g. many steps at once:
    plait.train.metrics)."""
    start_s = time.perf_counter()
    tp_before_s = _axis_comm_s(hybrid, TP)
    sharded = isinstance(optimizer, ShardedOptimizer)  # ZeRO: reduce-scatter instead of all-reduce
    if sharded:  # shard gradients dropped, offloaded state asked for, stage 3's prefetch order
        optimizer.begin_step()
    zero_before_s = optimizer.engine.waited_s if sharded else 0.0
    overlapped = None if sharded else overlapped_average(hybrid)
    if overlapped is not None:
        overlapped.begin_step()
    try:
        loss = hybrid.engine.train_step(inputs, targets, optimizer=None)
    except BaseException:
        if overlapped is not None:
            overlapped.abort()
        raise
    record = hybrid.engine.history[-1]
    tp_s = _axis_comm_s(hybrid, TP) - tp_before_s
    # ZeRO's waits inside the forwards and backwards (stage 3's gathers, stage 2/3's reduce-scatters
    # waited for at the next backward's start): dp communication the engine's busy intervals enclose
    zero_wait_s = optimizer.engine.waited_s - zero_before_s if sharded else 0.0
    sync_start_s = time.perf_counter()
    if sharded:
        optimizer.reduce_gradients()
    elif overlapped is not None:
        overlapped.finish()  # the buckets the backward left, then every one waited for
    else:
        average_gradients(hybrid, step)
    overflow = False
    if hybrid.scaler is not None:  # fp16: gradients back to their true scale; any rank's inf skips the step
        hybrid.scaler.unscale(optimizer.shards if sharded else hybrid.parameters())
        overflow = hybrid.scaler.found_overflow()
    if overflow:
        norm = float("inf")
    else:
        norm = clip_sharded_grad_norm(hybrid, optimizer, grad_clip) if sharded else clip_grad_norm(hybrid, grad_clip)
    if reduce_loss:
        loss = _mean_over(hybrid.mesh, DP, loss)
    sync_s = time.perf_counter() - sync_start_s
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    dp_before_s = _axis_comm_s(hybrid, DP)
    optimizer_start_s = time.perf_counter()
    if hybrid.scaler is not None:
        hybrid.scaler.step(optimizer)
        hybrid.scaler.update()
    else:
        optimizer.step()
    optimizer_s = time.perf_counter() - optimizer_start_s
    optimizer_dp_s = min(_axis_comm_s(hybrid, DP) - dp_before_s, optimizer_s)  # ZeRO's parameter all-gather
    wall_s = time.perf_counter() - start_s
    busy_by_stage = record.stage_busy_s
    busy_s = sum(busy_by_stage.values())
    tp_s = min(tp_s, busy_s)  # tp collectives run inside forward and backward
    zero_wait_s = min(zero_wait_s, busy_s - tp_s)  # so are ZeRO's waits (the engine calls them there)
    compute_s = busy_s - tp_s - zero_wait_s
    stage_compute_s = {stage: compute_s * seconds / busy_s for stage, seconds in sorted(busy_by_stage.items())} \
        if busy_s > 0 else {}
    times = StepTimes(wall_s=wall_s, compute_s=compute_s, tp_comm_s=tp_s, pp_comm_s=record.send_s,
                      receive_s=record.receive_s,
                      dp_comm_s=record.closing_s + zero_wait_s + sync_s + optimizer_dp_s,
                      optimizer_s=optimizer_s - optimizer_dp_s, stage_compute_s=stage_compute_s,
                      closing_s=record.closing_s, zero_wait_s=zero_wait_s)
    times.other_s = remainder_s(times)
    return loss, norm, times


def remainder_s(times: StepTimes) -> float:
    """``other``: wall less every timed part. The timers enclose disjoint calls, so it is
    >= 0 but for float rounding (within 1e-9 of the wall: clamped to 0). A larger negative
    remainder means two timers overlapped (a part counted twice): it is kept as it is, so
    the parts still add up to the wall and the report shows the over-count as a negative
    ``other`` (the run goes on; its other column names the error) rather than hiding it."""
    accounted_s = sum(getattr(times, name) for name in TIMED_PARTS[1:-1])
    other_s = times.wall_s - accounted_s
    return 0.0 if -1e-9 * times.wall_s <= other_s < 0.0 else other_s


def _mean_over(mesh: DeviceMesh, axis: str, value: float) -> float:
    if mesh.size(axis) == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=comm.default_device(mesh.group[axis]))
    comm.all_reduce(total, group=mesh.group[axis])
    return float(total) / mesh.size(axis)


def overlapped_average(hybrid: HybridModel) -> GradAverage | None:
    """The hybrid model's overlapped dp average (made and its hooks registered on first
    use), or None where the average runs after the flush (``average_gradients``): one dp
    rank, a compressor (kept on the path whose exactness it has: its own buckets,
    compressed after the backward), or a schedule that changes gradients after the
    backward (Chimera's replica sum) or accumulates them outside one backward per
    micro-batch (zero bubble's split W). A parameter is final after ``m`` accumulations
    per stage chunk of this rank holding it; one that other pipeline ranks hold too is
    summed over them after the flush, so its bucket waits for ``finish``."""
    if hybrid.grad_average is not None:
        return hybrid.grad_average
    engine, dp = hybrid.engine, hybrid.mesh.size(DP)
    schedule = engine.schedule
    if dp == 1 or hybrid.compressor is not None or schedule.split_backward or \
            any(action.kind == ALL_REDUCE for action in schedule.actions[engine.rank]):
        return None
    holders: dict[int, int] = {}
    for module in engine.stages.values():
        for param in module.parameters():  # once per chunk (a chunk lists a parameter once)
            holders[id(param)] = holders.get(id(param), 0) + 1
    named = [(name, param) for name, param in hybrid.names.items() if param.requires_grad]
    expected = {name: schedule.microbatches * holders[id(param)] for name, param in named
                if name not in engine.shared_parameters and id(param) in holders}
    hybrid.grad_average = GradAverage(named, hybrid.mesh.group[DP], dp, algorithm=hybrid.algorithm,
                                      grad_reduce_dtype=hybrid.grad_reduce_dtype, expected=expected)
    return hybrid.grad_average


def average_gradients(hybrid: HybridModel, step: int) -> None:
    """Average every gradient over the dp group after the backward: flat buckets of
    <= 25 MiB, or through the compressor (``plait.parallel.data.grad_average``)."""
    dp = hybrid.mesh.size(DP)
    if dp > 1:
        params = [(name, param) for name, param in hybrid.names.items() if param.requires_grad]
        average_after_backward(params, hybrid.mesh.group[DP], dp, algorithm=hybrid.algorithm,
                               grad_reduce_dtype=hybrid.grad_reduce_dtype, compressor=hybrid.compressor, step=step)


def clip_grad_norm(hybrid: HybridModel, max_norm: float) -> float:
    """The global L2 norm of the whole model's gradient; scales every gradient by
    max_norm / norm when it is larger (max_norm 0: measure only). Each parameter
    counts once: Chimera's second replica is skipped, tp-replicated parameters
    count on tp rank 0, a parameter several pipeline ranks hold (a tied embedding,
    its gradient summed over them) on the first of them, and the squares are summed
    over the tp and pp groups."""
    counted = []
    for name in hybrid.saved_names:
        param = hybrid.names[name]
        if param.grad is None or not _first_holder(hybrid, name):
            continue
        sharded = getattr(param, "tp_shard", None) is not None and hybrid.tp_size > 1
        if sharded or hybrid.tp_rank == 0:
            counted.append(param.grad.detach())
    total = torch.zeros(1, dtype=torch.float64)
    # one fused kernel per device and dtype: each gradient's norm accumulated in float64
    for grads in _by_device_and_dtype(counted):
        total += torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).pow(2).sum().cpu()
    norm = float(_summed_over(hybrid, total, (TP, PP)).sqrt())
    if max_norm and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grads in _by_device_and_dtype([param.grad for param in hybrid.parameters() if param.grad is not None]):
            torch._foreach_mul_(grads, scale)
    return norm


def _by_device_and_dtype(tensors) -> list[list[torch.Tensor]]:
    """``tensors`` grouped for torch's fused (foreach) kernels, which take one device and dtype."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


def _summed_over(hybrid: HybridModel, total: torch.Tensor, axes) -> torch.Tensor:
    """``total`` all-reduced (summed) over each of the mesh ``axes`` of size > 1, on the CPU."""
    for axis in axes:
        if hybrid.mesh.size(axis) > 1:
            device = comm.default_device(hybrid.mesh.group[axis])
            moved = total.to(device)
            comm.all_reduce(moved, group=hybrid.mesh.group[axis])
            total = moved.cpu()
    return total


def _first_holder(hybrid: HybridModel, name: str) -> bool:
    """Whether this pipeline rank counts parameter ``name`` in the norm: always, unless
    other pipeline ranks hold it too (the engine sums its gradient over them), then only
    on the first."""
    holders = hybrid.engine.shared_parameters.get(name)
    return holders is None or hybrid.mesh.coords[PP] == min(holders)


def _shard_square_sum(hybrid: HybridModel, optimizer: ShardedOptimizer) -> torch.Tensor:
    """Σ g² over this rank's shards (tp-replicated buckets on tp rank 0), a parameter
    several pipeline ranks hold counted on the first of them only, float64."""
    skipped = {id(hybrid.names[name]) for name in hybrid.engine.shared_parameters
               if name in hybrid.names and not _first_holder(hybrid, name)}
    if not skipped:
        return optimizer.grad_square_sum(hybrid.tp_rank)
    total = torch.zeros((), dtype=torch.float64)
    for unit, replicated in zip(optimizer.units, optimizer.unit_replicated):
        if unit.shard.grad is None or (replicated and hybrid.tp_rank != 0):
            continue
        start = unit.rank * unit.shard_numel
        for param, offset in zip(unit.params, unit.offsets):
            low, high = max(offset, start), min(offset + param.numel(), start + unit.shard_numel)
            if id(param) not in skipped and low < high:
                total += unit.shard.grad[low - start:high - start].double().pow(2).sum().cpu()
    return total


def clip_sharded_grad_norm(hybrid: HybridModel, optimizer: ShardedOptimizer, max_norm: float) -> float:
    """``clip_grad_norm`` under ZeRO: each dp rank holds 1/dp of every gradient, so the
    squares are also summed over the dp group (tp-replicated buckets on tp rank 0, a
    parameter several pipeline ranks hold on the first of them)."""
    norm = float(_summed_over(hybrid, _shard_square_sum(hybrid, optimizer), AXES).sqrt())
    if max_norm and norm > max_norm:
        optimizer.scale_gradients(max_norm / (norm + 1e-6))
    return norm


@torch.no_grad()
def evaluate(hybrid: HybridModel, inputs, targets) -> float:
    """Forward only, chunk after chunk along the first pipeline (no schedule, no
    micro-batches): the mean loss over the global batch on every rank."""
    engine, mesh = hybrid.engine, hybrid.mesh
    schedule = engine.schedule
    pipeline = schedule.pipelines[0]
    pp_rank, group = mesh.coords[PP], mesh.group[PP]
    device = engine.device
    x, loss = inputs, torch.zeros(1, dtype=torch.float64, device=device)
    was_training = {stage: module.training for stage, module in engine.stages.items()}
    for module in engine.stages.values():
        module.eval()
    try:
        for stage, holder in enumerate(pipeline):
            if holder != pp_rank:
                continue
            if stage > 0 and pipeline[stage - 1] != pp_rank:
                x = _receive_activation(group, pipeline[stage - 1], stage, device, engine.timeout_s)
            with autocast(device, engine.autocast_dtype):
                x = engine.stages[stage](x)
            if stage == len(pipeline) - 1:
                loss += float(engine.loss_fn(x.float() if engine.autocast_dtype is not None else x, targets))
            elif pipeline[stage + 1] != pp_rank:
                _send_activation(x, group, pipeline[stage + 1], stage + 1, engine.timeout_s)
    finally:
        for stage, module in engine.stages.items():
            module.train(was_training[stage])
    if mesh.size(PP) > 1:
        comm.all_reduce(loss, group=group)
    return _mean_over(mesh, DP, float(loss))



def _send_activation(x, group, peer, stage, timeout_s):
    """A header (dtype code, ndim, dims) then the payload, to the next chunk's rank."""
    x = x.contiguous()
    header = torch.tensor([dtype_code(x.dtype), x.dim(), *x.shape] + [0] * (6 - x.dim()), dtype=torch.int64,
                          device=x.device)
    comm.send(header, group=group, tag=_EVAL_TAG + 2 * stage, group_dst=peer, label="evaluation activation header", timeout_s=timeout_s)
    comm.send(x, group=group, tag=_EVAL_TAG + 2 * stage + 1, group_dst=peer, label="evaluation activation", timeout_s=timeout_s)


def _receive_activation(group, peer, stage, device, timeout_s):
    header = torch.empty(8, dtype=torch.int64, device=device)
    comm.recv(header, group=group, tag=_EVAL_TAG + 2 * stage, group_src=peer, label="evaluation activation header", timeout_s=timeout_s)
    dims = [int(d) for d in header[2:2 + int(header[1])]]
    x = torch.empty(dims, dtype=dtype_from_code(int(header[0])), device=device)
    comm.recv(x, group=group, tag=_EVAL_TAG + 2 * stage + 1, group_src=peer, label="evaluation activation", timeout_s=timeout_s)
    return x
