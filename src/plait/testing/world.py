"""A world of spawned rank processes: launch, gather answers, kill, and fresh worlds.

The parent side shared by the persistent pools (`pool.py`) and `run_fresh_world`.
`gather_answers` waits on every rank's pipe and process sentinel at once
(`multiprocessing.connection.wait`), so a rank that raises, hangs or dies is noticed
as soon as it happens, and turns the outcome into one of three errors:

- `RankError`: some rank raised; the message holds each failed rank's traceback.
- `DistributedTimeout`: the deadline passed with ranks still silent; the message
  holds those ranks' Python stacks (faulthandler dump taken just before the kill).
- `WorkerCrashed`: a rank process died before answering (segfault, `os._exit`, OOM).

Processes are always killed by pid (SIGKILL) and reaped; nothing waits unbounded.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from plait.testing import worker

SPAWN = get_context("spawn")
# gloo's own timeout for a collective; a call's timeout_s is enforced by the parent.
PROCESS_GROUP_TIMEOUT_S = 60.0
# How long the parent waits for a dumped stack / an exited process before moving on.
STACK_DUMP_WAIT_S = 1.0
REAP_TIMEOUT_S = 5.0
# Longest stack dump quoted per rank in an error message.
MAX_STACK_LINES = 40


class RankError(RuntimeError):
    """One or more ranks raised inside the distributed function.

    `failures` maps rank -> (exception type name, remote traceback text).
    """

    def __init__(self, message: str, failures: dict[int, tuple[str, str]]) -> None:
        super().__init__(message)
        self.failures = failures
        self.ranks = sorted(failures)


class DistributedTimeout(TimeoutError):
    """The call did not finish within `timeout_s`; its processes were killed."""

    def __init__(self, message: str, world_size: int, pending_ranks: list[int]) -> None:
        super().__init__(message)
        self.world_size = world_size
        self.pending_ranks = pending_ranks


class WorkerCrashed(RuntimeError):
    """A rank's process died before answering; `exitcode` is negative for a signal."""

    def __init__(self, message: str, rank: int, exitcode: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


def describe_function(fn: Callable[..., Any]) -> str:
    """`module.qualname` of `fn`, for error messages."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def encode_task(fn: Callable[..., Any], args: tuple, kwargs: dict, caller: str) -> bytes:
    """Pickle a task for the wire; a TypeError names the fix if it cannot be pickled."""
    if not callable(fn):
        raise TypeError(f"{caller} needs a callable, got {type(fn).__name__}")
    try:
        task_bytes = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"{caller} could not pickle {describe_function(fn)} or its arguments ({exc}); "
            "pass a top-level (module-level) function and picklable arguments, "
            "not a lambda or a nested function"
        ) from exc
    return pickle.dumps((list(sys.path), task_bytes))


def validate_call(world_size: int, timeout_s: float, grace_s: float) -> None:
    """Reject a world size or timeouts that cannot work, naming each bad value."""
    problems = []
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        problems.append(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout_s > 0:
        problems.append(f"timeout_s must be > 0, got {timeout_s!r}")
    if not grace_s >= 0:
        problems.append(f"grace_s must be >= 0, got {grace_s!r}")
    if problems:
        raise ValueError("; ".join(problems))


@contextlib.contextmanager
def single_threaded_env() -> Iterator[None]:
    """Set OMP_NUM_THREADS=1 (and MKL's) while spawning, so children inherit it."""
    saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update({name: "1" for name in saved})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass
class RankProcesses:
    """The spawned processes of one world, their pipes and their stack-dump files."""

    world_size: int
    scratch_dir: str
    processes: list[BaseProcess] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)

    @classmethod
    def spawn(cls, world_size: int, target: Callable[..., None], make_args: Callable) -> RankProcesses:
        """Start `target(*make_args(rank, conn, stack_file))` for every rank."""
        world = cls(world_size, tempfile.mkdtemp(prefix=f"plait-world{world_size}-"))
        try:
            with single_threaded_env():
                for rank in range(world_size):
                    parent_conn, child_conn = SPAWN.Pipe(duplex=True)
                    process = SPAWN.Process(
                        target=target,
                        args=make_args(rank, child_conn, world.stack_file(rank)),
                        name=f"plait-rank{rank}-of-{world_size}",
                        # Not daemonic, so fn may start processes (DataLoader workers);
                        # the pool's atexit hook and the workers' watchdog reap them.
                        daemon=False,
                    )
                    process.start()
                    child_conn.close()
                    world.processes.append(process)
                    world.conns.append(parent_conn)
        except BaseException:
            world.kill()
            raise
        return world

    def stack_file(self, rank: int) -> str:
        return os.path.join(self.scratch_dir, f"stack-rank{rank}.txt")

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask live `ranks` for a faulthandler dump of every thread; return the text."""
        offsets = {}
        for rank in ranks:
            process = self.processes[rank]
            if process.is_alive() and process.pid is not None:
                path = self.stack_file(rank)
                offsets[rank] = os.path.getsize(path) if os.path.exists(path) else 0
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, worker.STACK_DUMP_SIGNAL)
        # faulthandler writes the whole dump in microseconds from its signal handler:
        # a file that grew and then stopped growing for one poll holds a full dump.
        stacks: dict[int, str] = {}
        sizes = dict(offsets)
        deadline_s = time.monotonic() + STACK_DUMP_WAIT_S
        while len(stacks) < len(offsets) and time.monotonic() < deadline_s:
            time.sleep(0.05)
            for rank, offset in offsets.items():
                with contextlib.suppress(OSError):
                    size = os.path.getsize(self.stack_file(rank))
                    if rank not in stacks and size > offset and size == sizes[rank]:
                        with open(self.stack_file(rank)) as stream:
                            stream.seek(offset)
                            stacks[rank] = stream.read()
                    sizes[rank] = size
        return stacks

    def kill(self) -> None:
        """SIGKILL every process by pid, reap it, close the pipes, remove scratch files."""
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
        self.reap(REAP_TIMEOUT_S)

    def reap(self, timeout_s: float) -> None:
        """Join processes for up to `timeout_s` in total, SIGKILL stragglers, clean up."""
        deadline_s = time.monotonic() + timeout_s
        for process in self.processes:
            if process.pid is None:
                continue
            process.join(max(0.0, deadline_s - time.monotonic()))
            if process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                process.join()
            process.close()
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []
        shutil.rmtree(self.scratch_dir, ignore_errors=True)


def _exit_description(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {exitcode} (killed by {signal.Signals(-exitcode).name})"
    return f"exit code {exitcode}"


def _quote_stacks(stacks: dict[int, str]) -> str:
    parts = []
    for rank, text in sorted(stacks.items()):
        # Drop the harness's own watchdog thread; keep the threads running user code.
        blocks = [block for block in text.split("\n\n") if "_exit_when_parent_dies" not in block]
        lines = "\n\n".join(blocks).rstrip("\n").splitlines()
        if len(lines) > MAX_STACK_LINES:
            lines = lines[:MAX_STACK_LINES] + [f"  ... ({len(lines) - MAX_STACK_LINES} more lines)"]
        parts.append(f"--- rank {rank} stack when killed ---\n" + "\n".join(lines))
    return "\n" + "\n".join(parts) if parts else ""


@dataclass
class Gathered:
    """What came back from one call: results, failures, and who is still out."""

    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, tuple[str, str]] = field(default_factory=dict)
    retiring: set[int] = field(default_factory=set)
    pending: list[int] = field(default_factory=list)
    crashed: tuple[int, int | None] | None = None

    @property
    def clean(self) -> bool:
        """True if every rank answered and every process can be reused."""
        return not (self.pending or self.crashed or self.retiring)


def gather_answers(world: RankProcesses, deadline_s: float, grace_s: float) -> Gathered:
    """Read one answer per rank until all answered or time is up.

    `deadline_s` is a `time.monotonic()` instant. After the first failure or crash the
    others get `grace_s` more to answer (they may be blocked in a collective that will
    never finish; their errors say what they saw of the crash).
    A process that exits after answering with `retiring` set is not a crash.
    """
    gathered = Gathered(pending=list(range(world.world_size)))
    grace_deadline_s = float("inf")
    while gathered.pending:
        limit_s = min(deadline_s, grace_deadline_s)
        remaining_s = limit_s - time.monotonic()
        if remaining_s <= 0:
            break
        waitables = {world.conns[rank]: rank for rank in gathered.pending}
        sentinels = {world.processes[rank].sentinel: rank for rank in gathered.pending}
        ready = wait(list(waitables) + list(sentinels), timeout=remaining_s)
        # Read pipes first: a rank that answered and then exited is not a crash.
        for rank in sorted({waitables.get(obj, sentinels.get(obj)) for obj in ready}):
            conn = world.conns[rank]
            if conn.poll():
                try:
                    status, value, type_name, retiring = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    status = None
                if status is not None:
                    gathered.pending.remove(rank)
                    if retiring:
                        gathered.retiring.add(rank)
                    if status == "error":
                        gathered.failures[rank] = (type_name, value)
                        grace_deadline_s = min(grace_deadline_s, time.monotonic() + grace_s)
                    else:
                        gathered.results[rank] = value
                    continue
            process = world.processes[rank]
            if not process.is_alive():
                process.join()
                # the others get grace_s to answer, so the crash is reported with what
                # its peers saw of it (their errors name the dead rank)
                if gathered.crashed is None:
                    gathered.crashed = (rank, process.exitcode)
                gathered.pending.remove(rank)
                grace_deadline_s = min(grace_deadline_s, time.monotonic() + grace_s)
    return gathered


def raise_for(gathered: Gathered, world: RankProcesses, what: str, timeout_s: float, grace_s: float) -> None:
    """Raise the error that `gathered` calls for (the caller then kills what is left).

    Stacks of still-silent ranks are dumped here, before the caller kills them.
    """
    p = world.world_size
    if gathered.crashed is not None:
        rank, exitcode = gathered.crashed
        message = f"{what}: rank {rank} of world_size {p} died with {_exit_description(exitcode)} before answering"
        if gathered.failures:
            message += f"; ranks {sorted(gathered.failures)} had raised:" + _quote_failures(gathered)
        raise WorkerCrashed(message, rank, exitcode)
    if gathered.failures:
        ranks = sorted(gathered.failures)
        noun = "rank" if len(ranks) == 1 else "ranks"
        message = f"{what}: {noun} {', '.join(map(str, ranks))} of world_size {p} raised"
        message += _quote_failures(gathered)
        if gathered.pending:
            message += (
                f"\nranks {gathered.pending} did not answer within grace_s={grace_s} after the "
                "failure (probably blocked in a collective waiting for a failed rank) and were killed"
                + _quote_stacks(world.dump_stacks(gathered.pending))
            )
        raise RankError(message, dict(gathered.failures))
    if gathered.pending:
        answered = sorted(gathered.results)
        message = (
            f"{what} with world_size {p} did not finish within timeout_s={timeout_s}: "
            f"ranks {gathered.pending} had not answered (ranks {answered} had); "
            "its processes were killed" + _quote_stacks(world.dump_stacks(gathered.pending))
        )
        raise DistributedTimeout(message, p, list(gathered.pending))


def _quote_failures(gathered: Gathered) -> str:
    return "".join(
        f"\n--- rank {rank}: {type_name} ---\n{text.rstrip()}"
        for rank, (type_name, text) in sorted(gathered.failures.items())
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_fresh_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    init: bool = True,
    grace_s: float = 3.0,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` in `world_size` new processes.

    For tests that need their own init/teardown or may leave the process group broken
    (a peer dying, a collective timing out): nothing is reused, every process is reaped.
    With `init` True each rank first joins the default gloo group (fresh `file://`
    rendezvous) and the group is destroyed after `fn`. Either way each rank's
    environment has MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port), RANK,
    WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, so with `init` False `fn` can call
    `init_process_group("gloo", init_method="env://")` itself. Returns the results in
    rank order; raises `RankError`, `DistributedTimeout` or `WorkerCrashed` like
    `run_distributed` (`grace_s`: how long the other ranks may still run after one
    raised). `timeout_s` counts from the spawn, so it includes importing torch.
    """
    validate_call(world_size, timeout_s, grace_s)
    message = encode_task(fn, args, kwargs, "run_fresh_world")
    what = f"run_fresh_world({describe_function(fn)})"
    port = free_port()
    deadline_s = time.monotonic() + timeout_s
    scratch: dict[str, str] = {}

    def make_args(rank: int, conn: Connection, stack_file: str) -> tuple:
        scratch.setdefault("dir", os.path.dirname(stack_file))
        init_file = os.path.join(scratch["dir"], "rendezvous") if init else None
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
        return (rank, world_size, init_file, conn, os.getpid(), PROCESS_GROUP_TIMEOUT_S, stack_file, env, message)

    world = RankProcesses.spawn(world_size, worker.fresh_worker_main, make_args)
    try:
        gathered = gather_answers(world, deadline_s, grace_s)
        raise_for(gathered, world, what, timeout_s, grace_s)
        world.reap(REAP_TIMEOUT_S)
        return [gathered.results[rank] for rank in range(world_size)]
    finally:
        world.kill()
