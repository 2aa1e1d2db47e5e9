"""Point-to-point messages with plait's deadline: ``send``, ``recv`` (also from any
source), and their non-blocking forms.

For protocols that are not collectives (the parameter server's pushes and pulls).
Each wait is bounded by ``CONFIG.timeout_s`` (or the call's ``timeout_s``) and a
failure raises :class:`CommError` / :class:`CommTimeoutError` naming this rank, the
message's label and the peer, so a dead peer never leaves a rank hanging. Peers are
group-local ranks, as in the collectives. These run on the calling thread, not the
comm engine's queue: do not interleave them with async collectives on the same
peers unless both sides do so in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.comm.engine import CONFIG
from plait.comm.errors import CommError, CommTimeoutError


def _group_rank(group) -> tuple[object, int]:
    group = dist.group.WORLD if group is None else group
    return group, dist.get_rank(group)


def _global(group, peer: int) -> int:
    return peer if group is dist.group.WORLD else dist.get_global_rank(group, peer)


def _describe(group, peer) -> str:
    if peer is None:
        return "any"
    if group is dist.group.WORLD:
        return str(peer)
    return f"{peer} (global rank {_global(group, peer)})"


def _error(error: BaseException, rank: int, label: str, peer: str, timeout_s: float) -> CommError:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    kwargs = dict(rank=rank, collective=label, algorithm="p2p", step="-", peer=peer, reason=reason)
    if "timed out" in reason.lower() or "timeout" in reason.lower():
        return CommTimeoutError(timeout_s=timeout_s, **kwargs)
    return CommError(**kwargs)


@dataclass
class Message:
    """A posted send or receive; ``wait()`` blocks with the deadline and returns the
    sender's group rank (receives) or the destination (sends)."""

    work: object
    group: object
    rank: int
    peer: int | None
    label: str
    timeout_s: float
    start_s: float

    def wait(self) -> int:
        remaining = max(self.timeout_s - (time.monotonic() - self.start_s), 0.001)
        try:
            self.work.wait(timedelta(seconds=remaining))
        except RuntimeError as error:
            raise _error(error, self.rank, self.label, _describe(self.group, self.peer), self.timeout_s) from error
        if self.peer is not None:
            return self.peer
        return self.work._source_rank()  # the process group's own (group-local) rank


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *, label: str = "send",
          timeout_s: float | None = None) -> Message:
    """Post ``tensor`` to group rank ``dst``; ``wait()`` the returned message before
    changing the tensor."""
    group, rank = _group_rank(group)
    timeout_s = CONFIG.timeout_s if timeout_s is None else timeout_s
    try:
        work = group.send([tensor], dst, tag)
    except RuntimeError as error:
        raise _error(error, rank, label, _describe(group, dst), timeout_s) from error
    return Message(work, group, rank, dst, label, timeout_s, time.monotonic())


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, *, label: str = "recv",
          timeout_s: float | None = None) -> Message:
    """Post a receive into ``tensor`` from group rank ``src`` (None: from any rank of
    the group; ``wait()`` returns who sent it)."""
    group, rank = _group_rank(group)
    timeout_s = CONFIG.timeout_s if timeout_s is None else timeout_s
    try:
        if src is None:
            work = group.recv_anysource([tensor], tag)
        else:
            work = group.recv([tensor], src, tag)
    except RuntimeError as error:
        raise _error(error, rank, label, _describe(group, src), timeout_s) from error
    return Message(work, group, rank, src, label, timeout_s, time.monotonic())


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *, label: str = "send",
         timeout_s: float | None = None) -> None:
    """Blocking :func:`isend`."""
    isend(tensor, dst, group, tag, label=label, timeout_s=timeout_s).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, *, label: str = "recv",
         timeout_s: float | None = None) -> int:
    """Blocking :func:`irecv`; returns the sender's group rank."""
    return irecv(tensor, src, group, tag, label=label, timeout_s=timeout_s).wait()
