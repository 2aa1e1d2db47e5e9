"""Point-to-point messages with torch.distributed's semantics and plait's deadline:
``send``, ``recv`` (also from any source), ``isend``, ``irecv`` and
``batch_isend_irecv`` with ``P2POp``.

As in torch, ``dst``/``src`` are global ranks and ``group_dst``/``group_src`` ranks
within ``group`` (give one of them); ``recv`` returns the sender's global rank.
Each wait is bounded by the call's ``timeout_s`` (default: the ``CommConfig.timeout_s``
of the Communicator given, or of the group's communicator, or of the program's stated
config when it has none yet: ``plait.comm.communicator``) and a failure raises :class:`CommError` /
:class:`CommTimeoutError` naming this rank, the message's label and the peer, so a
dead peer never leaves a rank hanging. These run on the calling thread, not on the
group's comm thread: p2p and collectives on one group must use different tags
(``plait.comm.tags``).

``group=`` a process group sends through gloo's own messages; ``group=`` a
:class:`~plait.comm.communicator.Communicator` sends through its transport: shared
memory to the ranks on this host when it set that up, gloo to the others. Every
rank of a pair must pass the same kind (the two do not meet).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.comm.communicator import REGISTRY, Communicator, communicator_for, group_ranks, process_group
from plait.comm.errors import CommError, CommTimeoutError
from plait.comm.layout import check_tensor
from plait.comm.transport import stages_through_host

def link_for(group=None):
    """What to pass as ``group=`` to the p2p calls of a protocol on ``group``: its
    Communicator when every other rank is reached through shared memory (messages
    then go through it), else the process group itself (gloo's messages; a receive
    from any rank works there across hosts). Every rank of the group must call it
    (it may create the group's communicator) and all get the same kind."""
    communicator = communicator_for(group)
    if communicator is None:
        return group
    communicator.created.wait()
    return communicator if communicator.transport.all_peers_local(communicator.size) else communicator.group


def _transport_of(group):
    """The transport of ``group`` when it is a plait Communicator (its creation
    finished), else None (gloo's own messages)."""
    if isinstance(group, Communicator):
        group.created.wait()
        return group.transport
    return None


def _group_rank(group) -> tuple[object, int]:
    group = process_group(group)  # checked; a Communicator's or a 1-D DeviceMesh's process group
    group = dist.group.WORLD if group is None else group
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("plait.comm point-to-point needs torch.distributed.init_process_group(...) first")
    return group, dist.get_rank(group)


def _check_tag(tag, label: str) -> None:
    """A tag is a non-negative int32, as gloo takes it (it refused others only once the
    message was posted, as a CommError)."""
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"{label}: tag must be an int, got {type(tag).__name__} ({tag!r:.40})")
    if not 0 <= tag < 2**31:
        raise ValueError(f"{label}: tag={tag} must be in 0 .. 2**31 - 1 (a non-negative int32)")


def _timeout_s(given, group, timeout_s) -> float:
    """The call's deadline: ``timeout_s``, else the config of the communicator the call
    was given (``given``), else the process group's communicator's, or the stated
    config it would be created with (a point-to-point call creates none)."""
    if timeout_s is not None:
        return timeout_s
    if isinstance(given, Communicator):
        return given.config.timeout_s
    return REGISTRY.stated_config(group).timeout_s


def _peer(group, rank: int, global_peer, group_peer, name: str, *, allow_none: bool = False) -> int | None:
    """The group rank of a message's peer, from torch's global ``dst``/``src`` or the
    group rank ``group_dst``/``group_src``."""
    if global_peer is not None and group_peer is not None:
        raise ValueError(f"{name}={global_peer} and group_{name}={group_peer} both given: pass the global rank as "
                         f"{name} or the group rank as group_{name}, not both")
    if global_peer is None and group_peer is None:
        if allow_none:
            return None
        raise ValueError(f"give the peer: {name}= (a global rank) or group_{name}= (a rank of the group)")
    ranks = group_ranks(group)
    if group_peer is not None:
        if isinstance(group_peer, bool) or not isinstance(group_peer, int) or not 0 <= group_peer < len(ranks):
            raise ValueError(f"group_{name}={group_peer!r} is not a rank of this group of {len(ranks)} ranks "
                             f"(0..{len(ranks) - 1}; its global ranks are {ranks})")
        peer = group_peer
    else:
        if isinstance(global_peer, bool) or not isinstance(global_peer, int):
            raise TypeError(f"{name} must be an int global rank, got {type(global_peer).__name__}")
        if global_peer not in ranks:
            raise ValueError(f"{name}={global_peer} (a global rank) is not a member of this group (global ranks "
                             f"{ranks}); pass one of them, or a rank within the group as group_{name}=")
        peer = ranks.index(global_peer)
    if peer == rank:
        raise ValueError(f"{name}: this rank (group rank {rank}) cannot send to or receive from itself")
    return peer


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
    peer's rank within the group (the sender's, for a receive from any rank);
    ``is_completed()`` polls; ``global_peer()`` is the peer's global rank."""

    work: object
    group: object
    rank: int
    peer: int | None
    label: str
    timeout_s: float
    start_s: float
    host: torch.Tensor | None = None  # the host copy a GPU tensor travels as over gloo
    into: torch.Tensor | None = None  # a staged receive's destination, filled by wait()

    def wait(self) -> int:
        remaining = max(self.timeout_s - (time.monotonic() - self.start_s), 0.001)
        try:
            self.work.wait(timedelta(seconds=remaining))
        except RuntimeError as error:
            raise _error(error, self.rank, self.label, _describe(self.group, self.peer), self.timeout_s) from error
        if self.into is not None:
            self.into.copy_(self.host.view_as(self.into))
            self.into = None
        if self.peer is not None:
            return self.peer
        self.peer = self.work._source_rank()  # the process group's own (group-local) rank
        return self.peer

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def global_peer(self) -> int | None:
        return None if self.peer is None else _global(self.group, self.peer)


def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None, *,
          label: str = "send", timeout_s: float | None = None) -> Message:
    """Post ``tensor`` to global rank ``dst`` (or group rank ``group_dst``); ``wait()``
    the returned message before changing the tensor."""
    check_tensor(tensor, "tensor", label)
    _check_tag(tag, label)
    given, transport = group, _transport_of(group)
    group, rank = _group_rank(group)
    peer = _peer(group, rank, dst, group_dst, "dst")
    timeout_s = _timeout_s(given, group, timeout_s)
    host = tensor.detach().contiguous().cpu() if stages_through_host(group, tensor.device) else None
    try:
        if transport is not None:
            work = transport.send(tensor if host is None else host, peer, tag)
        else:
            work = group.send([tensor if host is None else host], peer, tag)
    except RuntimeError as error:
        raise _error(error, rank, label, _describe(group, peer), timeout_s) from error
    return Message(work, group, rank, peer, label, timeout_s, time.monotonic(), host=host)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None, *,
          label: str = "recv", timeout_s: float | None = None) -> Message:
    """Post a receive into ``tensor`` from global rank ``src`` (or group rank
    ``group_src``; neither: from any rank of the group, ``wait()`` returns who sent it).
    A GPU tensor on a gloo group is received into a host buffer and copied into
    ``tensor`` by ``wait()``."""
    check_tensor(tensor, "tensor", label)
    _check_tag(tag, label)
    given, transport = group, _transport_of(group)
    group, rank = _group_rank(group)
    peer = _peer(group, rank, src, group_src, "src", allow_none=True)
    timeout_s = _timeout_s(given, group, timeout_s)
    host = torch.empty(tensor.shape, dtype=tensor.dtype) if stages_through_host(group, tensor.device) else None
    target = tensor if host is None else host
    try:
        if transport is not None:
            work = transport.recv_any(target, tag) if peer is None else transport.recv(target, peer, tag)
        elif peer is None:
            work = group.recv_anysource([target], tag)
        else:
            work = group.recv([target], peer, tag)
    except RuntimeError as error:
        raise _error(error, rank, label, _describe(group, peer), timeout_s) from error
    return Message(work, group, rank, peer, label, timeout_s, time.monotonic(), host=host,
                   into=None if host is None else tensor)


def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None, *,
         label: str = "send", timeout_s: float | None = None) -> None:
    """Blocking :func:`isend`."""
    isend(tensor, dst, group, tag, group_dst, label=label, timeout_s=timeout_s).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None, *,
         label: str = "recv", timeout_s: float | None = None) -> int:
    """Blocking :func:`irecv`; returns the sender's global rank, as torch does."""
    message = irecv(tensor, src, group, tag, group_src, label=label, timeout_s=timeout_s)
    message.wait()
    return message.global_peer()


@dataclass(frozen=True)
class P2POp:
    """One message of :func:`batch_isend_irecv`: ``op`` is plait.comm.isend / irecv (or
    torch.distributed's), ``peer`` a global rank or ``group_peer`` a group rank."""

    op: object
    tensor: torch.Tensor
    peer: int | None = None
    group: object = None
    tag: int = 0
    group_peer: int | None = None


def batch_isend_irecv(p2p_op_list) -> list[Message]:
    """Post every op of ``p2p_op_list`` at once and return their messages (wait for
    each). All are posted before any is waited for, so pairs that send to each other
    in one batch cannot deadlock."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("batch_isend_irecv takes a non-empty list of P2POp")
    posts = []
    for op in p2p_op_list:
        if not isinstance(op, (P2POp, dist.P2POp)):
            raise TypeError(f"batch_isend_irecv takes P2POp items, got {type(op).__name__}")
        sending = op.op in (isend, dist.isend)
        if not sending and op.op not in (irecv, dist.irecv):
            raise ValueError(f"P2POp.op must be isend or irecv, got {op.op!r}")
        group_peer = getattr(op, "group_peer", None)
        if sending:
            posts.append(isend(op.tensor, op.peer, op.group, op.tag, group_peer, label="batch_isend_irecv send"))
        else:
            posts.append(irecv(op.tensor, op.peer if op.peer is not None or group_peer is not None else None,
                               op.group, op.tag, group_peer, label="batch_isend_irecv recv"))
    return posts


__all__ = ["Message", "P2POp", "batch_isend_irecv", "irecv", "isend", "link_for", "recv", "send"]
