"""Point-to-point messages between ranks on one host through shared memory: the
progress engine over the rings of :mod:`plait.comm.shm_ring`.

Semantics are torch's (gloo's) for ``send``/``recv``/``recv_any``: a receive is
matched by (peer, tag), messages between a pair with the same tag match in the
order sent, a receive may be larger than its message (a smaller message fills its
front), and a send completes once its bytes are in the peer's ring (its tensor may
then be reused). Sends to a peer leave in the order posted; a message whose receive
is not posted yet waits in the ring (as gloo's waits for its receive), unless the
owner is waiting for a later message from the same peer: then it is copied out to
make way (an "unexpected" message, matched when its receive is posted). A reducing
receive (``recv_reduce``) combines its message into the target straight from the
ring as the bytes arrive, whole elements at a time, instead of copying them out.

Progress is made by whoever waits: ``wait`` on any work moves every pending send
and receive of this rank (as an MPI progress engine does), so a rank blocked on one
message still drains and fills its rings for the others, and no thread of its own
competes with the ranks for the cores.

Waiting: poll the rings for up to ``spin_max_s`` while recent long polls ended their
waits (``_spin_budget_s``: a peer's per-call time is polled through instead of paying a
block and a wake-up each call), else ``spin_s``. Polling makes no syscall while
every local rank has a core; with more local ranks than cores a waiting rank calls
``sched_yield`` between polls (the core goes to a peer it may wait for), until one
yield is away over ``_YIELD_STALL_S``: another process took the core for a scheduler
slice (about 5 ms on this machine under load, measured), and the rank then blocks at
once for ``_YIELD_OFF_S``. After the poll it sets this rank's ``sleeping`` word and
blocks on its doorbell FIFO, at most ``_NAP_S`` at a time; a peer that moves bytes this rank
waits for rings the bell when the word is set. The cap bounds the cost of the one
race plain loads and stores allow (the word set just as the peer checked it). While
blocked, the peers involved are checked: a peer whose process died or whose
transport closed fails the wait naming it; otherwise the wait's deadline does.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections import deque

import torch

from plait.comm.shm_ring import FRAME_HEADER_BYTES, Ring, Segment, frame_bytes
from plait.comm.shm_messages import Inbound, PendingRecv, PendingSend, ShmWork, Unexpected, as_bytes, refusal

_NAP_S = 0.001  # longest single block on the doorbell (bounds a missed wake-up)
_LIVENESS_S = 0.2  # how often a blocked rank checks that its peers' processes live
_PROBE_EVERY = 8  # a rank whose polls stopped paying still polls every this many waits (_spin_budget_s)
_HIT_WEIGHT = 0.25  # weight of one polled wait in the poll's hit rate (_note_wait)
_YIELD_STALL_S = 0.001  # a sched_yield away this long: another process held the core (stop yielding)
_YIELD_OFF_S = 0.5  # how long a rank that saw such a stall blocks instead of yielding


class ShmTransport:
    """This rank's messages to and from the group ranks in ``peers`` (same host).

    ``inbox``: this rank's segment; ``outboxes[peer]``: the peer's segment;
    ``ring_index[peer]``: the ring of ``peer`` in this rank's inbox, and
    ``their_index[peer]``: this rank's ring in the peer's; ``bell``: this rank's
    doorbell (read end), ``bells[peer]``: the peers' (write ends)."""

    def __init__(self, rank: int, inbox: Segment, outboxes: dict[int, Segment], ring_index: dict[int, int],
                 their_index: dict[int, int], bell: int, bells: dict[int, int], spin_s: float,
                 spin_max_s: float = 0.0):
        self.rank = rank
        self.peers = sorted(outboxes)
        self.inbox = inbox
        self.outboxes = outboxes
        self.inbound: dict[int, Ring] = {peer: inbox.ring(ring_index[peer]) for peer in self.peers}
        self.outbound: dict[int, Ring] = {peer: outboxes[peer].ring(their_index[peer]) for peer in self.peers}
        self.bell = bell
        self.bells = bells
        self.spin_s = spin_s
        self.spin_max_s = max(spin_max_s, spin_s)  # the adaptive poll's cap (_spin_budget_s)
        self._poll_hit = 1.0  # recent long polls that ended the wait without a block, averaged (_note_wait)
        self._waits = 0  # waits that polled (_spin_budget_s)
        self._yield_off_until = 0.0  # time.monotonic() before which a rank with spin_s = 0 does not yield
        self._lock = threading.RLock()
        self._sends: dict[int, deque[PendingSend]] = {peer: deque() for peer in self.peers}
        self._recvs: dict[int, deque[PendingRecv]] = {peer: deque() for peer in self.peers}
        self._any: deque[PendingRecv] = deque()
        self._unexpected: dict[int, deque[Unexpected]] = {peer: deque() for peer in self.peers}
        self._reading: dict[int, Inbound | None] = {peer: None for peer in self.peers}
        self._wanting = {peer: False for peer in self.peers}  # what this rank last said in outbound[peer]
        self._pids = {peer: outboxes[peer].owner_pid for peer in self.peers}
        self._closed = False
        self.payload_bytes_written = 0  # counted as bytes are copied into the rings
        self.payload_bytes_reduced = 0  # counted as received bytes are reduced straight from the rings
        self._poller = select.poll()
        self._poller.register(bell, select.POLLIN)
        self._nap_lock = threading.Lock()
        self._nap_done = threading.Condition(self._nap_lock)
        self._napping = False  # a thread of this rank is blocked on the doorbell
        self.naps = 0  # blocks on the doorbell
        self.naps_timed_out = 0  # of those, ended by the cap with no bell rung

    # ----- posting ----------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> ShmWork:
        source = as_bytes(tensor)
        work = ShmWork(self, peer, f"a send of {source.numel()} bytes to rank {peer} (tag {tag})")
        with self._lock:
            self._check_open()
            self._sends[peer].append(PendingSend(work, source, tag))
            self._progress_locked()
        return work

    def recv(self, tensor: torch.Tensor, peer: int | None, tag: int) -> ShmWork:
        """Receive into ``tensor`` from ``peer`` (None: any local peer)."""
        target = as_bytes(tensor)
        who = "any rank" if peer is None else f"rank {peer}"
        work = ShmWork(self, peer, f"a receive of up to {target.numel()} bytes from {who} (tag {tag})")
        return self._post_recv(PendingRecv(work, target, tag, peer))

    def recv_reduce(self, tensor: torch.Tensor, peer: int, tag: int, combine) -> ShmWork:
        """Receive a message from ``peer`` and reduce it into ``tensor`` straight from the
        ring: ``combine(tensor[piece], message[piece])`` (``plait.comm.ops.COMBINE``'s
        operand order) as its bytes arrive, whole elements at a time, with no copy out
        and no scratch (one pass less per byte than receiving into scratch and
        combining). ``tensor``'s region must not be read or written by anything else
        until the work completes (the executor's dataflow rules hold it). A message
        smaller than ``tensor`` combines into its front; one that is larger, or not whole
        elements, fails the work naming both sizes."""
        target = as_bytes(tensor)
        work = ShmWork(self, peer, f"a reducing receive of up to {target.numel()} bytes from rank {peer} (tag {tag})")
        return self._post_recv(PendingRecv(work, target, tag, peer, tensor.reshape(-1), combine))

    def _post_recv(self, recv: PendingRecv) -> ShmWork:
        with self._lock:
            self._check_open()
            if not self._claim_unexpected(recv):
                (self._any if recv.peer is None else self._recvs[recv.peer]).append(recv)
            self._progress_locked()
        return recv.work

    def _claim_unexpected(self, recv: PendingRecv) -> bool:
        for peer in self.peers if recv.peer is None else [recv.peer]:
            for held in self._unexpected[peer]:
                if held.tag == recv.tag and held.claimed is None:
                    held.claimed = recv
                    recv.work.source = peer
                    if held.complete:
                        self._deliver_unexpected(peer, held)
                    return True
        return False

    def _deliver_unexpected(self, peer: int, held: Unexpected) -> None:
        recv = held.claimed
        self._unexpected[peer].remove(held)
        self._fill(recv, held.buffer)

    def _fill(self, recv: PendingRecv, payload: torch.Tensor) -> None:
        reason = refusal(recv, payload.numel())
        if reason is not None:
            self._fail(recv.work, f"rank {recv.work.source} sent {payload.numel()} bytes (tag {recv.tag}) into a "
                                  f"{reason}")
            return
        if recv.combine is not None:
            element_bytes = recv.reduced.element_size()
            recv.combine(recv.reduced[: payload.numel() // element_bytes], payload.view(recv.reduced.dtype))
        else:
            recv.target[: payload.numel()].copy_(payload)
        recv.work.done = True

    @staticmethod
    def _fail(work: ShmWork, reason: str) -> None:
        work.error = reason
        work.done = True

    # ----- progress ---------------------------------------------------------------------
    def progress(self) -> bool:
        with self._lock:
            return self._progress_locked()

    def _progress_locked(self) -> bool:
        if self._closed:
            return False
        moved = False
        for peer in self.peers:
            if self._sends[peer] and self._write(peer):
                moved = True
            if self._read(peer):
                moved = True
        return moved

    def _write(self, peer: int) -> bool:
        """Write as much of the queued frames to ``peer`` as its ring has room for."""
        ring = self.outbound[peer]
        queue = self._sends[peer]
        tail = ring.tail()
        room = ring.capacity - (tail - ring.head())
        start_tail = tail
        while queue and room > 0:
            send = queue[0]
            if send.written == 0:
                if room < FRAME_HEADER_BYTES:
                    break
                ring.write_header(tail, send.tag, send.source.numel())
                tail += FRAME_HEADER_BYTES
                room -= FRAME_HEADER_BYTES
                send.written = FRAME_HEADER_BYTES
            payload_done = send.written - FRAME_HEADER_BYTES
            payload_left = send.source.numel() - payload_done
            count = min(room, payload_left)
            if count > 0:
                ring.copy_in(tail, send.source[payload_done : payload_done + count])
                self.payload_bytes_written += count
                tail += count
                room -= count
                send.written += count
            if send.written - FRAME_HEADER_BYTES == send.source.numel():
                pad = send.frame - send.written
                if pad > room:
                    break
                tail += pad
                room -= pad
                send.written = send.frame
                queue.popleft()
                send.work.done = True
                send.source = None
        if bool(queue) != self._wanting[peer]:  # tell the owner whether to ring when it frees room
            self._wanting[peer] = bool(queue)
            ring.set_room_wanted(bool(queue))
        if tail == start_tail:
            return False
        ring.set_tail(tail)
        self._ring(peer)
        return True

    def _read(self, peer: int) -> bool:
        """Copy out what ``peer`` has written, frame by frame, into the matching receives."""
        ring = self.inbound[peer]
        head = ring.head()
        available = ring.tail() - head
        start_head = head
        while available > 0:
            inbound = self._reading[peer]
            if inbound is None:
                if available < FRAME_HEADER_BYTES:
                    break
                tag, payload = ring.read_header(head)
                inbound = self._match(peer, tag, payload)
                if inbound is None:
                    break  # its receive is not posted: it waits in the ring
                head += FRAME_HEADER_BYTES
                available -= FRAME_HEADER_BYTES
                self._reading[peer] = inbound
            count = min(available, inbound.payload - inbound.read)
            reducing = inbound.recv is not None and inbound.recv.combine is not None and inbound.target is not None
            if reducing:  # whole elements only (the rest follows: the sender still has room to write it)
                element_bytes = inbound.recv.reduced.element_size()
                count -= count % element_bytes
            if count > 0:
                if reducing:
                    first = inbound.read // element_bytes
                    ring.reduce_out(head, inbound.recv.reduced[first : first + count // element_bytes],
                                    inbound.recv.combine)
                    self.payload_bytes_reduced += count
                elif inbound.target is not None:
                    ring.copy_out(head, inbound.target[inbound.read : inbound.read + count])
                inbound.read += count
                head += count
                available -= count
            if inbound.read < inbound.payload:
                break
            pad = frame_bytes(inbound.payload) - FRAME_HEADER_BYTES - inbound.payload
            if pad > available:
                break
            head += pad
            available -= pad
            self._reading[peer] = None
            self._finish(peer, inbound)
        if head == start_head:
            return False
        ring.set_head(head)
        if ring.room_wanted():  # the sender waits for room (else a bell would wake it for nothing)
            self._ring(peer)
        return True

    def _match(self, peer: int, tag: int, payload: int) -> Inbound | None:
        for queue in (self._recvs[peer], self._any):
            for recv in queue:
                if recv.tag == tag:
                    queue.remove(recv)
                    recv.work.source = peer
                    if refusal(recv, payload) is not None:  # read it (to keep the stream framed), then fail the receive
                        return Inbound(None, payload, recv, None)
                    return Inbound(recv.target, payload, recv, None)
        if not self._recvs[peer]:
            return None
        # the owner waits for a later message of this peer: hold this one aside
        held = Unexpected(tag, torch.empty(payload, dtype=torch.uint8))
        self._unexpected[peer].append(held)
        return Inbound(held.buffer, payload, None, held)

    def _finish(self, peer: int, inbound: Inbound) -> None:
        if inbound.unexpected is not None:
            held = inbound.unexpected
            held.complete = True
            if held.claimed is not None:
                self._deliver_unexpected(peer, held)
            return
        recv = inbound.recv
        if inbound.target is None:
            self._fail(recv.work, f"rank {peer} sent {inbound.payload} bytes (tag {recv.tag}) into a "
                                  f"{refusal(recv, inbound.payload)}: the ranks disagree about the message's size")
            return
        recv.work.done = True
        recv.target = None

    def _ring(self, peer: int) -> None:
        """Wake ``peer`` if it sleeps on its doorbell (it may wait for what just moved)."""
        if self.outboxes[peer].sleeping():
            try:
                os.write(self.bells[peer], b"\x01")
            except (BlockingIOError, BrokenPipeError):
                pass  # full: it has wake-ups pending already; gone: its death is found by liveness

    # ----- waiting ----------------------------------------------------------------------
    def wait(self, work: ShmWork, timeout_s: float | None) -> None:
        """Make progress until ``work`` is done; raise RuntimeError (its message says
        "timed out" on the deadline) if a peer died, closed or never came."""
        if work.done:  # already there (a send into a ring with room, a message read while posting)
            if work.error is not None:
                raise RuntimeError(work.error)
            return
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        idle_since = started
        next_check = idle_since + _LIVENESS_S
        spin_s = self._spin_budget_s()
        blocked = False
        while not work.done:
            if self._closed:
                raise RuntimeError(f"the shared-memory transport of this group was closed while waiting for "
                                   f"{work.description}")
            if self.progress():
                idle_since = time.monotonic()
                continue
            if work.done:
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {work.description} over shared "
                                   "memory")
            if now - idle_since < spin_s:
                continue
            if spin_s == 0 and now - idle_since < self.spin_max_s and now >= self._yield_off_until:
                # more local ranks than cores: hand the core to a peer that may be what this
                # rank waits for, unless that just handed it to another process for a slice
                os.sched_yield()
                if time.monotonic() - now > _YIELD_STALL_S:
                    self._yield_off_until = now + _YIELD_OFF_S
                continue
            if now >= next_check:
                next_check = now + _LIVENESS_S
                self._check_peers()
            blocked = True
            self._nap(min(_NAP_S, deadline - now) if deadline is not None else _NAP_S, work)
        if self.spin_s > 0 and spin_s >= self.spin_max_s:
            self._note_wait(blocked)
        if work.error is not None:
            raise RuntimeError(work.error)

    def _spin_budget_s(self) -> float:
        """How long this wait polls before it blocks: ``spin_max_s`` while recent long
        polls paid (at least half of them ended the wait without a block: a peer's
        per-call time polled through saves a block and a wake-up, a syscall each side plus
        the scheduler's wake latency, 50-300 us on this machine), else ``spin_s``: waits
        for a peer that computes, or a host whose cores are taken (a poll that fails
        burns the core a peer or this rank's other thread needs); every
        ``_PROBE_EVERY``-th wait polls ``spin_max_s`` again, so polling comes back once
        it pays. The decision rests on whether polls succeed, not on how long waits are:
        waits that are long only because each paid a wake-up would otherwise keep a rank
        blocking. ``spin_s`` = 0 (more local ranks than cores: a plain poller holds the
        core its peer needs): 0, the wait yields between polls instead."""
        if self.spin_s <= 0:
            return 0.0
        self._waits += 1
        if self._poll_hit >= 0.5 or self._waits % _PROBE_EVERY == 0:
            return self.spin_max_s
        return self.spin_s

    def _note_wait(self, blocked: bool) -> None:
        """Fold one long poll's outcome into the hit rate: an exponential average (weight
        ``_HIT_WEIGHT``) of 1 for a wait that ended while polling, 0 for one that blocked."""
        self._poll_hit += ((0.0 if blocked else 1.0) - self._poll_hit) * _HIT_WEIGHT

    def _nap(self, nap_s: float, work: ShmWork) -> None:
        """Block until a peer rings this rank's doorbell (or ``nap_s`` passes). One
        thread at a time blocks on the doorbell and owns the ``sleeping`` word; other
        threads of this rank waiting meanwhile (a p2p wait beside a collective on the
        group's comm thread) wait for that one to wake, then look again: a bell is
        meant for the rank, whichever thread's message it announces."""
        with self._nap_lock:
            if self._napping:
                self._nap_done.wait(nap_s)
                return
            self._napping = True
        self.inbox.set_sleeping(True)
        try:
            if self.progress() or work.done:  # re-check after announcing the sleep
                return
            self.naps += 1
            ready = self._poller.poll(max(nap_s, 0.0) * 1000.0)  # poll, not select: fds may pass 1024
            if not ready:
                self.naps_timed_out += 1
            else:
                try:
                    os.read(self.bell, 4096)
                except BlockingIOError:
                    pass
        finally:
            self.inbox.set_sleeping(False)
            with self._nap_lock:
                self._napping = False
                self._nap_done.notify_all()

    def _check_peers(self) -> None:
        """Fail pending work of a peer whose process is gone or whose transport closed,
        after taking in whatever it wrote before it went (a peer may send its last
        message and exit between this rank's last look at the rings and this check)."""
        with self._lock:
            self._progress_locked()
            for peer in self.peers:
                reason = self._peer_gone(peer)
                if reason is None:
                    continue
                busy = [send.work for send in self._sends[peer]] + [recv.work for recv in self._recvs[peer]]
                reading = self._reading[peer]
                if reading is not None and reading.recv is not None:
                    busy.append(reading.recv.work)
                for work in busy:
                    self._fail(work, reason)
                self._sends[peer].clear()
                self._recvs[peer].clear()
            if self._any and all(self._peer_gone(peer) for peer in self.peers):
                for recv in self._any:
                    self._fail(recv.work, "every local peer is gone")
                self._any.clear()

    def _peer_gone(self, peer: int) -> str | None:
        if self.outboxes[peer].closed():
            return f"rank {peer} closed its shared-memory transport (it left the group or its process group was destroyed)"
        pid = self._pids[peer]
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"rank {peer} (pid {pid}) died: its process is gone"
        except PermissionError:
            return None
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None
        if state in (b"Z", b"X"):
            return f"rank {peer} (pid {pid}) died: its process has exited"
        return None

    # ----- closing ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the shared-memory transport of this group is closed")

    def close(self) -> None:
        """Tell the peers (their waits fail naming this rank), close the doorbells and
        unmap. The segments' files were unlinked at creation: nothing is left behind."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.inbox.set_closed()
            for peer in self.peers:
                try:
                    os.write(self.bells[peer], b"\x01")
                except OSError:
                    pass
            for fd in [self.bell, *self.bells.values()]:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.inbound.clear()
            self.outbound.clear()
            for segment in [self.inbox, *self.outboxes.values()]:
                segment.close()


__all__ = ["ShmTransport", "ShmWork"]
