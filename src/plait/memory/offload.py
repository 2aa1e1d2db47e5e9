"""Activation offload: tensors autograd saves for the backward leave the compute
device during the forward and come back before the backward that needs them.

``ActivationOffloader.pack`` (a saved-tensor pack hook the pipeline engine composes
with its own) moves every saved tensor of at least ``min_bytes`` that is not a
parameter: on CPU to a file of its own under ``directory`` (raw bytes; the tensor's
memory is freed once nothing else holds it, so resident memory really drops), on an
accelerator to host memory. Autograd keeps a small handle instead.

On CPU the bytes are written off the critical path: ``pack`` creates the file and
reserves its bytes (``posix_fallocate``: a full disk or a read-only directory is
named right there, in the forward, as before) and queues the write for a writer
thread, which copies the storage into the file (straight from its memory: no
intermediate bytes object) while the forward computes on. The storage stays held
until its write is done. During a forward the offloader holds every storage until
``end()`` anyway (one copy per storage), so the writes add no memory there; past
``end()`` at most ``max_pending_bytes`` of storages whose write is still queued stay
held (``end()`` waits for the writer down to that; a single larger storage is waited
for alone): the bounded extra memory, against the synchronous writes', is
``max_pending_bytes`` (default 64 MiB), and ``stats["end_wait_s"]`` is the time
``end()`` waited for it. A read waits for its file's write. A tensor written in place
after it was saved (which autograd refuses without hooks) is refused by name at its
read when the change came before the forward's ``end()`` or before its write finished
(the write may have seen it).

The schedule is data, so the engine knows which micro-batch's backward comes next:
before each action it calls ``prefetch(key)`` for the next backward's (micro-batch,
stage), and a background thread reads those tensors back while the current action
computes. ``unpack`` returns the prefetched tensor, or reads it on the spot when the
prefetch has not finished (counted in ``stats["late"]``). Views of one storage saved
in one forward share one file and one read-back. A storage is read once and kept
while autograd holds a view of it (zero bubble's weight pass unpacks again); its
file is deleted when the last view dies. A file that does not fit raises
plait.errors.DiskFull, naming its path, its bytes and the bytes free there (the
message a checkpoint's full disk gives).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import weakref
from pathlib import Path

import torch

from plait.errors import DiskFull, is_disk_full

# what to do when an offload file does not fit (plait train's offload directory is OUT/offload/rank<r>)
DISK_FULL_FIX = ("free some space there, or put the offload directory on a filesystem with room (plait train keeps it "
                 "under --out), or offload less")


class _Stored:
    """One offloaded storage (every saved view of it shares the file and the read-back)."""

    __slots__ = ("key", "nbytes", "device", "path", "host", "storage", "ready", "lock", "holder", "written", "error",
                 "writer", "__weakref__")

    def __init__(self, key, nbytes: int, device: torch.device):
        self.key, self.nbytes, self.device = key, nbytes, device
        self.path: Path | None = None
        self.host: torch.Tensor | None = None
        self.storage = None  # the storage read back
        self.ready = threading.Event()
        self.lock = threading.Lock()
        self.holder = None  # what ``on_loaded`` returned for it (a memory meter's holder)
        self.written = threading.Event()  # its file holds its bytes (set at once for host memory)
        self.error: BaseException | None = None  # what its write raised, or a change while it was written
        self.writer: int | None = None  # the thread that wrote its bytes (threading.get_ident())


class _Offloaded:
    """What autograd holds instead of an offloaded tensor: its storage's record and its view."""

    __slots__ = ("stored", "shape", "stride", "offset", "dtype")

    def __init__(self, stored: _Stored, tensor: torch.Tensor):
        self.stored = stored
        self.shape, self.stride, self.offset = tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
        self.dtype = tensor.dtype


class ActivationOffloader:
    """See the module docstring. ``keep_storages``: data_ptrs never offloaded (the
    engine passes its parameters' storages). The engine brackets each stage forward
    with ``begin(key)`` / ``end()``: within one forward, views of one storage share
    one copy; after ``end`` the forward's storages are held only by whoever else
    holds them."""

    def __init__(self, directory, *, min_bytes: int = 64 << 10, on_loaded=None, max_pending_bytes: int = 64 << 20):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.min_bytes = min_bytes
        self.keep_storages: set[int] = set()
        self.on_loaded = on_loaded  # called with each storage read back, as a uint8 tensor (a meter's pack)
        self.key = None  # (micro-batch, stage) whose forward is running
        self.enabled = True
        # this forward's storages: data_ptr -> (record, storage, the first tensor saved of it, its version then)
        self._current: dict[int, tuple] = {}
        self._names = itertools.count()
        self._by_key: dict[object, list] = {}  # key -> weak references to its records
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._prefetch_loop, name="plait-offload-prefetch", daemon=True)
        self._thread.start()
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0  # bytes of storages queued for the writer and not yet written
        self._pending = threading.Condition()
        self._writes: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="plait-offload-writer", daemon=True)
        self._writer.start()
        self.stats = {"offloaded_bytes": 0, "storages": 0, "write_s": 0.0, "read_s": 0.0, "late": 0, "prefetched": 0,
                      "end_wait_s": 0.0}

    # ----- the forward: out ------------------------------------------------------------------
    def begin(self, key, enabled: bool = True) -> None:
        """A stage forward starts; ``enabled`` False keeps its tensors in memory (the
        engine says so when this micro-batch's backward is the very next computation:
        a round trip through a file would only add time)."""
        self.key, self._current, self.enabled = key, {}, enabled

    def end(self) -> None:
        """The forward is over: its storages are no longer held here, and what is saved
        until the next ``begin`` (a recompute's regenerated tensors, during a backward)
        stays in memory: it is needed at once and freed by its backward."""
        for stored, _storage, tensor, version in self._current.values():
            if tensor._version != version and stored.error is None:
                stored.error = _modified(stored, tensor, version)
        self._current = {}
        self.enabled = False
        start_s = time.perf_counter()
        with self._pending:
            while self._pending_bytes > self.max_pending_bytes:
                self._pending.wait()
        self.stats["end_wait_s"] += time.perf_counter() - start_s

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if not self.enabled or storage.nbytes() < self.min_bytes or pointer in self.keep_storages:
            return tensor
        entry = self._current.get(pointer)
        if entry is None:  # held until end(): the pointer stays unique; its version checked there
            entry = (self._write(storage, tensor), storage, tensor.detach(), tensor._version)
            self._current[pointer] = entry
        return _Offloaded(entry[0], tensor)

    def _write(self, storage, tensor: torch.Tensor) -> _Stored:
        device = tensor.device
        stored = _Stored(self.key, storage.nbytes(), device)
        start_s = time.perf_counter()
        whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)  # the storage as bytes
        if device.type == "cpu":
            stored.path = self.directory / f"{next(self._names)}.bin"
            try:
                descriptor = os.open(stored.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    if stored.nbytes:
                        os.posix_fallocate(descriptor, 0, stored.nbytes)  # a full disk fails here, not later
                except BaseException:
                    os.close(descriptor)
                    raise
            except OSError as error:
                _remove(stored.path)  # what part of it was made
                if is_disk_full(error):
                    raise DiskFull(stored.path, stored.nbytes, DISK_FULL_FIX) from None
                raise
            weakref.finalize(stored, _remove, stored.path)
            with self._pending:
                self._pending_bytes += stored.nbytes
            self._writes.put((stored, descriptor, whole, tensor.detach(), tensor._version))  # write_s: the writer's
        else:
            stored.host = whole.to("cpu")
            stored.writer = threading.get_ident()
            stored.written.set()
            self.stats["write_s"] += time.perf_counter() - start_s
        self.stats["offloaded_bytes"] += stored.nbytes
        self.stats["storages"] += 1
        with self._lock:
            self._by_key.setdefault(self.key, []).append(weakref.ref(stored))
        return stored

    # ----- the backward: back ----------------------------------------------------------------
    def prefetch(self, key) -> None:
        """Read back (in the background) every storage offloaded under ``key``."""
        with self._lock:
            records = [ref() for ref in self._by_key.pop(key, [])]
        for stored in records:
            if stored is not None:
                self._jobs.put(stored)

    def unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        stored = packed.stored
        if not stored.ready.is_set():
            self.stats["late"] += 1  # the prefetch has not finished (or was never asked): read it here
            self._load(stored)
        return torch.empty(0, dtype=packed.dtype, device=stored.device).set_(
            stored.storage, packed.offset, packed.shape, packed.stride)

    def _write_loop(self) -> None:
        """The writer thread: each queued storage's bytes into its (reserved) file, in order."""
        while True:
            job = self._writes.get()
            if job is None:
                return
            self._write_bytes(*job)
            del job

    def _write_bytes(self, stored: _Stored, descriptor: int, whole: torch.Tensor, tensor: torch.Tensor,
                     version: int) -> None:
        stored.writer = threading.get_ident()
        start_s = time.perf_counter()
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(memoryview(whole.numpy()))  # releases the GIL: the forward computes on
            if tensor._version != version:
                stored.error = _modified(stored, tensor, version)
        except BaseException as error:  # noqa: BLE001 - raised where the tensor is read back
            stored.error = DiskFull(stored.path, stored.nbytes, DISK_FULL_FIX) \
                if isinstance(error, OSError) and is_disk_full(error) else error
        finally:
            self.stats["write_s"] += time.perf_counter() - start_s
            stored.written.set()
            with self._pending:
                self._pending_bytes -= stored.nbytes
                self._pending.notify_all()

    def _prefetch_loop(self) -> None:
        while True:
            stored = self._jobs.get()
            if stored is None:
                return
            try:
                self._load(stored)
            except BaseException:  # noqa: BLE001 - not ready: the backward's own read raises it, by name
                continue
            self.stats["prefetched"] += 1

    def _load(self, stored: _Stored) -> None:
        with stored.lock:  # one reader per storage: the prefetch thread or the backward, whichever comes first
            if stored.ready.is_set():
                return
            stored.written.wait()
            if stored.error is not None:
                raise stored.error
            start_s = time.perf_counter()
            if stored.path is not None:
                raw = torch.from_file(str(stored.path), shared=False, size=stored.nbytes, dtype=torch.uint8)
            else:
                raw = stored.host.to(stored.device)
            stored.storage = raw.untyped_storage()
            stored.host = None
            if self.on_loaded is not None:
                stored.holder = self.on_loaded(raw)
            self.stats["read_s"] += time.perf_counter() - start_s
            stored.ready.set()

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=10)
        self._jobs.put(None)
        self._thread.join(timeout=10)


def _modified(stored: _Stored, tensor: torch.Tensor, version: int) -> RuntimeError:
    return RuntimeError(
        f"activation offload: a tensor saved for the backward (shape {tuple(tensor.shape)}, {tensor.dtype}) was "
        f"modified in place after it was saved (version {version} -> {tensor._version}), while its bytes were being "
        f"written to {stored.path}; autograd refuses that without offload too: clone it before the in-place op")


def _remove(path: Path) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


__all__ = ["ActivationOffloader"]
