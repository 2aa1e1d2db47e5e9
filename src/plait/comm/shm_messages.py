"""The records of the shared-memory transport's messages (``plait.comm.shm_transport``):
a posted send or receive as the caller sees it (``ShmWork``, shaped like torch's Work),
and the progress engine's own bookkeeping of each (a send being written, a receive
waiting for its frame, the frame being read, a message that came before its receive).
"""

from __future__ import annotations

from datetime import timedelta

import torch

from plait.comm.shm_ring import frame_bytes


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"shared-memory transport: tensors must be contiguous (got shape {tuple(tensor.shape)} with "
                         f"strides {tensor.stride()}); call .contiguous() first, as torch.distributed requires")
    if tensor.device.type != "cpu":
        raise ValueError(f"shared-memory transport moves host memory only, got a tensor on {tensor.device}")
    return tensor.reshape(-1).view(torch.uint8)


def refusal(recv: PendingRecv, payload_bytes: int) -> str | None:
    """Why ``recv`` cannot take a message of ``payload_bytes`` (the end of the error's
    sentence), or None: larger than the receive, or for a reducing receive not whole
    elements of its dtype."""
    if payload_bytes > recv.target.numel():
        kind = "reducing receive" if recv.combine is not None else "receive"
        return f"{kind} of {recv.target.numel()} bytes"
    if recv.combine is not None and payload_bytes % recv.reduced.element_size():
        return (f"reducing receive of {recv.target.numel()} bytes of {recv.reduced.dtype} (not whole "
                f"{recv.reduced.element_size()}-byte elements)")
    return None


class ShmWork:
    """A posted send or receive, shaped like torch's Work: ``wait(timeout)``,
    ``is_completed()``, ``_source_rank()`` (the sender of a receive)."""

    __slots__ = ("transport", "done", "error", "source", "description", "peer")

    def __init__(self, transport, peer, description: str):
        self.transport = transport
        self.done = False
        self.error: str | None = None
        self.source = peer
        self.peer = peer
        self.description = description

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.transport.wait(self, None if timeout is None else timeout.total_seconds())
        return True

    def is_completed(self) -> bool:
        if not self.done:
            self.transport.progress()
        return self.done

    def _source_rank(self) -> int:
        return self.source


class PendingSend:
    __slots__ = ("work", "source", "tag", "frame", "written")

    def __init__(self, work, source, tag):
        self.work, self.source, self.tag = work, source, tag
        self.frame = frame_bytes(source.numel())
        self.written = 0  # frame bytes written so far


class PendingRecv:
    """A posted receive; ``reduced``: the typed tensor a reducing receive combines into
    (``target`` is then its bytes), with ``combine`` (None: a plain receive)."""

    __slots__ = ("work", "target", "tag", "peer", "reduced", "combine")

    def __init__(self, work, target, tag, peer, reduced=None, combine=None):
        self.work, self.target, self.tag, self.peer = work, target, tag, peer
        self.reduced, self.combine = reduced, combine


class Inbound:
    """The frame being read from one peer's ring: where its payload goes (``target``
    bytes; for a reducing receive, ``recv.reduced`` is combined with it instead)."""

    __slots__ = ("target", "payload", "read", "recv", "unexpected")

    def __init__(self, target, payload, recv, unexpected):
        self.target, self.payload, self.recv, self.unexpected = target, payload, recv, unexpected
        self.read = 0  # payload bytes copied out


class Unexpected:
    __slots__ = ("tag", "buffer", "complete", "claimed")

    def __init__(self, tag, buffer):
        self.tag, self.buffer, self.complete, self.claimed = tag, buffer, False, None


__all__ = ["Inbound", "PendingRecv", "PendingSend", "ShmWork", "Unexpected", "as_bytes", "refusal"]
