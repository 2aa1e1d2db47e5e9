"""How one process group's messages travel: ``Transport.send`` / ``recv`` (one message
each, gloo), ``Transport.post`` (one grouped step, NCCL), and the bytes that really
left this rank, counted where they are handed to torch.distributed.

Peers are group-local ranks (the executors work in schedule ranks);
``global_rank`` maps them for error messages and grouped posts.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist


class Transport:
    """Posts point-to-point messages on one process group.

    CPU tensors go one message at a time through the group's own ``send``/``recv``
    (gloo; the least Python per message, and each message can be waited for on its
    own). Tensors on an accelerator go through ``batch_isend_irecv``, which NCCL
    runs as one group per step, so a pair that sends and receives in one step
    cannot deadlock; that path is ``grouped``: its works complete together.

    ``bytes_sent`` / ``messages_sent`` count what was handed to torch.distributed on
    this group (headers included): a measurement independent of the schedules.
    """

    def __init__(self, group):
        self.group = group
        self._global: dict[int, int] = {}
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.messages_sent = 0
        self._detached: list = []  # (work, tensor) of sends nobody waits for: a dropped gloo work is cancelled

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
        return self.group.send([tensor], peer, tag)

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
        self.group = None

    def recv(self, tensor: torch.Tensor, peer: int, tag: int):
        """Post a receive into ``tensor`` from group rank ``peer``; returns torch's work."""
        return self.group.recv([tensor], peer, tag)

    def recv_any(self, tensor: torch.Tensor, tag: int):
        """A receive from any rank of the group (``work._source_rank()`` says who)."""
        return self.group.recv_anysource([tensor], tag)

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


def stages_through_host(group, device) -> bool:
    """True when a tensor on ``device`` must travel through host memory on ``group``:
    it lives on an accelerator and the group has no accelerator backend (gloo moves
    CPU memory only, so several ranks can share one GPU over gloo). Such a tensor is
    copied to a host buffer, the messages move the buffer, and the result is copied
    back: in place as far as the caller sees."""
    if torch.device(device).type == "cpu":
        return False
    return "nccl" not in str(dist.get_backend(group)).lower()


__all__ = ["Transport", "stages_through_host"]
