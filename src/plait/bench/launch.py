"""Run a benchmark in the current torchrun world or in N spawned local processes.

What runs is a BenchConfig (``run_benchmark``) or any :class:`Job`: a top-level
function and its config (with ``timeout_s``), e.g. ``plait calibrate``'s
measurements. Rank 0's "row" payloads are what ``spawn_and_run`` returns.

Spawned workers rendezvous through a fresh file:// store in a temporary directory
(never a fixed port), use gloo, OMP_NUM_THREADS=1 and torch.set_num_threads(1).
Rank 0 streams events ("begin"/"row"/"end") to the parent through a queue, so the
parent prints as results arrive. A worker that raises sends its traceback and
exits non-zero; the parent then stops the other workers (by pid) and raises
WorkerError with the traceback. Nothing waits forever: collectives time out after
config.timeout_s, and the parent gives up when rank 0 has reported nothing for
several timeouts.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_module
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import multiprocessing as mp

import torch
import torch.distributed as dist

from plait import comm
from plait.bench.collectives import BenchConfig, run_benchmark

EventHandler = Callable[[str, object], None]


@dataclass(frozen=True)
class Job:
    """What each rank runs: ``function(config, device=..., emit=...)`` (top level, so it
    pickles); rank 0's emit is wired to the parent. ``config.timeout_s`` bounds the
    rendezvous and the parent's patience."""

    function: Callable
    config: object

    @property
    def timeout_s(self) -> float:
        return float(self.config.timeout_s)


def as_job(work: "BenchConfig | Job") -> Job:
    """A BenchConfig runs ``run_benchmark``; a Job runs itself."""
    return work if isinstance(work, Job) else Job(run_benchmark, work)


class WorkerError(RuntimeError):
    """A benchmark worker failed, hung or died; the message holds its traceback."""


def in_torchrun() -> bool:
    """True when RANK and WORLD_SIZE say we are one process of a launched world."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def choose_backend(backend: str, *, spawned: bool) -> str:
    """auto: gloo for spawned local workers; inside torchrun nccl if CUDA is available."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; valid: auto, gloo, nccl")
    if backend != "auto":
        return backend
    return "nccl" if not spawned and torch.cuda.is_available() else "gloo"


def _device_for(backend: str) -> torch.device:
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_in_current_world(config: BenchConfig | Job, backend: str, on_event: EventHandler) -> list:
    """Benchmark (or run a Job) in the world torchrun set up (env:// rendezvous); only
    rank 0 gets events."""
    job = as_job(config)
    backend = choose_backend(backend, spawned=False)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=job.timeout_s))
    try:
        device = _device_for(dist.get_backend())
        emit = on_event if dist.get_rank() == 0 else None
        return job.function(job.config, device=device, emit=emit)
    finally:
        if created:
            comm.destroy_process_group()


def _worker(rank: int, world_size: int, init_method: str, backend: str, config: BenchConfig | Job,
            events) -> None:
    """Spawned entry point (top level so it pickles)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        job = as_job(config)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=job.timeout_s))
        device = torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        emit = (lambda kind, payload: events.put((kind, payload))) if rank == 0 else None
        job.function(job.config, device=device, emit=emit)
        dist.barrier()
        comm.destroy_process_group()
        events.put(("exit", rank))
    except BaseException:  # noqa: BLE001 - everything goes to the parent, then exit 1
        events.put(("failed", (rank, traceback.format_exc())))
        events.close()
        events.join_thread()
        os._exit(1)  # skip destroy/atexit hooks that can block on dead peers


def spawn_and_run(config: BenchConfig | Job, nprocs: int, backend: str, on_event: EventHandler, *,
                  target: Callable = _worker, label: str = "plait bench") -> list:
    """Spawn `nprocs` local workers, run the benchmark (or Job), return rank 0's rows.
    target(rank, world_size, init_method, backend, config, events) is the worker
    entry point (tests swap in failing ones); `label` starts WorkerError messages."""
    if nprocs < 1:
        raise ValueError(f"nprocs({nprocs}) must be >= 1")
    timeout_s = as_job(config).timeout_s
    if isinstance(config, BenchConfig) and config.root >= nprocs:
        raise ValueError(f"root({config.root}) must be < nprocs({nprocs})")
    backend = choose_backend(backend, spawned=True)
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise ValueError(f"nccl needs one GPU per process: nprocs({nprocs}) > "
                         f"{torch.cuda.device_count()} GPUs; use --backend gloo")
    context = mp.get_context("spawn")
    events = context.Queue()
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as rendezvous_dir:
        init_method = f"file://{os.path.join(rendezvous_dir, 'rendezvous')}"
        saved_omp = os.environ.get("OMP_NUM_THREADS")
        # Children read OMP_NUM_THREADS when they import torch, before _worker runs.
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            workers = [context.Process(target=target, name=f"plait-bench-rank{rank}",
                                       args=(rank, nprocs, init_method, backend, config, events),
                                       daemon=True)
                       for rank in range(nprocs)]
            for worker in workers:
                worker.start()
        finally:
            if saved_omp is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved_omp
        finished = False
        try:
            rows = _supervise(workers, events, on_event, silence_limit_s=4 * timeout_s + 60, label=label)
            finished = True
            return rows
        finally:
            # After a failure the survivors are blocked on the failed rank: stop them now.
            _stop(workers, grace_s=5.0 if finished else 0.0)
            events.close()


def run_in_fresh_worlds(function: Callable, config, sizes, on_event: EventHandler, name: str) -> list | None:
    """``function`` (a Job function) in a fresh gloo world of each size in turn;
    rank 0's rows of all of them, or None after printing a worker's failure."""
    rows: list = []
    for size in sizes:
        try:
            rows += spawn_and_run(Job(function, config), size, "gloo", on_event, label=f"{name} ({size} ranks)")
        except WorkerError as error:
            print(str(error), file=sys.stderr)
            return None
    return rows


def _supervise(workers, events, on_event: EventHandler, silence_limit_s: float,
               label: str = "plait bench") -> list:
    rows: list = []
    exited: set[int] = set()
    failures: list[tuple[int, str]] = []
    last_event_s = time.monotonic()
    first_failure_s: float | None = None
    died_s: dict[int, float] = {}
    while len(exited) < len(workers):
        try:
            kind, payload = events.get(timeout=0.2)
        except queue_module.Empty:
            kind, payload = None, None
        now_s = time.monotonic()
        if kind is not None:
            last_event_s = now_s
        if kind == "exit":
            exited.add(payload)
        elif kind == "failed":
            rank, text = payload
            failures.append((rank, text))
            exited.add(rank)
            first_failure_s = first_failure_s or now_s
        elif kind is not None:
            if kind == "row":
                rows.append(payload)
            on_event(kind, payload)
            continue
        for rank, worker in enumerate(workers):
            if rank not in exited and worker.exitcode not in (None, 0):
                # Died without reporting (killed, segfault): give its report 1 s to arrive.
                died_s.setdefault(rank, now_s)
                if now_s - died_s[rank] > 1.0:
                    failures.append((rank, f"rank {rank} died with exit code {worker.exitcode}"))
                    exited.add(rank)
                    first_failure_s = first_failure_s or now_s
        if failures and now_s - first_failure_s > 5.0:
            break  # the others are most likely blocked on the failed rank
        if now_s - last_event_s > silence_limit_s:
            failures.append((-1, f"no progress from the workers for {silence_limit_s:.0f} s"))
            break
    if failures:
        text = "\n".join(f"--- rank {rank} ---\n{message}" if rank >= 0 else message
                         for rank, message in sorted(failures))
        raise WorkerError(f"{label}: {len(failures)} worker(s) failed:\n{text}")
    return rows


def _stop(workers, grace_s: float) -> None:
    """Join workers for up to grace_s; terminate (then kill) the ones still running."""
    deadline_s = time.monotonic() + grace_s
    for worker in workers:
        worker.join(timeout=max(0.0, deadline_s - time.monotonic()))
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(timeout=2.0)
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=2.0)
