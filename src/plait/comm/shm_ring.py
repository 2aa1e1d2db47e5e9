"""One rank's shared-memory inbox: a segment in ``/dev/shm`` holding one ring buffer
per local peer that sends to it, and the rank's doorbell.

Layout of the segment of group rank ``owner`` (all offsets in bytes, every field an
aligned int64 on a cache line of its own, so a writer never shares a line with a
reader's field)::

    0      header   magic, nonce, owner pid, ring bytes C, number of rings
    64     sleeping 1 while the owner is blocked on its doorbell (peers ring it then)
    128    closed   1 once the owner has closed its transport
    4096   ring 0   tail (sender's: frame bytes written) at +0, head (owner's: bytes
                    consumed) at +64, wanted (sender's: 1 while it has bytes the ring
                    had no room for) at +128, data at +4096 .. +4096+C
    ...    ring k   the ring of the k-th other local rank, at 4096 + k·(4096 + C)

A ring is single-producer, single-consumer. Positions only grow; byte ``pos`` of the
stream lives at ``data[pos % C]``. A message is a frame: a 64-byte header
(tag, payload bytes) then the payload, padded to 64 bytes. A frame larger than the
ring streams through it: the sender writes as space frees, the owner reads as bytes
arrive, so a 64 MiB message needs no 64 MiB of shared memory.

Ordering: the writer copies bytes, then stores the new tail; the reader loads the
tail, then copies bytes (and the same for the head in the other direction). On x86
(total store order) stores become visible in program order and loads are not
reordered with loads, so a reader never sees a tail ahead of its bytes. Other
architectures would need fences, which Python cannot issue:
:func:`ordering_is_safe` says so and the transport then stays on gloo.

The doorbell is a FIFO the owner reads; a rank about to block sets its ``sleeping``
word and waits on the FIFO with a short timeout; a rank that moves bytes a sleeping
rank waits for writes one byte to its FIFO (the only syscall, and only when that
rank sleeps): a sender after writing frames, the owner after consuming bytes only
while the ring's sender wants room (so a sender that waits for something else is
not woken for nothing).
"""

from __future__ import annotations

import mmap
import os
import platform

import torch

MAGIC = 0x706C_6169_7473_686D  # "plaitshm"
HEADER_BYTES = 4096
FRAME_HEADER_BYTES = 64
FRAME_ALIGN = 64
_NONCE, _PID, _RING_BYTES, _RINGS = 1, 2, 3, 4
_SLEEPING = 64 // 8
_CLOSED = 128 // 8
_TAIL, _HEAD, _WANTED = 0, 64 // 8, 128 // 8


def ordering_is_safe() -> bool:
    """True on machines whose memory order keeps plain stores and loads in program
    order (x86-64's total store order), which the rings rely on."""
    return platform.machine().lower() in ("x86_64", "amd64")


def segment_bytes(rings: int, ring_bytes: int) -> int:
    """Bytes of a segment with ``rings`` rings of ``ring_bytes`` data each."""
    return HEADER_BYTES + rings * (HEADER_BYTES + ring_bytes)


def frame_bytes(payload_bytes: int) -> int:
    """A frame: its header, the payload and padding to FRAME_ALIGN."""
    return FRAME_HEADER_BYTES + payload_bytes + (-payload_bytes) % FRAME_ALIGN


class Segment:
    """A mapped segment (the owner's, or a peer's opened to send to it).

    ``words``: the segment as int64s (header fields and ring counters);
    ``data``: the segment as uint8 tensor (ring contents)."""

    def __init__(self, fd: int, nbytes: int):
        self.nbytes = nbytes
        self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.words = memoryview(self._map).cast("q")
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, path: str, nonce: int, rings: int, ring_bytes: int) -> Segment:
        """Create ``path`` (which must not exist), reserve its memory (so a full
        ``/dev/shm`` fails here with ENOSPC, not later with SIGBUS) and write the header."""
        nbytes = segment_bytes(rings, ring_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            segment = cls(fd, nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        words = segment.words
        words[_NONCE], words[_PID], words[_RING_BYTES], words[_RINGS] = nonce, os.getpid(), ring_bytes, rings
        words[0] = MAGIC  # last: the header is complete
        return segment

    @classmethod
    def attach(cls, path: str, nonce: int) -> Segment:
        """Map a peer's segment, checking it is the one this group created (magic
        and nonce), never a stale one left by another run."""
        fd = os.open(path, os.O_RDWR)
        try:
            nbytes = os.fstat(fd).st_size
            if nbytes < HEADER_BYTES:
                raise ValueError(f"{path} is {nbytes} bytes, shorter than a plait shared-memory header")
            segment = cls(fd, nbytes)
        finally:
            os.close(fd)
        if segment.words[0] != MAGIC or segment.words[_NONCE] != nonce:
            segment.close()
            raise ValueError(f"{path} is not this group's segment (magic/nonce differ): a stale or foreign file")
        return segment

    @property
    def owner_pid(self) -> int:
        return self.words[_PID]

    @property
    def ring_bytes(self) -> int:
        return self.words[_RING_BYTES]

    def ring(self, index: int) -> Ring:
        return Ring(self, HEADER_BYTES + index * (HEADER_BYTES + self.ring_bytes), self.ring_bytes)

    # the owner's flags
    def sleeping(self) -> bool:
        return self.words[_SLEEPING] != 0

    def set_sleeping(self, value: bool) -> None:
        self.words[_SLEEPING] = 1 if value else 0

    def closed(self) -> bool:
        return self.words[_CLOSED] != 0

    def set_closed(self) -> None:
        self.words[_CLOSED] = 1

    def close(self) -> None:
        """Unmap (once nothing holds a view of the map any more; else the mapping goes
        when the last view does)."""
        self.data = None
        try:
            self.words.release()
            self._map.close()
        except BufferError:
            pass  # a tensor view is still alive somewhere: the map is freed with it


class Ring:
    """One single-producer single-consumer byte ring inside a segment."""

    __slots__ = ("words", "data", "capacity", "_tail", "_head", "_wanted", "_base", "wraps", "last_wrap_at")

    def __init__(self, segment: Segment, offset: int, capacity: int):
        self.words = segment.words
        self.data = segment.data
        self.capacity = capacity
        self._tail = offset // 8 + _TAIL
        self._head = offset // 8 + _HEAD
        self._wanted = offset // 8 + _WANTED
        self._base = offset + HEADER_BYTES
        # copies through this Ring object that passed the end of the buffer and went on at
        # its start, and the stream position the last one began at (how a test sees a wrap)
        self.wraps = 0
        self.last_wrap_at: int | None = None

    def tail(self) -> int:
        return self.words[self._tail]

    def head(self) -> int:
        return self.words[self._head]

    def set_tail(self, position: int) -> None:
        self.words[self._tail] = position

    def set_head(self, position: int) -> None:
        self.words[self._head] = position

    def room_wanted(self) -> bool:
        """Whether the sender has bytes waiting for room in this ring."""
        return self.words[self._wanted] != 0

    def set_room_wanted(self, value: bool) -> None:
        self.words[self._wanted] = 1 if value else 0

    def write_header(self, position: int, tag: int, payload_bytes: int) -> None:
        index = (self._base + position % self.capacity) // 8  # frames start 64-aligned: never wrap
        self.words[index] = tag
        self.words[index + 1] = payload_bytes

    def read_header(self, position: int) -> tuple[int, int]:
        index = (self._base + position % self.capacity) // 8
        return self.words[index], self.words[index + 1]

    def copy_in(self, position: int, source: torch.Tensor) -> None:
        """Copy the uint8 tensor ``source`` to stream bytes [position, position + len):
        one ``copy_`` per contiguous piece (two when it wraps around the ring's end)."""
        for at, offset, count in self._pieces(position, source.numel()):
            self.data[at : at + count].copy_(source[offset : offset + count])

    def copy_out(self, position: int, target: torch.Tensor) -> None:
        """Copy stream bytes [position, position + len) into the uint8 tensor ``target``."""
        for at, offset, count in self._pieces(position, target.numel()):
            target[offset : offset + count].copy_(self.data[at : at + count])

    def reduce_out(self, position: int, target: torch.Tensor, combine) -> None:
        """Combine stream bytes [position, position + len) into ``target`` (a 1-D tensor of
        the reduced dtype, len = its bytes) straight from the ring, with no copy out:
        ``combine(target[piece], ring bytes of the piece viewed as target.dtype)`` per
        contiguous piece (two when it wraps), the operand order of ``ops.apply_receives``,
        so the result is bit-identical to combining a copied-out payload. The ring's
        capacity and ``position`` are multiples of the element size (frames and their
        payloads start 64-aligned, readers take whole elements), so no element
        straddles the ring's end and every view is aligned. Cost: one pass reading both
        operands and writing ``target`` (a copy out and a pass less than through scratch)."""
        element_bytes = target.element_size()
        nbytes = target.numel() * element_bytes
        assert position % element_bytes == 0 and self.capacity % element_bytes == 0, (position, element_bytes)
        for at, offset, count in self._pieces(position, nbytes):
            first = offset // element_bytes
            combine(target[first : first + count // element_bytes], self.data[at : at + count].view(target.dtype))

    def _pieces(self, position: int, nbytes: int) -> list[tuple[int, int, int]]:
        """(byte in the segment, offset in the tensor, count) of the contiguous pieces of
        stream bytes [position, position + nbytes): one, or two when they pass the end."""
        start = position % self.capacity
        first = min(nbytes, self.capacity - start)
        if first == nbytes:
            return [(self._base + start, 0, nbytes)]
        self.wraps += 1  # wraps around the end of the ring
        self.last_wrap_at = position
        return [(self._base + start, 0, first), (self._base, first, nbytes - first)]


__all__ = ["FRAME_ALIGN", "FRAME_HEADER_BYTES", "MAGIC", "Ring", "Segment", "frame_bytes", "ordering_is_safe",
           "segment_bytes"]
