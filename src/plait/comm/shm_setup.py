"""Setting up a group's shared-memory transport: who shares a host, the segments and
doorbells, and leaving nothing behind.

Run by every rank of a group when its communicator is created, over the group's
gloo messages, in three rounds through group rank 0 (which decides, so the ranks
can never disagree about who talks through shared memory):

1. every rank sends its host key (hostname, boot id, network and pid namespaces and
   the identity of the shared-memory directory: ranks in different network
   namespaces of one machine, as in plait's testbed, are different hosts) and whether the
   directory is usable and how much is free; rank 0 groups the ranks by key, picks
   a fresh random nonce and says which ranks use shared memory (a host of two or
   more whose directory has room for its segments) and why the others do not;
2. each such rank creates its segment (one ring per local peer) and its doorbell
   FIFO, named ``plait-shm-<nonce>-<rank>-p<pid>``, reserving the memory so a full
   directory fails here; rank 0 hears every outcome;
3. each maps its local peers' segments (checking magic and nonce, so a stale file is
   never read as live data) and opens their doorbells; rank 0 hears every outcome.

Every rank then unlinks its own files, whatever happened: the mappings keep the
memory alive and the kernel frees it when the last rank unmaps or dies, so a killed
rank leaves no segment behind. Files of crashed earlier runs (their pid gone) are
removed before creating. If any rank fails a round, the whole group stays on gloo
("auto", which says why) or fails naming the rank and reason ("shm").
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from plait.comm import tags
from plait.comm.shm_ring import Segment, ordering_is_safe, segment_bytes
from plait.comm.shm_transport import ShmTransport

PREFIX = "plait-shm-"
OK, NO_DIRECTORY, UNORDERED_MEMORY, TOO_SMALL, ALONE = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class ShmOutcome:
    """What the set-up decided for this rank: its transport (None: gloo for every
    peer) and a sentence for reports."""

    transport: ShmTransport | None
    description: str


def host_key(directory: str) -> str:
    """What ranks sharing memory have in common: the machine (hostname and boot id),
    the network and pid namespaces and the shared-memory directory itself."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            parts.append(boot.read().strip())
    except OSError:
        parts.append("-")
    for namespace in ("net", "pid"):  # a peer's liveness is checked by pid: same pid namespace only
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{namespace}").st_ino))
        except OSError:
            parts.append("-")
    try:
        info = os.stat(directory)
        parts.append(f"{info.st_dev}:{info.st_ino}")
    except OSError:
        parts.append("-")
    return "|".join(parts)


def _key_code(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 2


def _directory_state(directory: str) -> tuple[int, int]:
    """(reason code, free bytes) of the shared-memory directory on this rank."""
    if not ordering_is_safe():
        return UNORDERED_MEMORY, 0
    try:
        if not stat.S_ISDIR(os.stat(directory).st_mode) or not os.access(directory, os.W_OK):
            return NO_DIRECTORY, 0
        info = os.statvfs(directory)
    except OSError:
        return NO_DIRECTORY, 0
    return OK, info.f_bavail * info.f_frsize


def reclaim_stale(directory: str) -> list[str]:
    """Remove plait segment and doorbell files whose creating process is gone (a
    crashed run's); returns their paths."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX) or "-p" not in name:
            continue
        try:
            pid = int(name.rsplit("-p", 1)[1].split(".")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): maybe another run's live set-up
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:
            pass
    return removed


class _Rounds:
    """Gather-to-rank-0-and-reply rounds over the group's gloo messages."""

    def __init__(self, gloo, rank: int, size: int, timeout_s: float):
        self.gloo, self.rank, self.size = gloo, rank, size
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s

    def _wait(self, work, peer: int) -> None:
        remaining = max(self.deadline - time.monotonic(), 0.001)
        try:
            work.wait(timedelta(seconds=remaining))
        except RuntimeError as error:
            raise RuntimeError(f"setting up shared memory: rank {peer} did not answer within {self.timeout_s:g}s "
                               f"({str(error).strip().splitlines()[0] if str(error).strip() else 'timed out'})") \
                from error

    def run(self, row: list[int], reply_width: int, decide) -> list[int]:
        mine = torch.tensor(row, dtype=torch.int64)
        if self.rank != 0:
            reply = torch.zeros(reply_width, dtype=torch.int64)
            sent = self.gloo.send(mine, 0, tags.SHM_SETUP)
            received = self.gloo.recv(reply, 0, tags.SHM_SETUP_REPLY)
            self._wait(received, 0)
            self._wait(sent, 0)
            return reply.tolist()
        rows = [row]
        for peer in range(1, self.size):
            buffer = torch.zeros(len(row), dtype=torch.int64)
            self._wait(self.gloo.recv(buffer, peer, tags.SHM_SETUP), peer)
            rows.append(buffer.tolist())
        reply = torch.tensor(decide(rows), dtype=torch.int64)
        assert reply.numel() == reply_width
        sends = [self.gloo.send(reply, peer, tags.SHM_SETUP_REPLY) for peer in range(1, self.size)]
        for peer, work in enumerate(sends, start=1):
            self._wait(work, peer)
        return reply.tolist()


def _decide_hosts(rows, ring_bytes: int) -> list[int]:
    """Rank 0's answer to round 1: [nonce, need bytes, then per rank its host (-1: no
    shared memory) and its reason code]."""
    size = len(rows)
    by_key: dict[int, list[int]] = {}
    for rank, (key, _, _) in enumerate(rows):
        by_key.setdefault(key, []).append(rank)
    hosts = [-1] * size
    reasons = [ALONE] * size
    need_most = 0
    for index, members in enumerate(by_key.values()):
        if len(members) < 2:
            continue
        need = len(members) * segment_bytes(len(members) - 1, ring_bytes)
        need_most = max(need_most, need)
        codes = {rows[rank][1] for rank in members}
        code = max(codes)
        if code == OK and min(rows[rank][2] for rank in members) < need:
            code = TOO_SMALL
        for rank in members:
            reasons[rank] = code
            hosts[rank] = index if code == OK else -1
    return [secrets.randbits(62), need_most] + hosts + reasons


def _reason(code: int, directory: str, need: int, free: int) -> str:
    return {
        NO_DIRECTORY: f"{directory} is missing or not writable",
        UNORDERED_MEMORY: "this machine's memory order is not x86's (the rings need total store order)",
        TOO_SMALL: (f"{directory} has {free} bytes free but the host's segments need {need} bytes (lower "
                    "CommConfig.shm_ring_bytes or free space in it)"),
        ALONE: "no other rank of the group is on this host",
    }[code]


def establish(gloo, rank: int, size: int, *, directory: str, ring_bytes: int, spin_s: float, required: bool,
              timeout_s: float, spin_max_s: float = 0.0) -> ShmOutcome:
    """Set up this rank's shared-memory transport with the group's other ranks (all
    of them call this together); see the module docstring."""
    rounds = _Rounds(gloo, rank, size, timeout_s)
    code, free = _directory_state(directory)
    answer = rounds.run([_key_code(host_key(directory)), code, free], 2 + 2 * size,
                        lambda rows: _decide_hosts(rows, ring_bytes))
    nonce, need = answer[0], answer[1]
    hosts, reasons = answer[2 : 2 + size], answer[2 + size :]
    local = [peer for peer in range(size) if hosts[rank] >= 0 and hosts[peer] == hosts[rank]]
    refused = {peer: reasons[peer] for peer in range(size) if reasons[peer] not in (OK, ALONE)}
    if refused and required:
        peer, why = next(iter(refused.items()))
        raise ValueError(f"CommConfig(transport='shm'): rank {peer} cannot use shared memory: "
                         f"{_reason(why, directory, need, free)}. Fix that, or use transport='auto' (shared memory "
                         "where it works, gloo elsewhere) or 'gloo'")
    participating = any(host >= 0 for host in hosts)
    if not participating:
        why = reasons[rank] if reasons[rank] != OK else ALONE
        return ShmOutcome(None, f"gloo (no shared memory: {_reason(why, directory, need, free)})")
    created: list[str] = []
    segment = bell = None
    opened: dict[int, Segment] = {}
    bells: dict[int, int] = {}
    failure = None
    others = [peer for peer in local if peer != rank]
    try:
        if local:
            reclaim_stale(directory)
            try:
                segment, bell = create_own(directory, nonce, rank, len(others), ring_bytes, created)
            except OSError as error:
                failure = f"rank {rank} could not create its segment in {directory}: {error.strerror or error}"
        status = _round_status(rounds, failure, size)
        if status is None and local:
            try:
                attach_peers(directory, nonce, others, opened, bells)
            except (OSError, ValueError) as error:
                failure = (f"rank {rank} could not open the segment of a rank it shares a host with "
                           f"({error}): do they see the same {directory}?")
        status = status or _round_status(rounds, failure, size)
    finally:
        for path in created:
            try:
                os.unlink(path)
            except OSError:
                pass
    if status is not None:
        for mapped in [segment, *opened.values()]:
            if mapped is not None:
                mapped.close()
        for fd in [bell, *bells.values()]:
            if fd is not None:
                os.close(fd)
        if required:
            raise ValueError(f"CommConfig(transport='shm'): {status}")
        return ShmOutcome(None, f"gloo (shared memory failed: {status})")
    if not local:
        return ShmOutcome(None, f"gloo (no shared memory: {_reason(ALONE, directory, need, free)})")
    transport = connect(rank, local, segment, opened, bell, bells, spin_s, spin_max_s)
    return ShmOutcome(transport, f"shm with group ranks {local} ({ring_bytes} B rings)")


def _path(directory: str, nonce: int, rank: int, pid: int) -> str:
    return os.path.join(directory, f"{PREFIX}{nonce:016x}-{rank}-p{pid}")


def create_own(directory: str, nonce: int, rank: int, rings: int, ring_bytes: int,
               created: list[str]) -> tuple[Segment, int]:
    """Create this rank's segment and doorbell FIFO (their paths appended to
    ``created``, for the caller to unlink); returns (segment, doorbell read fd)."""
    path = _path(directory, nonce, rank, os.getpid())
    segment = Segment.create(path, nonce, rings, ring_bytes)
    created.append(path)
    try:
        os.mkfifo(path + ".bell", 0o600)
        created.append(path + ".bell")
        return segment, os.open(path + ".bell", os.O_RDWR | os.O_NONBLOCK)
    except BaseException:
        segment.close()
        raise


def attach_peers(directory: str, nonce: int, peers: list[int], opened: dict, bells: dict) -> None:
    """Map each peer's segment into ``opened`` and open its doorbell into ``bells``."""
    pids = _pids_of(directory, nonce, peers)
    for peer in peers:
        path = _path(directory, nonce, peer, pids[peer])
        opened[peer] = Segment.attach(path, nonce)
        bells[peer] = os.open(path + ".bell", os.O_WRONLY | os.O_NONBLOCK)


def connect(rank: int, local: list[int], segment: Segment, opened: dict, bell: int, bells: dict,
            spin_s: float, spin_max_s: float = 0.0) -> ShmTransport:
    """The transport of ``rank`` among the ranks ``local`` (sorted; rings are ordered
    by the other ranks' order in it). ``spin_s``/``spin_max_s``: its waits' polling
    (ShmTransport._spin_budget_s); with more local ranks than cores ``spin_s`` is 0 and
    a wait yields its core between polls for up to ``spin_max_s`` instead."""
    others = [peer for peer in local if peer != rank]
    ring_index = {peer: others.index(peer) for peer in others}
    their_index = {peer: [other for other in local if other != peer].index(rank) for peer in others}
    # polling only pays while every local rank can have a core: with more ranks than
    # cores a polling rank holds the core its peer needs to send what it waits for
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    polls = len(local) <= cores
    return ShmTransport(rank, segment, opened, ring_index, their_index, bell, bells, spin_s if polls else 0.0,
                        spin_max_s)


def _round_status(rounds: _Rounds, failure: str | None, size: int) -> str | None:
    """One round: every rank says whether its step worked (1 or 0); rank 0 answers
    the first failing rank. The failure's text travels as that rank's code: a rank
    only knows its own text, so the others get a generic sentence naming it."""
    answer = rounds.run([0 if failure is None else 1], 2,
                        lambda rows: next(([1, rank] for rank, row in enumerate(rows) if row[0]), [0, -1]))
    if answer[0] == 0:
        return None
    if failure is not None:
        return failure
    return f"rank {answer[1]} could not set up its shared memory (its own error says why)"


def _pids_of(directory: str, nonce: int, peers: list[int]) -> dict[int, int]:
    """The pid in each peer's file name (from the directory listing)."""
    prefix = f"{PREFIX}{nonce:016x}-"
    pids = {}
    for name in os.listdir(directory):
        if name.startswith(prefix) and not name.endswith(".bell"):
            rank_text, pid_text = name[len(prefix):].split("-p")
            pids[int(rank_text)] = int(pid_text)
    missing = [peer for peer in peers if peer not in pids]
    if missing:
        raise ValueError(f"no segment of ranks {missing} in {directory}")
    return pids


__all__ = ["ShmOutcome", "attach_peers", "connect", "create_own", "establish", "host_key", "reclaim_stale"]
