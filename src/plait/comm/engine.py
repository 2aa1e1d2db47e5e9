"""The communication engine: one background thread per process that runs
collectives in the order they were called, plus the process-wide config and the
per-collective counters.

``async_op=True`` queues the collective and returns a :class:`Handle` at once, so
the caller computes while the schedule runs (the comm thread spends its time in
gloo/NCCL waits, which release the GIL). A synchronous call runs inline when nothing
is queued, else it queues behind the pending ones and waits: every rank issues
collectives in program order, as torch requires, so messages always match.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from plait.comm.errors import CommError
from plait.comm.executor import Executor
from plait.comm.settings import checked_setting, from_environment


@dataclass
class CommConfig:
    """Process-wide defaults (set with :func:`configure`; env vars give the start values,
    checked as configure() checks its arguments: plait.comm.settings).

    timeout_s: how long a collective may wait for a peer (PLAIT_COMM_TIMEOUT_S, 300).
    check_args: exchange sizes/dtypes/op/root/algorithm before each collective and raise
        on a mismatch (PLAIT_COMM_CHECK, on); costs one small all-gather per call.
    segment_bytes: messages above this are split so reductions stream
        (PLAIT_COMM_SEGMENT_BYTES, 4 MiB); every rank must use the same value.
        Measured on gloo/loopback: 4 MiB beat 256 KiB-2 MiB and no splitting for
        16-64 MB all-reduces (each message costs ~0.1-0.2 ms to post there).
    pipeline_segment_bytes: segment size of pipelined chains and binary trees (256 KiB).
    hierarchy: default hierarchy for algorithm="hierarchical" (PLAIT_HIERARCHY).
    algorithms: per-collective algorithm that algorithm="auto" (and None) runs instead
        of the tuner's choice, e.g. {"all_reduce": "ring"} (PLAIT_ALGORITHMS,
        "all_reduce=ring,broadcast=tree").
    """

    timeout_s: float = field(default_factory=lambda: from_environment("PLAIT_COMM_TIMEOUT_S", "timeout_s", 300.0))
    check_args: bool = field(default_factory=lambda: from_environment("PLAIT_COMM_CHECK", "check_args", True))
    segment_bytes: int = field(
        default_factory=lambda: from_environment("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", 4 << 20))
    pipeline_segment_bytes: int = 256 << 10
    hierarchy: object = field(default_factory=lambda: from_environment("PLAIT_HIERARCHY", "hierarchy", None))
    algorithms: dict = field(default_factory=lambda: from_environment("PLAIT_ALGORITHMS", "algorithms", {}))


CONFIG = CommConfig()


_KEEP = object()


def configure(*, timeout_s=None, check_args=None, segment_bytes=None, pipeline_segment_bytes=None,
              hierarchy=_KEEP, algorithms=None):
    """Change process-wide comm defaults (arguments left out stay as they are);
    returns the previous values, so ``configure(**previous)`` restores them. Values are
    checked as the PLAIT_* variables are (plait.comm.settings): a ValueError names the
    keyword, the value and the valid range."""
    previous = dict(
        timeout_s=CONFIG.timeout_s,
        check_args=CONFIG.check_args,
        segment_bytes=CONFIG.segment_bytes,
        pipeline_segment_bytes=CONFIG.pipeline_segment_bytes,
        hierarchy=CONFIG.hierarchy,
        algorithms=dict(CONFIG.algorithms),
    )
    # every value is checked before any is set: a refused call changes nothing
    checked = {name: checked_setting(name, value, name)
               for name, value in dict(timeout_s=timeout_s, check_args=check_args, segment_bytes=segment_bytes,
                                       algorithms=algorithms).items() if value is not None}
    if hierarchy is not _KEEP:
        checked["hierarchy"] = checked_setting("hierarchy", hierarchy, "hierarchy")
    if pipeline_segment_bytes is not None:
        if pipeline_segment_bytes <= 0:
            raise ValueError(f"pipeline_segment_bytes must be > 0, got {pipeline_segment_bytes}")
        CONFIG.pipeline_segment_bytes = int(pipeline_segment_bytes)
    for name, value in checked.items():
        setattr(CONFIG, name, value)
    return previous


# ----- counters ----------------------------------------------------------------------------
_STATS_LOCK = threading.Lock()
_STATS: dict[str, dict] = {}


def record(collective: str, algorithm: str, bytes_sent: int, messages: int, time_s: float) -> None:
    with _STATS_LOCK:
        entry = _STATS.setdefault(
            collective, {"calls": 0, "bytes_sent": 0, "messages": 0, "time_s": 0.0, "algorithms": {}}
        )
        entry["calls"] += 1
        entry["bytes_sent"] += bytes_sent
        entry["messages"] += messages
        entry["time_s"] += time_s
        entry["algorithms"][algorithm] = entry["algorithms"].get(algorithm, 0) + 1


def stats() -> dict[str, dict]:
    """Per collective on this rank: calls, bytes_sent, messages, time_s, and calls per
    algorithm. (For algorithm="torch", bytes are what the call moves, as torch does
    not report its own traffic.)"""
    with _STATS_LOCK:
        return {name: {**entry, "algorithms": dict(entry["algorithms"])} for name, entry in _STATS.items()}


def reset_stats() -> None:
    with _STATS_LOCK:
        _STATS.clear()


# ----- handles and the thread ------------------------------------------------------------
class Handle:
    """What ``async_op=True`` returns, shaped like torch's ``Work``: ``wait()`` blocks
    until the collective is done (re-raising its error), ``is_completed()`` polls,
    ``is_success()`` says whether it finished without error, and ``get_future()``
    gives a ``torch.futures.Future`` of its output.

    ``output`` is what the future holds, set by the collective that made the handle:
    a list of tensors, as torch's futures hold (``[tensor]`` for all_reduce, broadcast
    and reduce; ``[output]`` for the single-tensor gathers and scatters; the output
    list for the list forms; ``[]`` for barrier).
    """

    def __init__(self, description: str):
        self.description = description
        self.started_s: float | None = None  # time.perf_counter() when the comm thread began it
        self.finished_s: float | None = None
        self.result = None  # what the job returned (bytes sent, for collectives)
        self.output = None  # the future's value (see the class docstring)
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._seen = False  # its error was raised to the caller
        self._futures_lock = threading.Lock()
        self._futures: list = []  # futures handed out before the collective finished

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        with self._futures_lock:
            self._done.set()
            waiting, self._futures = self._futures, []
        for future in waiting:
            self._settle(future)

    def _settle(self, future) -> None:
        if self._error is not None:
            self._seen = True  # the future carries it to whoever waits on it
            future.set_exception(self._error)
        else:
            future.set_result(self.output if self.output is not None else [])

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        """True when the collective finished without error (as torch's Work, it is an
        error to ask before it has finished: call ``wait()`` or poll ``is_completed()``)."""
        if not self._done.is_set():
            raise RuntimeError(
                f"is_success() on {self.description} before it finished; call wait() first "
                "or poll is_completed()"
            )
        return self._error is None

    def get_future(self):
        """A ``torch.futures.Future`` completed with ``output`` when the collective
        finishes, or with its error (``future.wait()`` raises it). Chain with
        ``.then(...)`` as with torch's Work, e.g. in a DDP communication hook."""
        import torch.futures  # torch is already loaded by any collective

        future = torch.futures.Future()
        with self._futures_lock:
            if not self._done.is_set():
                self._futures.append(future)
                return future
        self._settle(future)
        return future

    def wait(self, timeout=None) -> bool:
        """Block until done; ``timeout`` in seconds (or a timedelta) raises TimeoutError."""
        if hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.description} still running after {timeout}s")
        if self._error is not None:
            self._seen = True
            raise self._error
        return True

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None


class Engine:
    """Runs jobs in submission order on one daemon thread (started on first async use).

    After a collective fails with a CommError (a peer died or timed out), messages of
    it may still be in flight, so the group can no longer be trusted: every later
    collective on this process fails at once with an error naming the first failure,
    instead of each waiting out its timeout. Argument errors (MismatchError,
    ValueError) do not poison anything: every rank raises them before sending.
    """

    def __init__(self):
        self.executor = Executor()
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards _pending and the inline fast path
        self._run_lock = threading.Lock()  # one job at a time
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._broken: tuple[str, BaseException] | None = None
        self._failed_handles: list[Handle] = []

    def _run(self, job, description: str) -> None:
        if self._broken is not None:
            failed, error = self._broken
            raise CommError(
                rank=getattr(error, "rank", -1), collective=description, algorithm="-", step="-", peer="-",
                reason=f"not run: an earlier collective, {failed}, failed ({error}); messages of it may "
                       "still be in flight, so this process group cannot be used any more",
            )
        try:
            return job()
        except CommError as error:
            self._broken = (description, error)
            raise

    def submit(self, job, description: str, async_op: bool):
        if threading.current_thread() is self._thread:
            # a composite job (``enqueue``) calling collectives: it already holds the
            # run lock and runs in queue order, so its collectives run inline
            result = self._run(job, description)
            if not async_op:
                return None
            handle = Handle(description)
            handle.result = result
            handle.started_s = handle.finished_s = time.perf_counter()
            handle._finish(None)
            return handle
        if not async_op:
            with self._lock:
                inline = self._pending == 0
                if inline:
                    self._run_lock.acquire()
            if inline:
                try:
                    self._run(job, description)
                finally:
                    self._run_lock.release()
                return None
        handle = Handle(description)
        with self._lock:
            self._pending += 1
            self._queue.put((job, handle))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="plait-comm", daemon=True)
                self._thread.start()
        if async_op:
            return handle
        handle.wait()
        return None

    def _loop(self) -> None:
        while True:
            job, handle = self._queue.get()
            error = None
            with self._run_lock:
                handle.started_s = time.perf_counter()
                try:
                    handle.result = self._run(job, handle.description)
                except BaseException as caught:  # handed to the waiter
                    error = caught
                    self._failed_handles.append(handle)
                handle.finished_s = time.perf_counter()
            with self._lock:
                self._pending -= 1
            handle._finish(error)

    def synchronize(self) -> None:
        """Wait until every queued collective has run; re-raise the first error among
        them that was not already seen (so a forgotten handle cannot hide a failure)."""
        marker = self.submit(lambda: None, "synchronize", async_op=True)
        marker._seen = True
        try:
            marker.wait()
        except CommError:
            pass  # the earlier failure, reported below
        unseen = [handle for handle in self._failed_handles if not handle._seen]
        self._failed_handles.clear()
        if unseen:
            first = unseen[0]
            first._seen = True
            raise RuntimeError(
                f"{first.description} (queued with async_op=True) failed: {first._error}"
            ) from first._error


_ENGINE: Engine | None = None
_ENGINE_LOCK = threading.Lock()


def engine() -> Engine:
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = Engine()
        return _ENGINE


def enqueue(job, description: str) -> Handle:
    """Run ``job()`` on the comm thread after every collective queued before it, and
    return its Handle at once (``handle.result`` is what the job returned).

    For composite communication (compress, all-gather, decompress) that must stay in
    program order with the other collectives: collectives the job calls run inline
    on the comm thread. Every rank must enqueue the same jobs in the same order."""
    return engine().submit(job, description, async_op=True)


_LOCAL = threading.local()


class unchecked:
    """``with unchecked():`` collectives launched by this thread skip the argument
    check (``CommConfig.check_args``): for callers that verified sizes and order once
    up front (DataParallel's buckets) and call the same collectives every step."""

    def __enter__(self):
        self._previous = getattr(_LOCAL, "skip_check", False)
        _LOCAL.skip_check = True
        return self

    def __exit__(self, *exc):
        _LOCAL.skip_check = self._previous
        return False


def check_enabled() -> bool:
    return CONFIG.check_args and not getattr(_LOCAL, "skip_check", False)


def timed(collective: str, algorithm: str, run):
    """Run ``run() -> (bytes_sent, messages)`` and record it."""
    start = time.perf_counter()
    bytes_sent, messages = run()
    record(collective, algorithm, bytes_sent, messages, time.perf_counter() - start)
