"""How one process group's messages travel: ``Transport.send`` / ``recv`` (one message
each: shared memory to ranks on this host, gloo to the others), ``Transport.post``
(one grouped step, NCCL), and the bytes that really left this rank, counted where
they are handed to the shared-memory rings or to torch.distributed.

Peers are group-local ranks (the executors work in schedule ranks);
``global_rank`` maps them for error messages and grouped posts.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.names.transports import GLOO


class Transport:
    """Posts point-to-point messages on one process group.

    CPU tensors go one message at a time through the group's own ``send``/``recv``
    (gloo; the least Python per message, and each message can be waited for on its
    own). Tensors on an accelerator go through ``batch_isend_irecv``, which NCCL
    runs as one group per step, so a pair that sends and receives in one step
    cannot deadlock; that path is ``grouped``: its works complete together.

    On a gloo group whose communicator set up shared memory (``use_shm``), messages
    to the ranks on this host go through :class:`~plait.comm.shm_transport.ShmTransport`
    instead; gloo's works are then waited for by polling, so a rank blocked on a
    remote message keeps moving its shared-memory ones.

    ``bytes_sent`` / ``messages_sent`` count what was handed to the rings or to
    torch.distributed on this group (headers included): a measurement independent
    of the schedules. ``description`` says which transport each peer uses.
    """

    def __init__(self, group):
        self.group = group
        self._global: dict[int, int] = {}
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.messages_sent = 0
        self._detached: list = []  # (work, tensor) of sends nobody waits for: a dropped gloo work is cancelled
        self.shm = None  # plait.comm.shm_transport.ShmTransport for the peers on this host
        self._local: frozenset[int] = frozenset()
        self.description = str(dist.get_backend(group)) if group is not None else "none"

    def use_shm(self, outcome) -> None:
        """Adopt the set-up's outcome (plait.comm.shm_setup.ShmOutcome)."""
        self.shm = outcome.transport
        self._local = frozenset(self.shm.peers) if self.shm is not None else frozenset()
        self.description = outcome.description

    def all_peers_local(self, size: int) -> bool:
        """True when every other rank of the group is reached through shared memory."""
        return self.shm is not None and len(self._local) == size - 1

    @staticmethod
    def is_grouped(device) -> bool:
        return torch.device(device).type != "cpu"

    def stages_through_host(self, device) -> bool:
        """See :func:`stages_through_host`."""
        return stages_through_host(self.group, device)

    def _count(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self.bytes_sent += tensor.numel() * tensor.element_size()
            self.messages_sent += 1

    def send(self, tensor: torch.Tensor, peer: int, tag: int):
        """Post ``tensor`` to group rank ``peer``; returns torch's work."""
        self._count(tensor)
        if peer in self._local:
            return self.shm.send(tensor, peer, tag)
        return self._polled(self.group.send([tensor], peer, tag))

    def _polled(self, work):
        return work if self.shm is None else _Polled(work, self.shm)

    def send_detached(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """A send that nobody will wait for (a mismatch told to the peer): kept here until
        it completes, since torch cancels a gloo send whose work is dropped."""
        work = self.send(tensor, peer, tag)
        with self._lock:
            self._detached = [(w, t) for w, t in self._detached if not w.is_completed()] + [(work, tensor)]

    def close(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for the detached sends still in flight, then drop
        them and the group, so the process group can be destroyed."""
        with self._lock:
            detached, self._detached = self._detached, []
        for work, _ in detached:
            try:
                work.wait(timedelta(seconds=max(timeout_s, 0.001)))
            except RuntimeError:
                pass  # the peer is gone: nobody is left to tell
        if self.shm is not None:
            self.shm.close()
        self.group = None

    def recv(self, tensor: torch.Tensor, peer: int, tag: int):
        """Post a receive into ``tensor`` from group rank ``peer``; returns the work."""
        if peer in self._local:
            return self.shm.recv(tensor, peer, tag)
        return self._polled(self.group.recv([tensor], peer, tag))

    def recv_reduce(self, tensor: torch.Tensor, peer: int, tag: int, combine):
        """A receive from ``peer`` combined into ``tensor`` as it arrives, straight from
        the shared-memory ring (``ShmTransport.recv_reduce``: no copy out); None for a
        peer reached through gloo (the caller receives into scratch and combines)."""
        if peer in self._local:
            return self.shm.recv_reduce(tensor, peer, tag, combine)
        return None

    def recv_any(self, tensor: torch.Tensor, tag: int):
        """A receive from any rank of the group (``work._source_rank()`` says who)."""
        if self.shm is None:
            return self.group.recv_anysource([tensor], tag)
        if self.all_peers_local(dist.get_world_size(self.group)):
            return self.shm.recv(tensor, None, tag)
        raise RuntimeError("a receive from any rank cannot span shared memory and gloo (this group has ranks on "
                           "several hosts): receive from a named rank, or create the group's communicator with "
                           "CommConfig(transport='gloo')")

    def post(self, recvs, sends):
        """Grouped path: recvs/sends are lists of (tensor, peer, tag), posted as one
        ``batch_isend_irecv``; returns its works (they complete together)."""
        for tensor, _, _ in sends:
            self._count(tensor)
        ops = [dist.P2POp(dist.irecv, t, self.global_rank(peer), self.group, tag) for t, peer, tag in recvs]
        ops += [dist.P2POp(dist.isend, t, self.global_rank(peer), self.group, tag) for t, peer, tag in sends]
        return dist.batch_isend_irecv(ops)

    def global_rank(self, peer: int) -> int:
        if peer not in self._global:
            self._global[peer] = peer if self.group is dist.group.WORLD else dist.get_global_rank(self.group, peer)
        return self._global[peer]

    def describe(self, peer) -> str:
        """'3', or '3 (global rank 5)' when the group is not the world."""
        if not isinstance(peer, int) or self.group is dist.group.WORLD:
            return str(peer)
        try:
            return f"{peer} (global rank {self.global_rank(peer)})"
        except (RuntimeError, ValueError):
            return str(peer)


class _Polled:
    """A gloo work waited for while this rank keeps moving its shared-memory messages
    (a blocking gloo wait would stall them, and a peer on this host may need them
    before the remote message can come). gloo marks a point-to-point work complete
    only inside its own ``wait()``, so that wait runs on a helper thread while this
    one makes progress."""

    def __init__(self, work, shm):
        self.work, self.shm = work, shm

    def wait(self, timeout: timedelta | None = None) -> bool:
        finished = threading.Event()
        failure: list[BaseException] = []

        def wait_in_gloo():
            try:
                self.work.wait(timeout) if timeout is not None else self.work.wait()
            except BaseException as error:  # re-raised on the caller's thread
                failure.append(error)
            finally:
                finished.set()

        threading.Thread(target=wait_in_gloo, daemon=True, name="plait-gloo-wait").start()
        nap_s = 20e-6
        while not finished.is_set():
            if self.shm.progress():
                nap_s = 20e-6
                continue
            finished.wait(nap_s)
            nap_s = min(nap_s * 2, 1e-3)
        if failure:
            raise failure[0]
        return True

    def is_completed(self) -> bool:
        self.shm.progress()
        return self.work.is_completed()

    def _source_rank(self) -> int:
        return self.work._source_rank()


RING_FRAMES = 4  # whole segments a shared-memory ring holds at once (stream_segment_bytes)


def stream_segment_bytes(config, backend: str) -> int:
    """The segment size a call's large messages are split into under ``config`` (a
    CommConfig) on a group of ``backend``: ``segment_bytes``, at most ``shm_ring_bytes /
    RING_FRAMES`` (rounded down to 64 bytes) wherever shared memory may carry them (a
    gloo group whose ``transport`` is not "gloo", as the communicator sets it up). A frame larger than its ring streams through it half-duplex: the sender
    fills the ring and waits while the owner drains it, so neither rank overlaps its
    copies with the other's; with segments of a quarter ring, several whole frames are
    in flight and a segment (1 MiB with the 4 MiB default ring) stays in a core's
    2 MiB L2 between its copy in, its reduction and its copy out. Measured (p = 2 ring
    all-reduce, 16-64 MB, this host): 4 MiB segments 1.8-1.9 GB/s busbw, 1 MiB
    3.6-3.8 GB/s (/work/notes/h37/bandwidth/cfg_p2.txt). Depends only on the config,
    and the group's backend, which every rank of a group shares, so every rank splits
    alike (a rank whose peers are on other hosts, reached through gloo, too)."""
    segment_bytes = config.segment_bytes
    if config.transport == GLOO or GLOO not in str(backend).lower() or segment_bytes <= 0:
        return segment_bytes
    return min(segment_bytes, max(64, config.shm_ring_bytes // RING_FRAMES // 64 * 64))


def stages_through_host(group, device) -> bool:
    """True when a tensor on ``device`` must travel through host memory on ``group``:
    it lives on an accelerator and the group has no accelerator backend (gloo moves
    CPU memory only, so several ranks can share one GPU over gloo). Such a tensor is
    copied to a host buffer, the messages move the buffer, and the result is copied
    back: in place as far as the caller sees."""
    if torch.device(device).type == "cpu":
        return False
    return "nccl" not in str(dist.get_backend(group)).lower()


__all__ = ["RING_FRAMES", "Transport", "stages_through_host", "stream_segment_bytes"]
