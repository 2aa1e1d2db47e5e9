"""Persistent pools of gloo workers, one per world size, shared by a whole test session.

`run_distributed(fn, p, ...)` sends `fn` to the cached pool of `p` spawned workers
(started on first use: each imports torch and joins the default gloo group through
a fresh `file://` rendezvous, about 2 s per process on a small machine) and returns
every rank's result. A pool that hangs, crashes or is left with a stuck collective is
killed by pid and dropped from the cache; the next call builds a new one. Pools are
stopped at interpreter exit (atexit) or explicitly with `shutdown_pools()`.

Idle workers cost only memory (about 200-300 MB each with torch), so the cache keeps
at most `PLAIT_TEST_MAX_WORKERS` (default 16) worker processes in total and evicts the
least recently used pools beyond that. 16 holds the pools of world sizes 2, 3, 4 and 5
at once (14 processes, about 4 GB): the suite's files alternate between those sizes,
and with 8 its LRU evicted and restarted a pool about 50 times (about 150 worker
start-ups at ~2 CPU-seconds each, mostly importing torch), against 5 starts with 16
(counted over the suite's harness calls in collection order).
"""

from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401 - its atexit hook must run after ours (LIFO)
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from plait.testing import worker
from plait.testing.world import (
    PROCESS_GROUP_TIMEOUT_S,
    Gathered,
    RankProcesses,
    describe_function,
    encode_task,
    gather_answers,
    raise_for,
    validate_call,
)

# Starting a pool is not part of a call's timeout_s; it has its own limit.
STARTUP_TIMEOUT_S = 180.0
# Seconds a graceful shutdown waits for workers to exit before SIGKILL.
SHUTDOWN_TIMEOUT_S = 2.0
DEFAULT_GRACE_S = 3.0
MAX_CACHED_WORKERS = int(os.environ.get("PLAIT_TEST_MAX_WORKERS", "16"))


class WorkerPool:
    """`world_size` spawned workers sharing one default gloo process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._world: RankProcesses | None = None

    def start(self, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Spawn the workers and wait until every rank has joined the process group."""
        parent_pid = os.getpid()

        def make_args(rank: int, conn: Connection, stack_file: str) -> tuple:
            init_file = os.path.join(os.path.dirname(stack_file), "rendezvous")
            return (rank, self.world_size, init_file, conn, parent_pid, PROCESS_GROUP_TIMEOUT_S, stack_file)

        world = RankProcesses.spawn(self.world_size, worker.pool_worker_main, make_args)
        try:
            # grace_s=0: a rank that cannot join leaves the others stuck in the rendezvous.
            gathered = gather_answers(world, time.monotonic() + startup_timeout_s, grace_s=0.0)
            raise_for(gathered, world, f"starting the world_size {self.world_size} worker pool",
                      startup_timeout_s, 0.0)
        except BaseException:
            world.kill()
            raise
        self._world = world

    @property
    def alive(self) -> bool:
        """True if the pool was started and every worker process is still running."""
        return self._world is not None and all(process.is_alive() for process in self._world.processes)

    @property
    def size_in_processes(self) -> int:
        """Worker processes this pool holds (0 once killed or closed)."""
        return self.world_size if self._world is not None else 0

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout_s: float, grace_s: float) -> list[Any]:
        """Run one task on every rank; see `run_distributed` for the error contract."""
        assert self._world is not None, "WorkerPool.run before start"
        world = self._world
        message = encode_task(fn, args, kwargs, "run_distributed")
        what = f"run_distributed({describe_function(fn)})"
        gathered = self._call(message, time.monotonic() + timeout_s, grace_s)
        if not gathered.clean:
            try:
                # Dumps the stacks of silent ranks, so it runs before the kill.
                raise_for(gathered, world, what, timeout_s, grace_s)
            finally:
                # Stuck, dead or retired workers: this pool cannot serve another call.
                self.kill()
        elif gathered.failures:
            # Every rank answered, but a failed rank may have skipped collectives the
            # others ran; a barrier that does not finish means the group is out of step.
            if not self._barrier_ok(max(grace_s, 1.0)):
                self.kill()
            raise_for(gathered, world, what, timeout_s, grace_s)
        return [gathered.results[rank] for rank in range(self.world_size)]

    def _call(self, message: bytes, deadline_s: float, grace_s: float) -> Gathered:
        """Send `message` to every rank and gather the answers; kills the pool only if
        interrupted (the caller decides what the answers mean)."""
        assert self._world is not None
        try:
            for conn in self._world.conns:
                conn.send_bytes(message)
            return gather_answers(self._world, deadline_s, grace_s)
        except BaseException:
            # A broken pipe, Ctrl-C or a pytest-timeout mid-call: state unknown.
            self.kill()
            raise

    def _barrier_ok(self, timeout_s: float) -> bool:
        message = encode_task(worker.barrier_probe, (), {}, "run_distributed")
        gathered = self._call(message, time.monotonic() + timeout_s, 0.0)
        return gathered.clean and not gathered.failures

    def kill(self) -> None:
        """SIGKILL every worker by pid and reap it; the pool is unusable afterwards."""
        if self._world is not None:
            self._world.kill()
            self._world = None

    def close(self) -> None:
        """Ask the workers to exit, wait `SHUTDOWN_TIMEOUT_S`, then SIGKILL stragglers."""
        if self._world is None:
            return
        for conn in self._world.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        self._world.reap(SHUTDOWN_TIMEOUT_S)
        self._world = None


_POOLS: OrderedDict[int, WorkerPool] = OrderedDict()
# Held for a whole call: calls from several threads must not interleave on one pipe.
_LOCK = threading.RLock()


def _pool_for(world_size: int) -> WorkerPool:
    """The live cached pool for `world_size`, started (and others evicted) if needed."""
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.alive:
        pool.kill()
        del _POOLS[world_size]
        pool = None
    if pool is None:
        cached_processes = sum(other.size_in_processes for other in _POOLS.values())
        while _POOLS and cached_processes + world_size > MAX_CACHED_WORKERS:
            _, evicted = _POOLS.popitem(last=False)
            cached_processes -= evicted.size_in_processes
            evicted.close()
        pool = WorkerPool(world_size)
        pool.start()
        _POOLS[world_size] = pool
    _POOLS.move_to_end(world_size)
    return pool


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    grace_s: float = DEFAULT_GRACE_S,
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(rank, world_size, *args, **kwargs)` on every rank of a pooled world.

    `fn` must be a picklable top-level function; the default gloo process group is
    already initialised in each worker, so `fn` uses `torch.distributed` directly
    (and must leave it usable: tests that destroy or break it belong in
    `run_fresh_world`). Returns the results in rank order; results and arguments
    travel by pickle. `timeout_s` bounds the call (not the first pool start-up).

    Raises:
        RankError: some rank raised; the message names the rank(s) and quotes the
            remote tracebacks. Other ranks get `grace_s` to finish; if they do not
            (typically blocked in a collective with the failed rank) the pool is
            killed and rebuilt on the next call.
        DistributedTimeout: `timeout_s` passed; the message names the world size,
            `fn`, the silent ranks and their stacks. The pool is killed.
        WorkerCrashed: a worker died (exit code in the message). The pool is killed.
    """
    validate_call(world_size, timeout_s, grace_s)
    with _LOCK:
        pool = _pool_for(world_size)
        try:
            return pool.run(fn, args, kwargs, timeout_s, grace_s)
        finally:
            if not pool.alive and _POOLS.get(world_size) is pool:
                del _POOLS[world_size]


def shutdown_pools() -> None:
    """Stop every cached pool (graceful, then SIGKILL); later calls start new ones."""
    with _LOCK:
        while _POOLS:
            _, pool = _POOLS.popitem()
            pool.close()


def cached_pool_pids() -> dict[int, list[int]]:
    """World size -> worker pids of the cached pools (for tests and leak checks)."""
    with _LOCK:
        return {
            size: [process.pid for process in pool._world.processes]  # noqa: SLF001
            for size, pool in _POOLS.items()
            if pool._world is not None  # noqa: SLF001
        }


# Name for a pytest `pytest_sessionfinish` hook to call.
pool_session_finish = shutdown_pools
atexit.register(shutdown_pools)
