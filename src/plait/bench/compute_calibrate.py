"""Compute calibration: time this CPU's kernels in every rank at once.

`plait calibrate --compute --nprocs N` runs ``run_compute_calibration`` in N spawned
ranks (``plait.bench.launch.spawn_and_run``, as `plait calibrate` does for the link):
each rank sets the intra-op threads plait train gives it (max(1, cores // N)) and all
ranks time the same kernel at the same time, so every time includes the sharing of the
cores that plait train's ranks see (on 2 cores one process alone runs a GEMM about
twice as fast as each of 4 running together). What is timed, in the layout of
``bench/gpu/kernels.py`` (``plait.plan.cpu_profile.fit_cpu_profile`` fits it):

- matmul: ``torch.mm`` of every (m, n, k) in ``gemm_shapes`` (default: the products the
  planner prices for plait train's GPT, ``plait.plan.cpu_profile``'s caller passes them,
  plus a spread of sizes), C[m, n] = A[m, k]·B[k, n];
- attention: ``torch.bmm`` of (count, m, n, k) in ``attention_cases`` (QKᵀ, PV and
  their gradients' shapes);
- memory-bound kernels: copy, add, GELU, LayerNorm forward and backward, softmax and
  dropout, bytes counted by hand as in kernels.py, at each of ``memory_numels`` elements;
- AdamW steps as plait train builds them (``adamw_step``: matrices decayed, the rest
  not, torch's eager per-tensor step), for the size law of ``plait.plan.optimizer_cost``:
  per tensor size n in ``adamw_params`` a step over max(1, ADAMW_SPAN_ELEMENTS // n)
  decayed tensors of n elements (16 MiB of parameters, gradients and moments per rank,
  so the ranks' states together exceed the last-level cache as plait train's do between
  steps: the first touch of each tensor comes from memory), steps over 1 and 64 tiny
  tensors, decayed and not (the per-step, per-tensor and decay costs), and a step over
  each tensor list of ``adamw_lists`` (plait train's GPT: ``gpt_adamw_tensors``), in
  sweeps of their own after the kernels' (every rank stepping at once, as plait train's
  ranks step after their common gradient sync, not beside the other ranks' GEMMs), at
  least ADAMW_MIN_REPS sweeps;
- per-call costs: a tiny in-place add (dispatch), a 1x1x1 mm and bmm (a product's fixed
  cost, the fit's t_mm), a chain of tiny autograd ops forward and backward (eager
  dispatch plus autograd per kernel);
- then the wait for the slowest rank (``plait.bench.sync_drift``: in groups of every
  size that divides the world, at ``sync_segments_s`` CPU-seconds of work between
  calls, ``sync_repeats`` times per size).

Timing: every kernel is built and warmed up (``warmup`` calls), then ``reps`` sweeps
{barrier; per kernel: call it back to back until ``time_budget_s`` has passed, seconds
per call (wall time); then wait for the other ranks while computing}. No rank sleeps
during a sweep (a barrier per kernel would let the ranks take turns on the cores,
each then seeing more than its share), so every window sees every rank running, as
plait train's ranks compute at once; a slow phase of a shared machine lands on
different kernels in different sweeps. A kernel's time is the median over sweeps of
the mean over ranks ("seconds", the average rank's cost) and of the max over ranks
("seconds_max"). The ranks run the same sequence, so at a given moment they run
nearly, not exactly, the same kernel.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn import functional as F

from plait.bench.sync_drift import DEFAULT_SEGMENTS_S, SyncDriftConfig, measure_sync_wait, sync_drift_job
from plait.cost.profile import machine_identity
from plait.plan.host import fit_sync_wait
from plait.plan.layers import backward_matmuls

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SPREAD_GEMMS = ((32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256), (384, 384, 384), (16, 512, 64),
                (512, 16, 64), (64, 512, 16))
LAYERNORM_ROW = 128  # plait train's GPT hidden: the rows LayerNorm and softmax see are this short
# AdamW's size sweep: 4 KB .. 16 MB of parameters per tensor, each step over 2^20 elements of them (16 MiB with
# gradients and moments) per rank; the tiny tensors that pin the fixed costs
ADAMW_NUMELS = tuple(1 << e for e in range(10, 23, 2))
ADAMW_SPAN_ELEMENTS = 1 << 20
ADAMW_TINY_NUMEL, ADAMW_TINY_TENSORS = 64, 64
ADAMW_MIN_REPS = 7  # the steps' sweeps (~0.6 s each on 2 cores): their median rides out a busy machine's bursts
ADAMW_BYTES_PER_PARAM = 28  # float32: param, grad, exp_avg, exp_avg_sq read; param and both moments written


@dataclass(frozen=True, kw_only=True)
class ComputeCalibrateConfig:
    """One `plait calibrate --compute` run (the CLI's flags map to these fields)."""

    gemm_shapes: tuple[tuple[int, int, int], ...]
    attention_cases: tuple[tuple[int, int, int, int], ...] = ()
    memory_numels: tuple[int, ...] = (1 << 13, 1 << 15, 1 << 17)
    adamw_params: tuple[int, ...] = ADAMW_NUMELS
    adamw_lists: tuple[tuple[tuple[int, bool], ...], ...] = ()
    threads_per_rank: int = 1
    dtype: str = "float32"
    reps: int = 3
    warmup: int = 1
    time_budget_s: float = 0.02
    sync_wait: bool = True
    sync_segments_s: tuple[float, ...] = DEFAULT_SEGMENTS_S
    sync_repeats: int = 30
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"dtype={self.dtype!r} must be one of {', '.join(DTYPES)}")
        for key, rows, width in (("gemm_shapes", self.gemm_shapes, 3), ("attention_cases", self.attention_cases, 4)):
            if not isinstance(rows, tuple) or any(
                    not isinstance(row, tuple) or len(row) != width
                    or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in row) for row in rows):
                problems.append(f"{key}={rows!r} must be a tuple of {width}-tuples of whole numbers >= 1")
        if not self.gemm_shapes:
            problems.append("gemm_shapes is empty: need products to fit")
        if not self.memory_numels or any(isinstance(v, bool) or not isinstance(v, int) or v < 1024 or v % 1024
                                         for v in self.memory_numels):
            problems.append(f"memory_numels={self.memory_numels!r} must be multiples of 1024 elements")
        if not self.adamw_params or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                        for v in self.adamw_params):
            problems.append(f"adamw_params={self.adamw_params!r} must be whole numbers >= 1")
        if not isinstance(self.adamw_lists, tuple) or any(
                not isinstance(tensors, tuple) or not tensors
                or any(not isinstance(t, tuple) or len(t) != 2 or isinstance(t[0], bool) or not isinstance(t[0], int)
                       or t[0] < 1 or not isinstance(t[1], bool) for t in tensors) for tensors in self.adamw_lists):
            problems.append(f"adamw_lists={self.adamw_lists!r} must be a tuple of non-empty tuples of "
                            "(elements >= 1, decayed bool)")
        for key in ("threads_per_rank", "reps", "sync_repeats"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{key}={value!r} must be a whole number >= 1")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            problems.append(f"warmup={self.warmup!r} must be a whole number >= 0")
        if not (self.time_budget_s > 0 and self.timeout_s > 0):
            problems.append(f"need time_budget_s({self.time_budget_s}) > 0 and timeout_s({self.timeout_s}) > 0")
        if problems:
            raise ValueError("invalid compute calibration: " + "; ".join(problems))


class _Clock:
    """Times registered calls on every rank at once (module docstring): ``add`` warms a
    call up and registers it; ``run`` sweeps over all of them ``reps`` times (so a slow
    phase of a shared machine lands on different kernels in different sweeps, and the
    median drops it) and gathers every rank's times."""

    def __init__(self, config: ComputeCalibrateConfig, group, filler: Callable[[], object]):
        self.config, self.group, self.filler = config, group, filler
        self.calls: list[Callable[[], object]] = []

    def add(self, call: Callable[[], object]) -> int:
        for _ in range(self.config.warmup):
            call()
        self.calls.append(call)
        return len(self.calls) - 1

    def _window(self, call: Callable[[], object]) -> float:
        """Seconds per call of ``call`` run back to back for ``time_budget_s`` (wall time:
        the time the rank was descheduled for the others is in it)."""
        calls, start_s = 0, time.perf_counter()
        while True:
            call()
            calls += 1
            elapsed_s = time.perf_counter() - start_s
            if elapsed_s >= self.config.time_budget_s:
                return elapsed_s / calls

    def _busy_barrier(self) -> None:
        """Wait for every rank while computing (``filler``): a rank done with its sweep
        early keeps its share of the cores busy, so the others' last windows still see
        every rank running, as they would not if it slept in a barrier."""
        work = dist.barrier(group=self.group, async_op=True)
        deadline_s = time.monotonic() + self.config.timeout_s
        while not work.is_completed():
            self.filler()
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"rank {dist.get_rank()}: compute calibration's barrier after a sweep waited "
                                   f"{self.config.timeout_s} s for the other ranks")
        work.wait()

    def run(self, emit) -> list[tuple[float, float]]:
        """(median over sweeps of the mean over ranks, of the max over ranks) per call."""
        local = torch.zeros(len(self.calls), self.config.reps, dtype=torch.float64)
        for sweep in range(self.config.reps):
            emit("progress", f"sweep {sweep + 1}/{self.config.reps} over {len(self.calls)} kernels")
            dist.barrier(group=self.group)
            for index, call in enumerate(self.calls):
                local[index, sweep] = self._window(call)
            self._busy_barrier()
        world = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(world, local, group=self.group)
        stacked = torch.stack(world)  # (ranks, kernels, sweeps)
        mean = stacked.mean(dim=0).median(dim=1).values
        worst = stacked.max(dim=0).values.median(dim=1).values
        return list(zip(mean.tolist(), worst.tolist()))


def _matmul_rows(clock, shapes, dtype) -> list[tuple[dict, int]]:
    rows = []
    for m, n, k in shapes:
        a, b, c = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype), torch.empty(m, n, dtype=dtype)
        rows.append(({"op": "mm", "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k},
                     clock.add(partial(torch.mm, a, b, out=c))))
    return rows


def _attention_rows(clock, cases, dtype) -> list[tuple[dict, int]]:
    rows = []
    for count, m, n, k in cases:
        a = torch.randn(count, m, k, dtype=dtype)
        b, c = torch.randn(count, k, n, dtype=dtype), torch.empty(count, m, n, dtype=dtype)
        rows.append(({"op": "bmm", "batch": count, "m": m, "n": n, "k": k, "flops": 2.0 * count * m * n * k},
                     clock.add(partial(torch.bmm, a, b, out=c))))
    return rows


def memory_ops(dtype, numel: int, row: int = LAYERNORM_ROW):
    """(name, bytes moved, call) of each memory-bound kernel at ``numel`` elements
    (inputs read once, outputs written once; bench/gpu/kernels.py's counts)."""
    e = torch.tensor([], dtype=dtype).element_size()
    x, y = torch.randn(numel, dtype=dtype), torch.randn(numel, dtype=dtype)
    out = torch.empty_like(x)
    rows2d = x.view(-1, row)
    weight, bias = torch.ones(row, dtype=dtype), torch.zeros(row, dtype=dtype)
    ln_in = rows2d.clone().requires_grad_(True)
    ln_out = F.layer_norm(ln_in, (row,), weight, bias)
    grad = torch.randn_like(ln_out)
    return [
        ("copy", 2 * e * numel, lambda: out.copy_(x)),
        ("add", 3 * e * numel, lambda: torch.add(x, y, out=out)),
        ("gelu", 2 * e * numel, lambda: F.gelu(x)),
        ("layernorm", 2 * e * numel, lambda: F.layer_norm(rows2d, (row,), weight, bias)),
        ("layernorm.backward", 3 * e * numel, lambda: torch.autograd.grad(ln_out, ln_in, grad, retain_graph=True)),
        ("softmax", 2 * e * numel, lambda: torch.softmax(rows2d, dim=-1)),
        ("dropout", (2 * e + 1) * numel, lambda: F.dropout(x, 0.1, training=True)),
    ]


def adamw_step(tensors):
    """(row, call) of one step of torch's AdamW over float32 ``tensors`` ((elements,
    decayed) pairs) built as plait train's ``make_optimizer`` builds it: decayed tensors
    in a group with weight decay, the rest in one without, eager per-tensor steps on a
    CPU. The row's "groups" are (bytes moved per tensor, tensors, decayed) triples for
    ``plait.plan.optimizer_cost`` (ADAMW_BYTES_PER_PARAM bytes per element)."""
    params = [torch.randn(numel, dtype=torch.float32, requires_grad=True) for numel, _ in tensors]
    for param in params:
        param.grad = torch.randn_like(param)
    decay = [param for param, (_, decayed) in zip(params, tensors) if decayed]
    rest = [param for param, (_, decayed) in zip(params, tensors) if not decayed]
    groups = [group for group in ({"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0})
              if group["params"]]
    adamw = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95))
    adamw.step()  # creates the state
    counts: dict[int, list[int]] = {}
    for numel, decayed in tensors:
        entry = counts.setdefault(numel, [0, 0])
        entry[0] += 1
        entry[1] += int(decayed)
    total = sum(numel for numel, _ in tensors)
    row = {"op": "adamw", "numel": total // len(tensors), "tensors": len(tensors),
           "decayed": sum(int(decayed) for _, decayed in tensors), "bytes": ADAMW_BYTES_PER_PARAM * total,
           "groups": [[ADAMW_BYTES_PER_PARAM * numel, count, decayed]
                      for numel, (count, decayed) in sorted(counts.items())]}
    return row, adamw.step


def adamw_cases(config: ComputeCalibrateConfig) -> list[tuple[tuple[int, bool], ...]]:
    """The tensor lists timed (module docstring): the size sweep, the tiny steps, the
    configured lists."""
    sweep = [((numel, True),) * max(1, ADAMW_SPAN_ELEMENTS // numel) for numel in config.adamw_params]
    tiny = [((ADAMW_TINY_NUMEL, True),), ((ADAMW_TINY_NUMEL, True),) * ADAMW_TINY_TENSORS,
            ((ADAMW_TINY_NUMEL, False),) * ADAMW_TINY_TENSORS]
    return sweep + tiny + list(config.adamw_lists)


def gpt_adamw_tensors(*, layers: int, hidden: int, ffn_hidden: int, vocab: int, seq_len: int,
                      tied_head: bool = False) -> tuple[tuple[int, bool], ...]:
    """(elements, decayed) of every parameter tensor of plait's GPT (plait.models.gpt, one
    process): position and token tables, an untied head; per block LayerNorm (2),
    qkv (3h·h, 3h), proj (h·h, h), LayerNorm (2), fc1 (f·h, f), fc2 (h·f, h); the final
    LayerNorm. Matrices (>= 2 dims) decayed, as plait train's make_optimizer does."""
    h, f = hidden, ffn_hidden or 4 * hidden
    tensors = [(seq_len * h, True)] + ([] if tied_head else [(vocab * h, True)]) + [(vocab * h, True)]
    block = [(h, False), (h, False), (3 * h * h, True), (3 * h, False), (h * h, True), (h, False),
             (h, False), (h, False), (f * h, True), (f, False), (h * f, True), (h, False)]
    return tuple(tensors + block * layers + [(h, False), (h, False)])


def _launch_calls(dtype) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (call, kernels per call) of the per-call costs."""
    tiny, tiny_out = torch.ones(1, dtype=dtype), torch.empty(1, dtype=dtype)
    one = torch.ones(1, 1, dtype=dtype)
    one_out = torch.empty(1, 1, dtype=dtype)
    batched, batched_out = torch.ones(1, 1, 1, dtype=dtype), torch.empty(1, 1, 1, dtype=dtype)
    leaf = torch.ones(8, dtype=dtype, requires_grad=True)
    chain = 64

    def launches():
        for _ in range(chain):
            torch.add(tiny, tiny, out=tiny_out)  # as the memory-bound kernels are called: tensors in, out= given

    def autograd_chain():
        z = leaf
        for _ in range(chain):
            z = z * 1.0001
        z.sum().backward()

    return {"dispatch_s": (launches, chain),
            "matmul_s": (lambda: torch.mm(one, one, out=one_out), 1),
            "bmm_s": (lambda: torch.bmm(batched, batched, out=batched_out), 1),
            # a multiply forward; its backward a multiply and an add
            "eager_autograd_kernel_s": (autograd_chain, 3 * chain)}


def run_compute_calibration(config: ComputeCalibrateConfig, *, group=None, device: torch.device | None = None,
                            emit: Callable[[str, object], None] | None = None) -> list[dict]:
    """Time every kernel of ``config`` on all ranks of ``group`` at once (module
    docstring); returns [kernels JSON] (identical on every rank) and emits it as a row."""
    if device is not None and device.type != "cpu":
        raise ValueError(f"plait calibrate --compute measures this CPU; device {device} is not one")
    torch_group = group if group is not None else dist.group.WORLD
    emit = emit or (lambda kind, payload: None)
    torch.set_num_threads(config.threads_per_rank)
    dtype = DTYPES[config.dtype]
    filler = (torch.randn(128, 128, dtype=dtype), torch.randn(128, 128, dtype=dtype), torch.empty(128, 128, dtype=dtype))
    clock = _Clock(config, torch_group, partial(torch.mm, filler[0], filler[1], out=filler[2]))
    started_s = time.perf_counter()
    launch = {name: (clock.add(call), per_call) for name, (call, per_call) in _launch_calls(dtype).items()}
    matmul = _matmul_rows(clock, config.gemm_shapes, dtype)
    attention = _attention_rows(clock, config.attention_cases, dtype)
    memory = []
    for numel in config.memory_numels:  # inputs that need no gradient: no autograd graph but LayerNorm's own
        for name, nbytes, call in memory_ops(dtype, numel):
            memory.append(({"op": name, "numel": numel, "bytes": nbytes}, clock.add(call)))
    times = clock.run(emit)
    # AdamW in sweeps of its own: every rank steps at once, as plait train's ranks do after their common
    # gradient sync (module docstring)
    optimizer_clock = _Clock(replace(config, reps=max(config.reps, ADAMW_MIN_REPS)), torch_group, clock.filler)
    steps = [(row, optimizer_clock.add(call)) for row, call in map(adamw_step, adamw_cases(config))]
    optimizer_times = optimizer_clock.run(emit)
    kernels_s = time.perf_counter() - started_s

    def timed(row: dict, index: int, times=times) -> dict:
        seconds, worst = times[index]
        extra = {"gbps": row["bytes"] / seconds / 1e9} if "bytes" in row else {"gflops": row["flops"] / seconds / 1e9}
        return {**row, "seconds": seconds, "seconds_max": worst, **extra}

    world_size = dist.get_world_size(torch_group)
    cores = os.cpu_count() or 1
    result = {
        "facts": {"device": "cpu", "torch": torch.__version__, "nprocs": world_size, "cores": cores,
                  "threads_per_rank": config.threads_per_rank, "machine": asdict(machine_identity()),
                  "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
                  "reps": config.reps, "time_budget_s": config.time_budget_s},
        "dtype": config.dtype,
        "launch": {name: times[index][0] / per_call for name, (index, per_call) in launch.items()},
        "matmul": [timed(row, index) for row, index in matmul],
        "attention": [timed(row, index) for row, index in attention],
        "memory": ([timed(row, index) for row, index in memory]
                   + [timed(row, index, optimizer_times) for row, index in steps]),
        "copies": [],
        "seconds": {"kernels": kernels_s},
    }
    result["launch"]["kernel_s"] = result["launch"]["dispatch_s"]  # no device queue: a launch is its dispatch
    if config.sync_wait and world_size > 1:  # one rank waits for no one
        emit("progress", "the wait for the slowest rank")
        begin_s = time.perf_counter()
        rows = _sync_rows(config, group, world_size)
        host = fit_sync_wait(rows).host(cores, source=f"measured by plait calibrate --compute: {world_size} ranks "
                                                      f"at once on {cores} cores (plait.bench.sync_drift)")
        result["host"] = {**asdict(host), "rows": rows}
        result["seconds"]["sync_wait"] = time.perf_counter() - begin_s
    emit("row", result)
    return [result]


def _sync_rows(config: ComputeCalibrateConfig, group, world_size: int) -> list[dict]:
    """The sync-drift rows: on the world, every group size that divides it (the tp, dp and
    pp groups a layout forms, consecutive ranks), sizes alternated in rounds; on a given
    sub-group, that group alone. Each group on plait's communicator as configured."""
    if group is not None and group != dist.group.WORLD:
        return measure_sync_wait(group, segments_s=config.sync_segments_s, repeats=config.sync_repeats)
    sizes = tuple(size for size in range(2, world_size + 1) if world_size % size == 0)
    drift = SyncDriftConfig(segments_s=config.sync_segments_s, repeats=config.sync_repeats,
                            rounds=min(3, config.sync_repeats), group_sizes=sizes, transport=None,
                            timeout_s=config.timeout_s)
    return sync_drift_job(drift)  # no emit: its rows stay out of this job's


def planner_shapes(spec, *, micro_batches=(1, 4, 16), tps=(1, 2, 4)) -> tuple[tuple, tuple]:
    """(gemm_shapes, attention_cases): every product the planner prices for ``spec`` (a
    plait.plan.TransformerSpec) at these micro-batches and tensor-parallel degrees,
    forward and backward (``LayerCost.forward_matmuls`` and ``backward_matmuls``), with
    SPREAD_GEMMS added so the fit's scales are determined beyond the model's shapes."""
    gemms, cases = set(SPREAD_GEMMS), set()
    for batch in micro_batches:
        for tp in tps:
            if spec.tensor_parallel_problem(tp):
                continue
            for layer in spec.layer_costs(batch, tp=tp):
                forward = layer.forward_matmuls
                for kind, count, m, n, k in forward + backward_matmuls(forward):
                    if kind == "gemm":
                        gemms.add((int(m), int(n), int(k)))
                    else:
                        cases.add((int(count), int(m), int(n), int(k)))
    return tuple(sorted(gemms)), tuple(sorted(cases))


__all__ = ["ComputeCalibrateConfig", "run_compute_calibration", "planner_shapes", "memory_ops", "DTYPES",
           "SPREAD_GEMMS", "adamw_step", "adamw_cases", "gpt_adamw_tensors", "ADAMW_NUMELS"]
