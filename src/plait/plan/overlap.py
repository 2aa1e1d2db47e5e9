"""Data-parallel communication that overlaps a rank's compute, as plait's runtime
issues it: closed forms per rank for uniform units, and the same step as a task list
for ``plait.plan.critical_path`` (the tests check the two agree).

What the runtime does (read from the code, not assumed):

- ZeRO 2 (``plait.parallel.zero.engine``, plait train's ``ShardedOptimizer``): a
  bucket (<= 25 MiB) whose gradients are all in is reduce-scattered with
  ``async_op=True`` on the communicator's comm thread, which runs one group's calls in
  the order issued; the next backward's start waits for every one in flight
  (``begin_backward`` -> ``wait_in_flight``), the step waits for the last backward's
  (``reduce_gradients``). The parameters are all-gathered after the optimizer step.
- ZeRO 3 (``plait.parallel.zero.unit_gathering``): a module's units are gathered just
  before its forward (waited for), and the next module's gather is issued then (the
  previous one's in the backward); the backward reduce-scatters each module's units as
  in stage 2, on the same comm thread, so a gather queues behind the reductions issued
  before it. The last module of the forward stays gathered for its backward, which
  comes first: the backward starts without a gather.
- plait's DataParallel (``plait.parallel.data``) and plait train's ZeRO 0
  (``plait.parallel.data.grad_average``; after the flush instead under Chimera and
  zero bubble, or with a compressor): buckets of <= 25 MiB, each all-reduced as its
  gradients are final, waited for at the backward's end; with accumulation only the
  last backward all-reduces.

Uniform units. A rank's micro-batch is forward f and backward b (compute plus its
tensor-parallel collectives), cut into U equal units (b_u = b/U, f_u = f/U); each unit
reduces r (its call, sync wait included) and, at stage 3, gathers g before its
forward and g_b before its backward. Micro-batches run forward, backward, forward, ...
(with pp > 1, 1F1B's steady state alternates the same way; its bubbles only hide
more). Then, with the reductions of a backward finishing

    tail = max(r, U·r - (U-1)·b_u)                     after its last unit (ZeRO 2, DDP)

(the comm thread is busy from the first unit on when r > b_u), the exposed seconds per
step are

    ZeRO 2:  (m - 1)·max(0, tail - f) + tail          (the next forward hides the tail)
    DDP:     tail                                     (the last backward only)
    ZeRO 3:  m·[ g + (U-1)·max(0, g - f_u)                               forward
               + max(0, g_b - b_u) + (U-2)·max(0, r + g_b - b_u)        backward (U >= 2)
               + r + max(0, r - b_u) ]                                  tail

ZeRO 3's tail is always exposed: the next forward's first gather queues behind it (one
comm thread per group) and the step waits for the last one.

Host. On a host with no spare cores (``HostModel.spare_cores == 0``) the comm thread
runs beside compute only while it waits: copying and reducing bytes (the shared-memory
transport's copies into and out of the rings; the transport makes progress on the
waiting thread, with no thread of its own) and the per-call software cost are CPU time
the rank's compute loses. Of a collective priced T = R·alpha + B·beta + G·gamma +
overhead, the CPU share is phi = 1 - R·alpha/T; that share of the hidden time is
exposed after all. Without a host model (GPUs) phi = 0.
"""

from __future__ import annotations

from plait.cost.alpha_beta import level_terms, pipeline_segments
from plait.names.step_parts import COMPUTE, DP_COMM
from plait.plan.cluster import Cluster
from plait.plan.critical_path import Task

__all__ = ["GRADIENT_BUCKET_BYTES", "bucket_count", "reduce_tail_s", "bucketed_exposed_s", "zero3_exposed_s",
           "zero_tasks", "cpu_share", "data_parallel_s"]

# plait's gradient buckets: ShardedOptimizer(bucket_mb=25), DataParallel's and plait train's 25 MiB cap
GRADIENT_BUCKET_BYTES = 25 * (1 << 20)


def bucket_count(nbytes: float, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> int:
    """Buckets of at most ``bucket_bytes`` holding ``nbytes`` (at least 1)."""
    return max(1, -(-int(nbytes) // bucket_bytes))


def reduce_tail_s(units: int, backward_s: float, reduce_s: float) -> float:
    """Seconds the reductions of one backward run past its end: U units of b/U each
    issue a reduction of ``reduce_s`` when done, on one comm thread in order;
    max(r, U·r - (U-1)·b/U)."""
    per_unit = backward_s / units
    return max(reduce_s, units * reduce_s - (units - 1) * per_unit)


def bucketed_exposed_s(microbatches: int, units: int, forward_s: float, backward_s: float,
                       reduce_s: float) -> float:
    """Exposed seconds of ZeRO 2's per-micro-batch reductions (microbatches = m) or of
    DataParallel's last-backward all-reduces (microbatches = 1): (m-1)·max(0, tail - f) + tail."""
    tail = reduce_tail_s(units, backward_s, reduce_s)
    return (microbatches - 1) * max(0.0, tail - forward_s) + tail


def zero3_exposed_s(microbatches: int, units: int, forward_s: float, backward_s: float, gather_s: float,
                    backward_gather_s: float, reduce_s: float) -> float:
    """Exposed seconds of ZeRO 3's prefetched gathers and reductions (module docstring)."""
    f_u, b_u, g, g_b, r = forward_s / units, backward_s / units, gather_s, backward_gather_s, reduce_s
    forward = g + (units - 1) * max(0.0, g - f_u)
    backward = 0.0  # the last unit of the forward is still gathered: its backward starts at once
    if units >= 2:
        backward += max(0.0, g_b - b_u) + (units - 2) * max(0.0, r + g_b - b_u)
        tail = r + max(0.0, r - b_u)
    else:
        tail = r
    return microbatches * (forward + backward + tail)


def zero_tasks(microbatches: int, units: int, forward_s: float, backward_s: float, *, gather_s: float = 0.0,
               backward_gather_s: float = 0.0, reduce_s: float, overlap_next_forward: bool = True) -> list[Task]:
    """The step's data-parallel part as ``plait.plan.critical_path`` tasks, one per
    event plait's runtime has: compute on "compute", collectives on "comm" in the order
    issued. ``gather_s`` > 0: ZeRO 3 (a gather before each unit's forward, the next
    one prefetched when it starts; ``backward_gather_s`` before each unit's backward,
    likewise). Each backward starts by waiting for the previous one's reductions, the
    step ends waiting for all. ``overlap_next_forward`` False: only the last backward
    reduces (DataParallel under accumulation)."""
    tasks: list[Task] = []
    f_u, b_u = forward_s / units, backward_s / units
    reductions: list[int] = []
    last_compute: int | None = None

    def add(resource: str, seconds: float, part: str, after, name: str) -> int:
        tasks.append(Task(resource, seconds, part, tuple(i for i in after if i is not None), name))
        return len(tasks) - 1

    def run_units(kind: str, order: list[int], seconds: float, gather: float, reduce: bool, k: int) -> None:
        nonlocal last_compute
        first_gathered = gather and kind == "F"  # the backward's first unit is the forward's last: still gathered
        pending = add("comm", gather, DP_COMM, [last_compute], f"{kind}{k} gather {order[0]}") if first_gathered else None
        for position, unit in enumerate(order):
            start_after = [last_compute, pending]
            if gather and position + 1 < len(order):  # issued as this unit starts: after what it starts after
                next_gather = add("comm", gather, DP_COMM, start_after, f"{kind}{k} gather {order[position + 1]}")
            else:
                next_gather = None
            last_compute = add(COMPUTE, seconds, COMPUTE, start_after, f"{kind}{k} unit {unit}")
            if reduce:
                reductions.append(add("comm", reduce_s, DP_COMM, [last_compute], f"reduce {k}.{unit}"))
            pending = next_gather

    for k in range(microbatches):
        run_units("F", list(range(units)), f_u, gather_s, False, k)
        reduce = overlap_next_forward or k == microbatches - 1
        # the backward's start waits for the reductions in flight (begin_backward)
        last_compute = add(COMPUTE, 0.0, COMPUTE, [last_compute, *reductions], f"B{k} begin")
        reductions = []
        run_units("B", list(reversed(range(units))), b_u, backward_gather_s if gather_s else 0.0, reduce, k)
    add(COMPUTE, 0.0, COMPUTE, [last_compute, *reductions], "step waits")
    return tasks


def cpu_share(cluster: Cluster, collective: str, nbytes: float, size: int, stride: int) -> float:
    """The fraction of a collective's time that is CPU work on a host with no spare
    cores, 1 - R·alpha/T (copies, reductions, software cost; waiting is not); 0 without
    a host model or with spare cores (background communication is then free)."""
    host = cluster.host
    if host is None or host.spare_cores > 0 or size <= 1 or nbytes <= 0:
        return 0.0
    seconds, algorithm = cluster.collective_time_s(collective, nbytes, size, stride)
    if seconds <= 0:
        return 0.0
    try:
        terms = level_terms(collective, algorithm, nbytes, size, segments=pipeline_segments(int(nbytes)))
    except ValueError:  # an algorithm with no flat closed form: all of it counted as CPU work
        return 1.0
    waiting_s = sum(t.rounds for _, t in terms) * cluster.intra_link.alpha_s
    return min(1.0, max(0.0, 1.0 - waiting_s / seconds))


def data_parallel_s(cluster: Cluster, *, zero_stage: int, dp: int, stride: int, grad_bytes: float,
                    param_bytes: float, microbatches: int, zero_units: int, forward_s: float, backward_s: float,
                    gathers: int, dp_overlap: bool, algorithms: dict) -> tuple[float, float]:
    """(exposed, hidden) seconds of the step's data-parallel collectives on a rank
    whose micro-batch is ``forward_s`` + ``backward_s``, as plait runs them:

    - ZeRO 0: ``dp_overlap`` (plait's DataParallel, and plait train but under Chimera
      and zero bubble): buckets all-reduced during the last backward; else one
      all-reduce after the pipeline flush (``average_after_backward``), not overlapped.
    - ZeRO 1: reduce-scatter after the flush, all-gather after the step: not overlapped.
    - ZeRO 2: per micro-batch, bucket reductions during the backward (module
      docstring); the all-gather after the step.
    - ZeRO 3: per micro-batch and unit, prefetched gathers (``gathers`` per unit: one
      for the forward, one for the backward, one more for a recomputed forward) and
      reductions.

    Each call adds the host's sync wait (``Cluster.sync_wait_s``) after the compute
    since the group's previous call: the step's compute for calls after the flush, a
    unit's for the calls inside a backward. On a host with no spare cores the CPU
    share of the hidden time (``cpu_share`` of each call's priced time; its sync wait
    is waiting, not CPU work) is exposed after all."""
    if dp == 1:
        return 0.0, 0.0
    m, step_compute_s = microbatches, microbatches * (forward_s + backward_s)

    def call(name: str, nbytes: float, segment_s: float) -> float:
        seconds, algorithm = cluster.collective_time_s(name, nbytes, dp, stride)
        algorithms[f"dp {name}"] = algorithm
        return seconds + cluster.sync_wait_s(dp, segment_s)

    def cpu_s(name: str, nbytes: float) -> float:  # a call's CPU work: its share of the priced time, not the wait
        return cpu_share(cluster, name, nbytes, dp, stride) * cluster.collective_time_s(name, nbytes, dp, stride)[0]

    if zero_stage == 0 and not dp_overlap:
        return call("all_reduce", grad_bytes, step_compute_s), 0.0
    if zero_stage == 1:
        return call("reduce_scatter", grad_bytes, step_compute_s) + call("all_gather", param_bytes, 0.0), 0.0
    after_step = 0.0
    if zero_stage == 0:  # DataParallel: the last backward's buckets
        units = bucket_count(grad_bytes)
        reduce_s = call("all_reduce", grad_bytes / units, backward_s / units)
        exposed = bucketed_exposed_s(1, units, forward_s, backward_s, reduce_s)
        total = units * reduce_s
        share = cpu_s("all_reduce", grad_bytes / units) / max(reduce_s, 1e-300)
    elif zero_stage == 2:
        units = bucket_count(grad_bytes)
        reduce_s = call("reduce_scatter", grad_bytes / units, backward_s / units)
        exposed = bucketed_exposed_s(m, units, forward_s, backward_s, reduce_s)
        total = m * units * reduce_s
        share = cpu_s("reduce_scatter", grad_bytes / units) / max(reduce_s, 1e-300)
        after_step = call("all_gather", param_bytes, 0.0)
    else:
        units = max(zero_units, 1)
        unit_s = (forward_s + backward_s) / units
        reduce_s = call("reduce_scatter", grad_bytes / units, unit_s)
        gather_s = call("all_gather", param_bytes / units, unit_s)
        exposed = zero3_exposed_s(m, units, forward_s, backward_s, gather_s, (gathers - 1) * gather_s, reduce_s)
        # the forward's last unit stays gathered for its backward: its backward gathers are not made
        total = m * units * (reduce_s + gathers * gather_s) - m * (gathers - 1) * gather_s
        share = ((cpu_s("reduce_scatter", grad_bytes / units) + gathers * cpu_s("all_gather", param_bytes / units))
                 / max(reduce_s + gathers * gather_s, 1e-300))
    hidden = max(total - exposed, 0.0)
    return exposed + share * hidden + after_step, (1.0 - share) * hidden
