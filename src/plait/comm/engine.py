"""The comm thread of one communicator: runs its group's collectives in the order
they were called, and counts them.

Each :class:`~plait.comm.communicator.Communicator` owns one :class:`Engine`, so
collectives on different groups never wait for each other (as in torch, where every
process group has its own queue): threads may call on any groups in any interleaving
that torch.distributed completes. ``async_op=True`` queues the collective and returns
a :class:`Handle` at once, so the caller computes while the schedule runs (the comm
thread spends its time in gloo/NCCL waits, which release the GIL). A synchronous call
runs inline when nothing is queued on its group, else it queues behind the pending
ones and waits: every rank issues a group's collectives in program order, as torch
requires, so messages always match.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict

import torch.futures

from plait.comm.errors import CommError, MismatchError

_HISTORY = 32  # recent calls kept to say "issued in different orders"


class Stats:
    """Per collective: calls, bytes_sent, messages, time_s, and calls per algorithm."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[str, dict] = {}

    def record(self, collective: str, algorithm: str, bytes_sent: int, messages: int, time_s: float) -> None:
        with self._lock:
            entry = self._entries.setdefault(
                collective, {"calls": 0, "bytes_sent": 0, "messages": 0, "time_s": 0.0, "algorithms": {}}
            )
            entry["calls"] += 1
            entry["bytes_sent"] += bytes_sent
            entry["messages"] += messages
            entry["time_s"] += time_s
            entry["algorithms"][algorithm] = entry["algorithms"].get(algorithm, 0) + 1

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {name: {**entry, "algorithms": dict(entry["algorithms"])} for name, entry in self._entries.items()}

    def reset(self) -> None:
        with self._lock:
            self._entries.clear()


def merge_stats(snapshots) -> dict[str, dict]:
    """Several communicators' ``Stats.snapshot()``s added up per collective."""
    total: dict[str, dict] = {}
    for snapshot in snapshots:
        for name, entry in snapshot.items():
            into = total.setdefault(name, {"calls": 0, "bytes_sent": 0, "messages": 0, "time_s": 0.0,
                                           "algorithms": {}})
            for key in ("calls", "bytes_sent", "messages", "time_s"):
                into[key] += entry[key]
            for algorithm, calls in entry["algorithms"].items():
                into["algorithms"][algorithm] = into["algorithms"].get(algorithm, 0) + calls
    return total


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
    """Runs jobs in submission order on one daemon thread (started on first async use),
    and numbers the group's collectives.

    A job submitted with a ``signature`` (a collective's ``CallSignature``) is a
    numbered call: it runs as ``job(seq)``, ``seq`` its number among the group's
    calls, given when it starts (the in-band header carries it);
    ``known_calls()`` names the recent and queued ones, so a mismatch can say "issued
    in different orders". Other jobs (a communicator's creation, ``enqueue``) run as
    ``job()``.

    After a collective fails with a CommError (a peer died or timed out) or an in-band
    MismatchError (ranks' calls differ), messages of it may still be in flight, so
    the group can no longer be trusted: every later collective on this group fails at
    once with an error naming the first failure, instead of each waiting out its
    timeout. Argument errors raised before any message (ValueError, a "deep" check's
    MismatchError) poison nothing.
    """

    def __init__(self, name: str = "plait-comm"):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards _pending and the inline fast path
        self._calls_lock = threading.Lock()  # guards the call numbers (taken with the run lock held)
        self._run_lock = threading.Lock()  # one job at a time
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._broken: tuple[str, BaseException] | None = None
        self._failed_handles: list[Handle] = []
        self._closed: str | None = None  # why no more jobs are taken (close())
        self._seq = 0  # numbered calls started so far (the in-band header's call number)
        self._history: OrderedDict[int, object] = OrderedDict()  # seq -> signature, the recent ones
        self._queued: list = []  # signatures of numbered calls submitted but not yet started, in order

    def _start(self, description: str, signature, queued: bool = True) -> tuple:
        """The arguments of a job about to run: refused if the group is broken; a
        numbered call gets its number (it leaves the queued list unless it ran at once,
        ``queued`` False, and enters the history)."""
        if self._broken is not None:
            if signature is not None and queued:
                with self._calls_lock:
                    self._queued.remove(signature)
            failed, error = self._broken
            raise CommError(
                rank=getattr(error, "rank", -1), collective=description, algorithm="-", step="-", peer="-",
                reason=f"not run: an earlier collective, {failed}, failed ({error}); messages of it may "
                       "still be in flight, so this process group cannot be used any more",
            )
        if signature is None:
            return ()
        with self._calls_lock:
            if queued:
                self._queued.remove(signature)
            self._seq += 1
            self._history[self._seq] = signature
            if len(self._history) > _HISTORY:
                self._history.popitem(last=False)
            return (self._seq,)

    def _failed(self, description: str, error: BaseException) -> None:
        """After ``error``: the group stays usable only when every rank raised it before
        sending (argument errors, the "deep" check)."""
        if isinstance(error, (CommError, MismatchError)) and not (
                isinstance(error, MismatchError) and error.before_any_message):
            self._broken = (description, error)

    def known_calls(self) -> dict[int, object]:
        """The recent numbered calls and the ones queued after the running one, by call
        number (for naming calls issued in different orders)."""
        with self._calls_lock:
            calls = dict(self._history)
            for offset, signature in enumerate(self._queued, start=1):
                calls[self._seq + offset] = signature
        return calls

    def submit(self, job, description: str, async_op: bool, signature=None):
        """Queue or run ``job`` in program order (``job(seq)`` when ``signature`` is
        given, see the class docstring); returns None or a Handle. A synchronous job
        runs inline, on the caller's thread, when nothing is queued."""
        if self._closed is not None:
            raise RuntimeError(f"{description}: not run: {self._closed}")
        on_thread = threading.current_thread() is self._thread
        inline = on_thread
        if not on_thread and not async_op:
            with self._lock:
                inline = self._pending == 0
                if inline:
                    self._run_lock.acquire()
        if inline:
            # a composite job (``enqueue``) calling collectives already holds the run lock
            # and runs in queue order, so its collectives run inline too; it starts at once,
            # so it never enters the queued list
            try:
                args = self._start(description, signature, queued=False)
                try:
                    result = job(*args)
                except BaseException as error:
                    self._failed(description, error)
                    raise
            finally:
                if not on_thread:
                    self._run_lock.release()
            if not async_op:
                return None
            handle = Handle(description)
            handle.result = result
            handle.started_s = handle.finished_s = time.perf_counter()
            handle._finish(None)
            return handle
        handle = Handle(description)
        if signature is not None:
            with self._calls_lock:
                self._queued.append(signature)
        with self._lock:
            if self._closed is not None:  # closed since the check above: never start a thread again
                if signature is not None:
                    with self._calls_lock:
                        self._queued.remove(signature)
                raise RuntimeError(f"{description}: not run: {self._closed}")
            self._pending += 1
            self._queue.put((job, handle, signature))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
        if async_op:
            return handle
        handle.wait()
        return None

    def _loop(self) -> None:
        while True:
            job, handle, signature = self._queue.get()
            if job is None:  # close()'s marker: every job queued before it has run
                return
            error = None
            with self._run_lock:
                handle.started_s = time.perf_counter()
                try:
                    args = self._start(handle.description, signature)
                    try:
                        handle.result = job(*args)
                    except BaseException as caught:
                        self._failed(handle.description, caught)
                        raise
                except BaseException as caught:  # handed to the waiter
                    error = caught
                    self._failed_handles.append(handle)
                handle.finished_s = time.perf_counter()
            with self._lock:
                self._pending -= 1
            handle._finish(error)

    def close(self, reason: str, timeout_s: float) -> bool:
        """Take no more jobs (later ones raise ``reason``) and stop the thread after the
        jobs already queued; True when it stopped within ``timeout_s``."""
        with self._lock:
            if self._closed is not None:
                return True
            self._closed = reason  # submit() refuses from here on; jobs already queued still run
            thread = self._thread
            self._queue.put((None, None, None))
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

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
