"""Price one parallel layout: step time, its parts, and memory per device.

A layout (``Layout``) is tp x pp x dp devices, the micro-batch size b and the number
of micro-batches m (global batch B = dp·m·b), the pipeline schedule (v model chunks
per pipeline rank when interleaved), full activation recomputation, ZeRO stage and
sequence parallelism. Given the model's per-micro-batch layer costs on one device
(``plait.plan.transformer`` or a traced module) and a ``Cluster``:

Stage split. The layers are cut into pp·v contiguous chunks minimising the slowest
chunk's time (``plait.plan.stages.minmax_partition``); chunk c runs on pipeline rank
c mod pp. A chunk's time per micro-batch is t = forward + backward (+ a recomputed
forward) of its layers plus their tensor-parallel collectives, all on the critical
path; a pipeline rank's t_r adds one receive per chunk and direction (alpha + n·beta on
the link between the neighbours).

Pipeline. pp = 1: m·t. Otherwise priced from the schedule itself
(``plait.plan.pipeline``): plait's builder makes the schedule for (p, m, v), a replay
with the slowest rank's forward / backward (/ weight-gradient, zero_bubble) split gives
its idle time in units of a rank's micro-batch time, and T = m·max_r t_r + idle·
(Σ_r t_r - max_r t_r)/(p-1), the fill and drain passing the other stages. For GPipe
and 1F1B idle = p-1: Alpa's (OSDI'22) T = Σ_r t_r + (m-1)·max_r t_r, (m + p - 1)·t for
equal stages, a bubble of (p-1)/(m+p-1) (DESIGN §6); interleaved (Megatron-LM) gives
idle (p-1)/v. Chimera (two opposite pipelines, rank r holding stages r and p-1-r) runs
each micro-batch on one of its two replicas: t_r is their mean, it keeps both replicas'
parameters, gradients and optimizer states, and all-reduces the replicas' gradients
between ranks r and p-1-r after the data-parallel reduction. zero_bubble splits the
backward: the weight gradient is half the backward's matmul time (on a device
calibrated per shape, its weight-gradient products' time); a recomputed forward goes
with the input gradient.

Overlap (``plait.plan.overlap``, ``plait.plan.critical_path``): the step is a
critical path, not a sum; each part's time is what the rank's compute stream waits
for it (``time_s``, adding up to ``step_time_s``), and what ran under compute is
``hidden_s``. As plait's runtime does: ZeRO 0 all-reduces the gradients in buckets
of <= 25 MiB during the last backward, as each bucket's gradients are final (plait
train's ``plait.parallel.data.grad_average``, as plait's DataParallel), but after the
pipeline flush under Chimera and zero bubble; ZeRO 1 reduce-scatters them after the
flush and all-gathers the updated parameters after the step, not overlapped (plait
train's ``reduce_gradients``); ZeRO 2 reduce-scatters each
micro-batch's buckets on the comm thread as their gradients complete, hidden under the
rest of the backward and the next forward; ZeRO 3 also gathers each unit before its
forward and backward, the next unit's prefetched while one computes. Tensor-parallel
collectives are synchronous in plait (its backward does not overlap them with the
weight-gradient GEMMs), so the model does not overlap them either; pipeline sends are
isend (free here) and each receive is still charged in full, an upper bound: replayed
with a transfer time d per message (``plait.plan.critical_path`` over plait's own
schedules) GPipe exposes only the fill's and drain's 2(p-1)·d and 1F1B 75-90% of what
is charged here. On a host model (``Cluster.host``)
every synchronising call also waits for the slowest rank of its group
(``Cluster.sync_wait_s`` after the compute since that group's previous call: a tp
call's share of its layer, a dp call's step or unit), and with no spare cores the CPU
share of hidden communication is exposed. The trainer's closing calls
(``plait.plan.trainer_calls``: the pipeline's loss sum, a tied head's embedding
gradient between the first and last stage when pp > 1, fp16's overflow flag, the
gradient norm's sums over tp and pp, and dp under ZeRO, with the norm's own compute)
are priced call by call in dp_comm, where plait train's timers put them. The optimizer
step streams its states through memory once, in one fused launch on a GPU and 9
eager kernels per parameter tensor (+1 per decayed matrix) on a CPU.

Memory per device (the worst pipeline rank): parameters, gradients and optimizer
states (ZeRO 1 shards the optimizer states over dp, 2 also the gradients, 3 also the
parameters) plus activations: per micro-batch in flight the chunk's saved tensors
(with recomputation its layers' inputs, plus one layer's full activations while it is
recomputed). In flight: 1 with pp = 1 (micro-batches run one at a time), otherwise the
schedule's own peaks per rank and chunk (m for GPipe, min(m, p - r) on rank r for
1F1B, (p - r - 1)·2 + (v - 1)·p + 1 chunk-micro-batches for interleaved 1F1B, all m·v
when m = p; Chimera's and zero_bubble's from their orders; a split backward frees a
micro-batch at its weight gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from plait.names.schedules import CHIMERA, NO_PIPELINE, ZERO_BUBBLE
from plait.names.axes import DP, PP
from plait.names.step_parts import DP_COMM, PRICED_PARTS
from plait.names.recompute import FULL, SELECTIVE
from plait.plan.cluster import Cluster
from plait.plan.layers import LayerCost
from plait.plan.layout import Layout
from plait.plan.overlap import data_parallel_s
from plait.plan.pipeline import cost_units, price_schedule
from plait.plan.precision import Precision
from plait.plan.stage_split import alpa_split, pipeline_crosses_node, split_groups
from plait.plan.trainer_calls import closing_calls, closing_time_s, optimizer_kernels, optimizer_tensor_groups
from plait.plan.transformer import TensorParallelComm

__all__ = ["Estimate", "estimate", "Unit", "GroupCosts", "summarize", "split_groups", "alpa_split", "combine",
           "in_flight"]

_COST_FIELDS = tuple(f.name for f in fields(LayerCost) if f.name != "name")


# With --offload-activations, the micro-batches whose saved tensors are in memory at once
# at most: the one whose backward runs and the next backward's, prefetched meanwhile
# (plait.memory.offload); every other one is in files, except the activation a chunk
# received from the previous pipeline stage, which the engine holds for the backward.
OFFLOAD_RESIDENT_MICROBATCHES = 2


@dataclass(frozen=True)
class Unit:
    """One layer as the estimate sees it: its costs, its tensor-parallel collectives,
    and whether full recomputation re-runs it (blocks) or keeps its activations."""

    cost: LayerCost
    comm: TensorParallelComm
    recomputable: bool


@dataclass
class Estimate:
    """The predicted step of one layout (seconds, bytes, FLOPs)."""

    layout: Layout
    step_time_s: float
    time_s: dict[str, float]
    memory_per_gpu_bytes: float
    memory_bytes: dict[str, float]
    stage_layers: list[list[int]]
    bottleneck_rank: int
    model_flops: float
    hardware_flops: float
    tflops_per_gpu: float
    model_tflops_per_gpu: float
    percent_of_peak: float
    mfu: float
    samples_per_s: float
    algorithms: dict[str, str] = field(default_factory=dict)
    rank_memory_bytes: tuple[dict[str, float], ...] = ()  # memory_bytes of every pipeline rank, in order
    hidden_s: dict[str, float] = field(default_factory=dict)  # per part, communication run under compute

    def as_dict(self) -> dict:
        out = {**self.layout.as_dict(), "step_time_s": self.step_time_s, "tflops_per_gpu": self.tflops_per_gpu,
               "model_tflops_per_gpu": self.model_tflops_per_gpu, "percent_of_peak": self.percent_of_peak,
               "mfu": self.mfu, "memory_per_gpu_bytes": self.memory_per_gpu_bytes,
               "samples_per_s": self.samples_per_s, "time_breakdown_s": dict(self.time_s),
               "hidden_breakdown_s": dict(self.hidden_s),
               "memory_breakdown_bytes": dict(self.memory_bytes), "stage_layers": self.stage_layers,
               "algorithms": dict(self.algorithms)}
        return out


def _comm_time_s(cluster: Cluster, calls, tp: int, algorithms: dict) -> float:
    """Seconds of ``calls`` on a tp group; ``algorithms`` keeps, per collective, the
    algorithm of its most expensive call (the one that matters)."""
    seconds = 0.0
    for collective, nbytes in calls:
        spent, algorithm = cluster.collective_time_s(collective, nbytes, tp, 1)
        key = f"tp {collective}"
        if spent >= algorithms.get("_cost " + key, -1.0):
            algorithms[key], algorithms["_cost " + key] = algorithm, spent
        seconds += spent
    return seconds


@dataclass(frozen=True)
class GroupCosts:
    """A layer group (or a chunk of groups) per micro-batch: compute and tp
    communication seconds, parameters, activations kept per micro-batch in flight,
    working memory of one recomputed layer, and the bytes its output sends; of the
    time, ``forward_s`` is the forward's (compute and tp communication) and ``weight_s``
    the weight-gradient half of the backward's matmuls (what zero_bubble defers);
    ``param_tensors`` / ``matrix_tensors`` count its parameter tensors.
    ``trailing_bytes``: the activations of the layers after the last recomputed one
    (a head), which the backward frees before it recomputes anything: the working
    memory of a recompute reuses them."""

    compute_s: float
    tp_comm_s: float
    params: int
    activation_bytes: float
    working_bytes: float
    output_bytes: float
    forward_s: float = 0.0
    weight_s: float = 0.0
    trailing_bytes: float = 0.0
    param_tensors: int = 0  # tensors holding ``params`` (an eager optimizer's kernels go per tensor)
    matrix_tensors: int = 0  # of those, the decayed ones (>= 2 dims)
    forward_compute_s: float = 0.0  # the forward's compute alone (forward_s less its tp communication)

    @property
    def time_s(self) -> float:
        return self.compute_s + self.tp_comm_s


def _unit_costs(unit: Unit, tp: int, recompute: str, cluster: Cluster, dtype: str, algorithms: dict) -> GroupCosts:
    device = cluster.device
    forward = device.forward_time_s(unit.cost, dtype)
    compute = forward + device.backward_time_s(unit.cost, dtype)
    forward_comm = _comm_time_s(cluster, unit.comm.forward, tp, algorithms)
    comm = forward_comm + _comm_time_s(cluster, unit.comm.backward, tp, algorithms)
    if cluster.host is not None and tp > 1:  # each synchronous tp call waits for the slowest rank of its group
        calls = len(unit.comm.forward) + len(unit.comm.backward)
        recomputes = recompute == FULL and unit.recomputable
        recomputed = len(unit.comm.recompute) if recomputes else 0
        # the compute between calls: the recomputed forward too, as its calls are counted
        segment_s = (compute + (forward if recomputes else 0.0)) / max(calls + recomputed, 1)
        forward_comm += len(unit.comm.forward) * cluster.sync_wait_s(tp, segment_s)
        comm += calls * cluster.sync_wait_s(tp, segment_s)
    # a linear layer's backward is two GEMMs of equal FLOPs: input gradient and weight gradient
    # (a calibrated device prices the weight-gradient products' own shapes)
    weight = device.weight_gradient_time_s(unit.cost, dtype)
    tensors = {"param_tensors": unit.cost.param_tensors, "matrix_tensors": unit.cost.matrix_tensors,
               "forward_compute_s": forward}
    if recompute == SELECTIVE and unit.cost.core_activation_bytes:
        # the attention core runs again in the backward; its s² tensors live only then, after
        # the block's backward has freed what it kept past the core
        compute += device.core_forward_time_s(unit.cost, dtype)
        return GroupCosts(compute, comm, unit.cost.params,
                          unit.cost.activation_bytes - unit.cost.core_activation_bytes,
                          max(unit.cost.core_activation_bytes - unit.cost.post_core_bytes, 0.0),
                          unit.cost.output_bytes, forward + forward_comm, weight, **tensors)
    if recompute == FULL and unit.recomputable:
        compute += forward
        comm += _comm_time_s(cluster, unit.comm.recompute, tp, algorithms)
        if cluster.host is not None and tp > 1:
            comm += recomputed * cluster.sync_wait_s(tp, segment_s)
        return GroupCosts(compute, comm, unit.cost.params, unit.cost.input_bytes, unit.cost.activation_bytes,
                          unit.cost.output_bytes, forward + forward_comm, weight, **tensors)
    return GroupCosts(compute, comm, unit.cost.params, unit.cost.activation_bytes, 0.0, unit.cost.output_bytes,
                      forward + forward_comm, weight, trailing_bytes=unit.cost.activation_bytes, **tensors)


def combine(parts: list[GroupCosts]) -> GroupCosts:
    """Groups run one after another: times, parameters and activations add, the
    working memory is the largest, the output is the last one's, the trailing bytes
    those after the last part that recomputes."""
    trailing = 0.0
    for part in reversed(parts):
        trailing += part.trailing_bytes
        if part.working_bytes:
            break
    return GroupCosts(sum(p.compute_s for p in parts), sum(p.tp_comm_s for p in parts), sum(p.params for p in parts),
                      sum(p.activation_bytes for p in parts), max(p.working_bytes for p in parts),
                      parts[-1].output_bytes, sum(p.forward_s for p in parts), sum(p.weight_s for p in parts),
                      trailing, sum(p.param_tensors for p in parts), sum(p.matrix_tensors for p in parts),
                      sum(p.forward_compute_s for p in parts))


def summarize(groups: list[list[Unit]], *, tp: int, recompute: str, cluster: Cluster, dtype: str,
              algorithms: dict | None = None) -> list[GroupCosts]:
    """Each group's GroupCosts on ``cluster`` (identical layers priced once)."""
    algorithms = {} if algorithms is None else algorithms
    memo: dict = {}
    out = []
    for group in groups:
        parts = []
        for unit in group:
            key = (tuple(getattr(unit.cost, f) for f in _COST_FIELDS), id(unit.comm), unit.recomputable)
            if key not in memo:
                memo[key] = _unit_costs(unit, tp, recompute, cluster, dtype, algorithms)
            parts.append(memo[key])
        out.append(combine(parts))
    return out


def _activation_peak(mine: list[GroupCosts], layout: Layout, rank: int, price) -> float:
    """The most activation bytes pipeline rank ``rank`` holds at once, from the
    schedule's peaks (``price``, None with pp = 1): the smaller of two bounds, Σ_chunk
    (that chunk's peak count) x (its bytes) and (the rank's peak count) x (its largest
    chunk), both exact for one chunk per rank and the second for equal chunks."""
    activations = [c.activation_bytes for c in mine]
    if price is None:
        return sum(activations)
    bound = price.peak_units[rank] * layout.virtual * max(activations)
    if price.peak_per_chunk is not None:
        bound = min(bound, sum(count * a for count, a in zip(price.peak_per_chunk[rank], activations)))
    return bound


def in_flight(layout: Layout, rank: int) -> float:
    """Micro-batches (in units of the rank's whole share) whose activations rank
    ``rank`` of the pipeline holds at its peak, from the schedule itself."""
    if layout.schedule == NO_PIPELINE:
        return 1.0
    return price_schedule(layout.schedule, layout.pp, layout.num_microbatches, layout.virtual).peak_units[rank]


def _rank_chunks(layout: Layout, rank: int) -> list[int]:
    """The chunks pipeline rank ``rank`` holds: c ≡ rank (mod pp), or Chimera's stage
    ``rank`` (down pipeline) and stage pp-1-rank (up pipeline)."""
    p = layout.pp
    if layout.schedule == CHIMERA:
        return [rank, p - 1 - rank]
    return list(range(rank, p * layout.virtual, p))


def estimate(groups: list[list[Unit]], layout: Layout, cluster: Cluster, precision: Precision, *,
             model_flops: float, hardware_flops: float, tied_embedding_params: int = 0, end_modules: int = 0,
             summaries: list[GroupCosts] | None = None, split: list[list[int]] | None = None,
             chunks: list[GroupCosts] | None = None, algorithms: dict | None = None,
             dp_overlap: bool = False) -> Estimate:
    """Price ``layout`` (see the module docstring). ``groups`` are the model's layers
    for one micro-batch on one tp rank, grouped where no stage boundary may fall;
    ``model_flops`` / ``hardware_flops`` are the global step's FLOPs without / with
    recomputation; ``tied_embedding_params`` (per tp rank) are kept a second time on the
    last stage and all-reduced between the two ends when pp > 1; ``end_modules``: modules
    outside the groups at each end (ZeRO 3's units: one per group, plus these on the
    first and the last stage). ``summaries``,
    ``split``, ``chunks`` (the split's combined groups) and ``algorithms`` let a search
    reuse ``summarize`` and ``split_groups``; ``dp_overlap``: ZeRO 0's gradients
    all-reduced in buckets during the backward, as plait's DataParallel runs them, under
    every schedule (plait train does so too, but after the flush under Chimera and zero
    bubble); ZeRO 0 only (ValueError with ZeRO >= 1, whose own overlap the stage
    already prices)."""
    if dp_overlap and layout.zero_stage >= 1:
        raise ValueError(f"dp_overlap=True with zero_stage={layout.zero_stage}: dp_overlap prices plait's DataParallel "
                         "(ZeRO 0's bucketed all-reduce); ZeRO >= 1 overlaps as its stage does: leave dp_overlap "
                         "False, or use zero_stage=0")
    dtype = precision.dtype
    algorithms = dict(algorithms or {})
    if summaries is None:
        summaries = summarize(groups, tp=layout.tp, recompute=layout.recompute, cluster=cluster, dtype=dtype,
                              algorithms=algorithms)
    split = split or split_groups(summaries, layout.pp * layout.virtual, layout.pp)
    p, v, m = layout.pp, layout.virtual, layout.num_microbatches
    if chunks is None:
        chunks = [combine([summaries[g] for g in indices]) for indices in split]
    crosses_node = pipeline_crosses_node(layout, cluster)
    chimera = layout.schedule == CHIMERA
    ranks = []
    for r in range(p):
        indices = _rank_chunks(layout, r)
        mine = [chunks[c] for c in indices]
        share = 1.0 / len(mine) if chimera else 1.0  # a Chimera micro-batch runs on one of the two replicas
        compute = share * sum(c.compute_s for c in mine)
        tp_comm = share * sum(c.tp_comm_s for c in mine)
        p2p = 0.0
        if p > 1:
            for index in indices:
                if index > 0:
                    p2p += cluster.p2p_time_s(chunks[index - 1].output_bytes, crosses_node)
                if index < p * v - 1:
                    p2p += cluster.p2p_time_s(chunks[index].output_bytes, crosses_node)
        p2p *= share
        holds_head = p > 1 and (r == p - 1 or (chimera and r == 0))
        params = sum(c.params for c in mine) + (tied_embedding_params if holds_head else 0)
        tied_copy = 1 if holds_head and tied_embedding_params else 0  # the head's copy of the embedding table
        tensors = sum(c.param_tensors for c in mine) + tied_copy
        matrices = sum(c.matrix_tensors for c in mine) + tied_copy
        # a received activation (a chunk's input from another chunk) stays in memory under offload
        received = max((chunks[c - 1].output_bytes for c in indices if c > 0), default=0.0)
        zero_units = sum(len(split[c]) for c in indices) + end_modules * ((0 in indices) + (p * v - 1 in indices))
        # (params, tensors, matrices) per chunk (and the head's copy of the tied table): the optimizer's sizes
        chunk_tensors = [(c.params, c.param_tensors, c.matrix_tensors) for c in mine] + (
            [(tied_embedding_params, 1, 1)] if tied_copy else [])
        ranks.append({"compute": compute, "tp_comm": tp_comm, "p2p": p2p, "params": params, "mine": mine,
                      "units": zero_units, "tensors": tensors, "matrices": matrices, "chunk_tensors": chunk_tensors,
                      "received": received,
                      "forward": share * sum(c.forward_s for c in mine) + p2p / 2,
                      "forward_mb": share * sum(c.forward_s for c in mine),
                      "forward_compute": share * sum(c.forward_compute_s for c in mine),
                      "weight": share * sum(c.weight_s for c in mine), "total": compute + tp_comm + p2p})
    slowest = max(range(p), key=lambda r: ranks[r]["total"])
    t_max = ranks[slowest]["total"]
    price = None
    if p == 1:
        pipeline_s = m * t_max
    else:
        heavy_rank = ranks[slowest]
        units = cost_units(heavy_rank["forward"], t_max - heavy_rank["forward"] - heavy_rank["weight"],
                           heavy_rank["weight"], split=layout.schedule == ZERO_BUBBLE)
        price = price_schedule(layout.schedule, p, m, v, units)
        fill_s = (sum(r["total"] for r in ranks) - t_max) / (p - 1)
        pipeline_s = m * t_max + price.idle_units * fill_s
    for r, rank in enumerate(ranks):
        mine = rank.pop("mine")
        # a recompute's working set comes after the chunk's trailing layers have freed theirs
        held = _activation_peak(mine, layout, r, price)
        if layout.offload:
            in_flight_count = 1.0 if price is None else price.peak_units[r] * layout.virtual
            resident = min(in_flight_count, OFFLOAD_RESIDENT_MICROBATCHES)
            held = min(held, resident * max(c.activation_bytes for c in mine)
                       + (in_flight_count - resident) * rank.pop("received"))
        rank.pop("received", None)
        rank["activations"] = held + max(max(c.working_bytes - c.trailing_bytes, 0.0) for c in mine)
    bottleneck = ranks[slowest]
    times = {"compute": m * bottleneck["compute"], "tp_comm": m * bottleneck["tp_comm"],
             "pp_comm": m * bottleneck["p2p"]}
    times["pp_bubble"] = max(0.0, pipeline_s - m * t_max)

    # data parallelism and the optimizer, on the rank with the most parameters
    heavy = max(range(p), key=lambda r: ranks[r]["params"])
    params = ranks[heavy]["params"]
    grad_bytes, param_bytes = params * precision.grad_bytes, params * precision.param_bytes
    dp, stride = layout.dp, layout.stride(DP)

    holder = ranks[heavy]
    forward_mb = holder["forward_mb"]
    # ZeRO 3, per micro-batch and unit: a gather for the forward and one for the backward (and one for a
    # recomputed forward), a reduce-scatter after the backward; all of it overlapped as plait's runtime does
    dp_s, dp_hidden_s = data_parallel_s(
        cluster, zero_stage=layout.zero_stage, dp=dp, stride=stride, grad_bytes=grad_bytes, param_bytes=param_bytes,
        microbatches=m, zero_units=holder["units"], forward_s=forward_mb,
        backward_s=max(holder["compute"] + holder["tp_comm"] - forward_mb, 0.0),
        gathers=3 if layout.recompute == FULL else 2, algorithms=algorithms,
        dp_overlap=dp_overlap or (layout.zero_stage == 0 and layout.schedule not in (CHIMERA, ZERO_BUBBLE)))
    segment_s = m * (holder["compute"] + holder["tp_comm"])
    if chimera:  # the two replicas of each stage (ranks r and p-1-r) sum their gradients
        seconds, algorithms["chimera replicas"] = cluster.collective_time_s(
            "all_reduce", grad_bytes / (dp if layout.zero_stage >= 1 else 1), 2, layout.stride(PP) * (p - 1))
        dp_s += seconds + cluster.sync_wait_s(2, segment_s)
    # the trainer's closing calls (loss sum, tied embedding, overflow flag, gradient norm: plan.trainer_calls)
    zero = layout.zero_stage >= 1  # the optimizer steps flat shards: two per unit (decayed and not)
    tensors = 2 * holder["units"] if zero else holder["tensors"]
    matrices = holder["units"] if zero else holder["matrices"]
    sharded = params / dp if zero else params
    dp_s += closing_time_s(cluster, closing_calls(layout, precision.name,
                                                  tied_embedding_bytes=tied_embedding_params * precision.grad_bytes,
                                                  param_tensors=holder["tensors"]),
                           dtype=dtype, backward_s=bottleneck["compute"] - bottleneck["forward_compute"], step_compute_s=segment_s,
                           norm_tensors=tensors, norm_bytes=sharded * precision.grad_bytes, algorithms=algorithms)
    times["dp_comm"] = dp_s
    device = cluster.device
    times["optimizer"] = device.optimizer_time_s(
        sharded * precision.optimizer_traffic_bytes, dtype, optimizer_kernels(device, tensors, matrices),
        tensors=optimizer_tensor_groups(holder["chunk_tensors"], zero_units=holder["units"] if zero else 0,
                                        sharded_params=sharded, bytes_per_param=precision.optimizer_traffic_bytes))
    step = pipeline_s + dp_s + times["optimizer"]

    # memory: the worst pipeline rank
    def memory_of(r: int) -> dict[str, float]:
        count = ranks[r]["params"]
        z = layout.zero_stage
        optimizer = 0.0 if layout.offload_optimizer else count * precision.optimizer_bytes / (dp if z >= 1 else 1)
        return {"parameters": count * precision.param_bytes / (dp if z >= 3 else 1),
                "gradients": count * precision.grad_bytes / (dp if z >= 2 else 1),
                "optimizer": optimizer,
                "activations": ranks[r]["activations"]}

    memories = [memory_of(r) for r in range(p)]
    worst = max(range(p), key=lambda r: sum(memories[r].values()))
    memory = memories[worst]
    world = layout.devices
    peak = device.peak(dtype)
    hardware_per_gpu = hardware_flops / step / world
    model_per_gpu = model_flops / step / world
    algorithms = {k: v for k, v in algorithms.items() if not k.startswith("_cost ")}
    return Estimate(layout=layout, step_time_s=step, time_s=times, memory_per_gpu_bytes=sum(memory.values()),
                    memory_bytes=memory, stage_layers=split, bottleneck_rank=slowest, model_flops=model_flops,
                    hardware_flops=hardware_flops, tflops_per_gpu=hardware_per_gpu / 1e12,
                    model_tflops_per_gpu=model_per_gpu / 1e12, percent_of_peak=100.0 * hardware_per_gpu / peak,
                    mfu=100.0 * model_per_gpu / peak, samples_per_s=layout.global_batch / step,
                    algorithms=algorithms, rank_memory_bytes=tuple(memories),
                    hidden_s={**{part: 0.0 for part in PRICED_PARTS}, DP_COMM: dp_hidden_s})

