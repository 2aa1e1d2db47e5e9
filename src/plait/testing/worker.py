"""Child side of the harness: what a spawned rank process runs.

Two entry points, both top-level so the spawn context can pickle them:

- `pool_worker_main`: a long-lived pool worker. Joins the default gloo process group
  once, then serves tasks from its pipe until told to stop or its parent dies.
- `fresh_worker_main`: a one-shot rank of a fresh world. Optionally joins gloo, runs
  one task, destroys the process group and exits.

Wire format (pickle bytes over a `multiprocessing` Pipe, never the torch
`ForkingPickler`, so tensors travel by value and not as shared-memory handles that
die with the sender):

- parent -> worker: `(sys_path, task_bytes)` where `task_bytes = pickle((fn, args,
  kwargs))`, unpickled only after `sys.path` mirrors the parent's (so test modules
  that pytest put on the path after the pool started are importable); `b""` stops a
  pool worker.
- worker -> parent: `(status, value, type_name, retiring)`: `("ready", None, None,
  False)` once the process group is up, then per task `("ok", result, None, ...)` or
  `("error", traceback_text, exception_type_name, ...)`; `retiring` is True when the
  worker exits after this answer (a fresh rank, or a pool worker whose task destroyed
  the default process group).

Nothing here imports torch at module level: the parent sets `OMP_NUM_THREADS=1` in
the environment before spawning, and each worker calls `torch.set_num_threads(1)`.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

# How often a worker checks that the process that spawned it is still alive.
PARENT_POLL_INTERVAL_S = 0.5
# Signal the parent sends to a stuck rank to make it dump every thread's Python stack
# (faulthandler writes it to the rank's stack file) before the rank is killed.
STACK_DUMP_SIGNAL = signal.SIGUSR1


def _exit_when_parent_dies(parent_pid: int, scratch_dir: str) -> None:
    """Watchdog loop: hard-exit this worker once it has been re-parented.

    Runs in a daemon thread so it also fires while the main thread is blocked inside
    a collective (gloo releases the GIL while it waits). The dead parent cannot remove
    the world's scratch directory (rendezvous and stack files), so the orphans do.
    """
    while True:
        time.sleep(PARENT_POLL_INTERVAL_S)
        if os.getppid() != parent_pid:
            shutil.rmtree(scratch_dir, ignore_errors=True)
            os._exit(70)


def _prepare_process(parent_pid: int, stack_file: str, env: dict[str, str]) -> None:
    """Make this spawned process a well-behaved rank: env, threads, signals, watchdog.

    SIGINT is ignored because Ctrl-C in a terminal reaches the whole process group;
    the parent decides what happens to its workers (its atexit hook kills them).
    """
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Kept open for the life of the process: faulthandler writes to the raw fd.
    stack_stream = open(stack_file, "w")  # noqa: SIM115
    faulthandler.register(STACK_DUMP_SIGNAL, file=stack_stream, all_threads=True)
    threading.Thread(
        target=_exit_when_parent_dies,
        args=(parent_pid, os.path.dirname(stack_file)),
        name="parent-watchdog",
        daemon=True,
    ).start()
    import torch

    torch.set_num_threads(1)


def _init_process_group(rank: int, world_size: int, init_file: str, pg_timeout_s: float) -> None:
    """Join the default gloo group through a `file://` rendezvous (no port to collide)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )


def _error_answer(exc: BaseException) -> tuple[str, str, str]:
    """The exception being handled as an ("error", traceback text, type name) answer."""
    return ("error", traceback.format_exc(), type(exc).__name__)


def _run_task(rank: int, world_size: int, message: bytes) -> tuple[str, Any, str | None]:
    """Decode one task and call `fn(rank, world_size, *args, **kwargs)`.

    Every exception (SystemExit included) becomes an error answer rather than
    propagating: a pool worker must keep serving, and the parent raises `RankError`.
    """
    try:
        sys_path, task_bytes = pickle.loads(message)
        sys.path[:] = list(sys_path) + [entry for entry in sys.path if entry not in sys_path]
        fn, args, kwargs = pickle.loads(task_bytes)
        return ("ok", fn(rank, world_size, *args, **kwargs), None)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        return _error_answer(exc)


def _send_answer(conn: Connection, rank: int, answer: tuple, retiring: bool = False) -> None:
    """Pickle `(status, value, type name, retiring)` and send it; `retiring` tells a pool
    that this worker exits after answering. An unpicklable result is the task's error."""
    status, value, type_name = answer
    try:
        payload = pickle.dumps((status, value, type_name, retiring))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        message = (
            f"rank {rank} returned a {type(value).__name__} that cannot be pickled "
            f"({type(exc).__name__}: {exc}); return plain data or tensors"
        )
        payload = pickle.dumps(("error", message, "TypeError", retiring))
    conn.send_bytes(payload)


def _flush_stdio() -> None:
    """Flush Python's buffers so a task's prints reach the captured fds promptly."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def barrier_probe(rank: int, world_size: int) -> None:
    """Health check run by the pool after a failure: all ranks meet at a barrier."""
    import torch.distributed as dist

    dist.barrier()


def pool_worker_main(
    rank: int,
    world_size: int,
    init_file: str,
    conn: Connection,
    parent_pid: int,
    pg_timeout_s: float,
    stack_file: str,
) -> None:
    """Serve tasks for one rank of a persistent pool until stopped or orphaned.

    Exits with `os._exit` (no interpreter teardown) so a process group whose peers are
    already gone cannot block the exit in gloo's destructors.
    """
    try:
        _prepare_process(parent_pid, stack_file, {})
        _init_process_group(rank, world_size, init_file, pg_timeout_s)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        _send_answer(conn, rank, _error_answer(exc), retiring=True)
        _flush_stdio()
        os._exit(1)
    _send_answer(conn, rank, ("ready", None, None))
    import torch.distributed as dist

    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not message:
            break
        answer = _run_task(rank, world_size, message)
        _flush_stdio()
        # A task that destroyed the default group leaves nothing to serve with.
        retiring = not dist.is_initialized()
        try:
            _send_answer(conn, rank, answer, retiring)
        except (BrokenPipeError, OSError):
            break
        if retiring:
            break
    _flush_stdio()
    os._exit(0)


def fresh_worker_main(
    rank: int,
    world_size: int,
    init_file: str | None,
    conn: Connection,
    parent_pid: int,
    pg_timeout_s: float,
    stack_file: str,
    env: dict[str, str],
    message: bytes,
) -> None:
    """Run one task as one rank of a fresh world, then tear the world down and exit.

    With `init_file` None the task initialises torch.distributed itself, from the
    MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE variables in `env`.
    """
    try:
        _prepare_process(parent_pid, stack_file, env)
        if init_file is not None:
            _init_process_group(rank, world_size, init_file, pg_timeout_s)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        _send_answer(conn, rank, _error_answer(exc), retiring=True)
        _flush_stdio()
        os._exit(1)
    answer = _run_task(rank, world_size, message)
    _flush_stdio()
    _send_answer(conn, rank, answer, retiring=True)
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except BaseException:  # noqa: BLE001 - the answer is already sent; exiting anyway
            pass
    _flush_stdio()
    os._exit(0)
