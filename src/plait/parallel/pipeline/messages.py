"""The pipeline engine's messages: activations and gradients between stages, their
shapes agreed once, their receives posted ahead.

A message is one micro-batch's activation (or gradient) made by one stage, sent
from the rank holding that stage to the rank holding its neighbour; a *stream* is
every message of one kind from one stage between the same two ranks: (kind, stage,
sender, receiver). All micro-batches of a stream give one shape in a step.

Why not a header before every payload: gloo delivers a message only once the
receiver has posted its receive (the sender then writes it from its own thread at
once; otherwise gloo's background thread writes it when the receiver's notice
arrives, which on a busy CPU waits for a time slice). A header first means the
payload's receive can only be posted once the header is in, too late for the fast
path, and costs a second round trip per message.

Protocol. Each stream has an *agreed* spec (dtype, shape): the one its messages had
in the last step that succeeded on both ranks (none before the first). Per message,
tags 3·(slot) + 0 / 1 / 2 (``plait.comm.tags.PIPELINE``) carry the header, the
payload in the agreed spec, and a payload in a new spec:

- the receiver posts, up to ``RECEIVES_AHEAD`` receives ahead of the one it
  waits for, the header's receive and (with an agreed spec) the payload's, into a
  buffer of that spec;
- a sender whose tensor has the agreed spec sends the payload then the header
  ``OK``: one rendezvous, already posted, and the header after it costs no wait;
- otherwise (first step, a new batch shape) it sends a header ``NEW`` with the
  spec, then the payload on the new-spec tag, which the receiver posts on reading
  the header; an agreed payload receive already posted is filled with an empty
  message (gloo takes a shorter message into a longer receive, never a longer one);
- a rank that fails sends ``ABORT`` headers (and empty fillers) for its remaining
  sends, so a peer waiting on it is told, names it and aborts too.

A stage whose boundary is several tensors (hidden states, position ids, a mask,
rotary cos/sin: ``plait.parallel.pipeline.graph_split``) sends a tuple as one message:
its parts' bytes packed into one uint8 payload (each part at a 16-byte aligned offset),
the spec (uint8, (bytes,), parts) listing each part's dtype, shape and whether it
carries a gradient back; its header carries the parts' specs too, up to ``MAX_PARTS``
of them (a longer header: a one-tensor header stays 11 int64s, received into a
zeroed buffer of the longest). The receiver unpacks copies of the parts.

Receive buffers are reused: an agreed payload is received into a buffer of that spec
kept from an earlier receive whose tensor nobody holds any more (the storage's use
count says only this pool refers to it), else a new one. A fresh buffer each time
costs the kernel's page faults: a 256 KiB activation is allocated by mmap and faulted
in page by page (64 faults, ~1 us each, plus zeroing) and unmapped again when freed,
which torch's stages avoid by allocating their receive buffers once. The pool holds
at most as many buffers per spec as were alive at once (the in-flight receives).

Both ranks of a stream update its agreed spec only after a step that succeeded on
this rank, and forget every spec after a failed one; a header says whether the
agreed payload receive was filled, so a receiver that still expects a spec the
sender forgot raises instead of waiting (rebuild the engines after a PipelineError).
"""

from __future__ import annotations

import math
import time

import torch

from plait import comm
from plait.comm import tags
from plait.comm.errors import CommError
from plait.comm.ops import dtype_from_code
from plait.names.wire import dtype_code as wire_code
from plait.parallel.pipeline.schedules import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD

# what pipeline messages carry, each coded in the header by plait.names.wire
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
HEADER_FIELDS = ("status", "filled", "dtype", "ndim")  # then up to MAX_DIMS sizes
MAX_DIMS = 7
MAX_PARTS = 8  # tensors of one tuple message
PART_FIELDS = ("dtype", "requires_grad", "ndim")  # then MAX_DIMS sizes, per part
_PART = len(PART_FIELDS) + MAX_DIMS
_PLAIN = len(HEADER_FIELDS) + MAX_DIMS
# a header's longest: + the number of parts (absent: one tensor; n + 1: a tuple of n) and theirs
_HEADER = _PLAIN + 1 + MAX_PARTS * _PART
_ALIGN_BYTES = 16
OK, NEW, ABORT = 1, 2, -1
TAGS_PER_MESSAGE = 3  # header, payload in the agreed spec, payload in a new spec
STEP_SLOTS = 1024  # the step number (mod 1024) is part of every tag: a failed step's stray message is never read later
RECEIVES_AHEAD = 2  # receives posted beyond the one waited for: one buffer per message in flight to this rank
ABORT_GRACE_S = 2.0  # after a failure, how long posted messages get to complete before we raise
# the storage use count of a pooled buffer no one else refers to: the pool's tensor and
# the storage object asking (the StorageImpl reference count)
_use_count = torch._C._storage_Use_Count
_POOL_ONLY = 2
_KIND_CODE = {SEND_ACT: 0, RECV_ACT: 0, SEND_GRAD: 1, RECV_GRAD: 1}


class PipelineError(RuntimeError):
    """A pipeline step failed on this rank: names the stage, the action and the peer."""


def tags_needed(microbatches: int, stages: int) -> int:
    """Tags one engine uses: 3 per message, 2·m·S messages per step, 1024 step slots."""
    return TAGS_PER_MESSAGE * STEP_SLOTS * 2 * microbatches * stages


class _Posted:
    """A receive posted ahead: its header, and the agreed payload's buffer and message."""

    __slots__ = ("header", "header_message", "buffer", "payload_message", "spec")

    def __init__(self, header, header_message, buffer, payload_message, spec):
        self.header, self.header_message = header, header_message
        self.buffer, self.payload_message, self.spec = buffer, payload_message, spec


class StageMessages:
    """This rank's pipeline messages (see the module docstring). ``begin`` a step,
    ``send`` / ``receive`` per action, then ``finish`` and ``commit`` it, or
    ``abort`` it after a failure."""

    def __init__(self, schedule, rank: int, group, timeout_s: float | None):
        if tags_needed(schedule.microbatches, schedule.stages) > len(tags.PIPELINE):
            raise ValueError(f"m={schedule.microbatches} x {schedule.stages} stages is too many messages to tag: keep "
                             f"m x stages below {len(tags.PIPELINE) // tags_needed(1, 1)}")
        self.schedule, self.rank, self.group, self.timeout_s = schedule, rank, group, timeout_s
        self.agreed: dict[tuple, tuple] = {}  # stream -> (dtype, shape)
        self._headers: dict[tuple, torch.Tensor] = {}  # (status, filled, spec) -> header (only ever read)
        self.receives = tuple(action for action in schedule.actions[rank] if action.kind in (RECV_ACT, RECV_GRAD))
        self._orphans: list = []  # receives a disagreeing peer will never fill: kept alive, never read
        self._pool: dict[tuple, list] = {}  # (dtype, shape, device) -> receive buffers to reuse
        self._begin_step(0, torch.device("cpu"))

    # ----- a step ----------------------------------------------------------------------
    def begin(self, step: int, device) -> None:
        """Start step ``step`` (its tags) on ``device`` and post the first receives."""
        self._begin_step(step, device)
        self._post_ahead(0)

    def _begin_step(self, step, device) -> None:
        self.step, self.device = step, device
        self.posted: dict = {}  # action -> _Posted
        self.received = 0  # receives consumed so far (in list order)
        self.pending: list = []  # (message, tensor) of this step's sends
        self.seen: dict = {}  # stream -> spec this step

    def finish(self) -> None:
        """Wait for every send of the step (they were posted without blocking)."""
        for message, _ in self.pending:
            message.wait()
        self.pending = []

    def commit(self) -> None:
        """The step succeeded on this rank: its specs become the agreed ones."""
        self.agreed.update(self.seen)

    def forget(self) -> None:
        """The step failed after its messages: agree afresh (as the peers will)."""
        self.agreed.clear()

    def abort(self, remaining) -> None:
        """Unblock every peer still waiting on us: each later send becomes an abort
        header. Posted messages get a short grace to complete (a peer that already
        failed never answers them); a gloo pair whose message timed out stays closed,
        so rebuild the process group after a PipelineError before training on."""
        for later in remaining:
            if later.kind in (SEND_ACT, SEND_GRAD):
                try:
                    self.send(None, later)
                except PipelineError:
                    pass
        waiting = [message for message, _ in self.pending]
        for posted in self.posted.values():
            waiting += [message for message in (posted.header_message, posted.payload_message) if message is not None]
        for message in waiting:
            message.timeout_s = min(message.timeout_s, time.monotonic() - message.start_s + ABORT_GRACE_S)
            try:
                message.wait()
            except CommError:
                pass
        self.pending, self.posted = [], {}
        self.agreed.clear()  # the peers may have stopped anywhere: agree afresh

    # ----- tags and headers ------------------------------------------------------------
    def _tag(self, kind, microbatch: int, stage: int) -> int:
        m, stages = self.schedule.microbatches, self.schedule.stages
        message = (_KIND_CODE[kind] * m + microbatch) * stages + stage  # < 2·m·S
        slot = (self.step % STEP_SLOTS) * 2 * m * stages + message
        return tags.PIPELINE.start + TAGS_PER_MESSAGE * slot

    def _stream(self, kind, stage: int, peer: int, sending: bool) -> tuple:
        sender, receiver = (self.rank, peer) if sending else (peer, self.rank)
        return _KIND_CODE[kind], stage, sender, receiver

    def _header(self, status: int, filled: bool, spec) -> torch.Tensor:
        key = (status, filled, spec, self.device)
        header = self._headers.get(key)
        if header is None:
            values = [status, int(filled), -1, 0]
            if spec is not None:
                dtype, shape = spec[:2]
                values[2:4] = [wire_code(dtype), len(shape)]
                values += list(shape)
            values += [0] * (_PLAIN - len(values))
            if spec is not None and len(spec) == 3:  # a tuple's header lists its parts (a longer message)
                values.append(len(spec[2]) + 1)
                for dtype, shape, requires_grad in spec[2]:
                    values += [wire_code(dtype), int(requires_grad), len(shape), *shape, *[0] * (MAX_DIMS - len(shape))]
            header = torch.tensor(values, dtype=torch.int64, device=self.device)
            self._headers[key] = header
        return header

    # ----- sending ---------------------------------------------------------------------
    def send(self, tensor, action) -> None:
        """Send ``tensor`` (or a tuple of tensors) for a SEND action (None: an abort header)."""
        stream = self._stream(action.kind, action.stage, action.peer, True)
        agreed = self.agreed.get(stream)
        spec = None
        if isinstance(tensor, tuple):
            tensor, spec = pack(tensor, action)
        elif tensor is not None:
            tensor = tensor.detach().contiguous()
            if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS:
                raise TypeError(f"stage {action.stage} produced a {tensor.dtype} tensor of {tensor.dim()} dims for "
                                f"micro-batch {action.microbatch}: pipeline messages carry {list(DTYPES)} "
                                f"of at most {MAX_DIMS} dims")
            spec = (tensor.dtype, tuple(tensor.shape))
        tag = self._tag(action.kind, action.microbatch, action.stage)
        label = f"pipeline {action.kind} micro-batch {action.microbatch} stage {action.stage}"
        if spec is not None and spec == agreed:
            parts = [(tensor, tag + 1), (self._header(OK, True, spec), tag)]
        else:
            filled = agreed is not None  # the receiver posted the agreed payload's receive: complete it
            parts = [(torch.empty(0, dtype=agreed[0], device=self.device), tag + 1)] if filled else []
            parts.append((self._header(NEW if spec is not None else ABORT, filled, spec), tag))
            if spec is not None:
                parts.append((tensor, tag + 2))
        try:
            for part, part_tag in parts:
                self.pending.append((comm.isend(part, group=self.group, tag=part_tag, group_dst=action.peer,
                                                label=label, timeout_s=self.timeout_s), part))
        except CommError as error:
            what = "activation" if action.kind == SEND_ACT else "gradient"
            raise PipelineError(f"rank {self.rank} (stage {action.stage}) could not send the {what} of micro-batch "
                                f"{action.microbatch} to rank {action.peer}: {error}") from error
        if spec is not None:
            self.seen[stream] = spec

    # ----- receiving -------------------------------------------------------------------
    def _post(self, action) -> None:
        stream = self._stream(action.kind, action.stage, action.peer, False)
        spec = self.agreed.get(stream)
        tag = self._tag(action.kind, action.microbatch, action.stage)
        label = f"pipeline {'activation' if action.kind == RECV_ACT else 'gradient'}"
        buffer = payload_message = None
        try:
            if spec is not None:
                buffer = self._buffer(spec)
                payload_message = comm.irecv(buffer, group=self.group, tag=tag + 1, group_src=action.peer,
                                             label=label, timeout_s=self.timeout_s)
            # zeros: a one-tensor header is shorter than the buffer, its part count reads 0
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            header_message = comm.irecv(header, group=self.group, tag=tag, group_src=action.peer, label=label,
                                        timeout_s=self.timeout_s)
        except CommError as error:
            raise PipelineError(f"{self._waited(action)}: {error}") from error
        self.posted[action] = _Posted(header, header_message, buffer, payload_message, spec)

    def _buffer(self, spec) -> torch.Tensor:
        """A receive buffer of an agreed spec: a view of a pooled one that nothing else
        holds (neither a posted receive nor a tensor handed out earlier, nor a view or
        a graph saving it), else a new one joining the pool. The view is a tensor of
        its own (its flags, its grad) on the pooled storage, and counts as a holder."""
        pool = self._pool.setdefault((spec[0], spec[1], self.device), [])
        for buffer in pool:
            if _use_count(buffer.untyped_storage()._cdata) <= _POOL_ONLY:
                return buffer.detach()
        buffer = torch.empty(spec[1], dtype=spec[0], device=self.device)
        pool.append(buffer)
        return buffer.detach()

    def _post_ahead(self, index: int) -> None:
        for action in self.receives[index:index + RECEIVES_AHEAD + 1]:
            if action not in self.posted:
                self._post(action)

    def _waited(self, action) -> str:
        what = "activation" if action.kind == RECV_ACT else "gradient"
        consumer = action.stage + 1 if action.kind == RECV_ACT else action.stage - 1
        return (f"rank {self.rank} (stage {consumer}) waited for the {what} of micro-batch {action.microbatch} "
                f"from rank {action.peer} (stage {action.stage})")

    def receive(self, action) -> torch.Tensor:
        """The tensor of a RECV action (posting the next receives first)."""
        self._post_ahead(self.received)
        self.received += 1
        posted = self.posted.pop(action, None)
        if posted is None:  # received out of list order: post it now
            self._post(action)
            posted = self.posted.pop(action)
        waited = self._waited(action)
        tag = self._tag(action.kind, action.microbatch, action.stage)
        try:
            _wait(posted.header_message)
            status, filled, spec = _read_header(posted.header.tolist())
            if posted.payload_message is not None and not filled and status != OK:
                self._orphans.append(posted)  # the sender forgot the spec we posted for: never filled
                if status != ABORT:
                    raise PipelineError(f"{waited}: this rank expected the {posted.spec} agreed earlier, the sender "
                                        "agrees afresh after a failed step: rebuild the engines on every rank after "
                                        "a PipelineError")
            elif posted.payload_message is not None:
                _wait(posted.payload_message)  # the payload, or an empty filler
            if status == ABORT:
                raise PipelineError(f"{waited}: that rank failed (see its error) and aborted the step")
            if status == OK and posted.payload_message is not None:
                if spec != posted.spec:
                    raise PipelineError(f"{waited}: the sender sent {spec} where {posted.spec} was agreed")
                tensor = posted.buffer
            else:  # a new spec, or an agreed one this rank did not post for
                tensor = torch.empty(spec[1], dtype=spec[0], device=self.device)
                comm.recv(tensor, group=self.group, tag=tag + (1 if status == OK else 2), group_src=action.peer,
                          label=f"pipeline {action.kind}", timeout_s=self.timeout_s)
        except CommError as error:
            raise PipelineError(f"{waited}: {error}") from error
        self.seen[self._stream(action.kind, action.stage, action.peer, False)] = spec
        return unpack(tensor, spec[2]) if len(spec) == 3 else tensor


def pack(parts: tuple, action) -> tuple[torch.Tensor, tuple]:
    """(one uint8 payload, its spec (uint8, (bytes,), ((dtype, shape, requires_grad), ...)))
    of a tuple of tensors, each at a 16-byte aligned offset (so it views back as its dtype)."""
    if len(parts) > MAX_PARTS or not all(isinstance(part, torch.Tensor) for part in parts):
        kinds = [type(part).__name__ for part in parts]
        raise TypeError(f"stage {action.stage} produced a tuple of {kinds} for micro-batch {action.microbatch}: "
                        f"a pipeline message carries a tensor or a tuple of at most {MAX_PARTS} tensors")
    chunks, layout, offset = [], [], 0
    for part in parts:
        if part.dim() > MAX_DIMS:
            raise TypeError(f"stage {action.stage} produced a {part.dim()}-dim tensor for micro-batch "
                            f"{action.microbatch}: pipeline messages carry at most {MAX_DIMS} dims")
        wire_code(part.dtype, "a pipeline message")  # refuses a dtype the wire has no code for
        data = part.detach().contiguous().reshape(-1).view(torch.uint8)
        padding = -data.numel() % _ALIGN_BYTES
        chunks += [data, torch.zeros(padding, dtype=torch.uint8, device=data.device)] if padding else [data]
        layout.append((part.dtype, tuple(part.shape), part.requires_grad))
        offset += data.numel() + padding
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return payload, (torch.uint8, (offset,), tuple(layout))


def unpack(payload: torch.Tensor, layout: tuple) -> tuple:
    """The parts of a packed payload (copies: each its own storage; a part that carries a
    gradient back is a leaf requiring one)."""
    parts, offset = [], 0
    for dtype, shape, requires_grad in layout:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        part = payload[offset:offset + nbytes].view(dtype).reshape(shape).clone()
        parts.append(part.requires_grad_(requires_grad and part.is_floating_point()))
        offset += nbytes + (-nbytes % _ALIGN_BYTES)
    return tuple(parts)


def _read_header(values: list) -> tuple:
    """(status, filled, spec) of a received header (spec with its parts for a tuple)."""
    status, filled, dtype_code, ndim, *dims = values[:_PLAIN]
    spec = (dtype_from_code(dtype_code), tuple(dims[:ndim])) if status != ABORT else (torch.uint8, ())
    count = values[_PLAIN] - 1
    if count >= 0 and status != ABORT:
        layout = []
        for index in range(count):
            start = _PLAIN + 1 + index * _PART
            code, requires_grad, part_ndim, *part_dims = values[start:start + _PART]
            layout.append((dtype_from_code(code), tuple(part_dims[:part_ndim]), bool(requires_grad)))
        spec = (*spec, tuple(layout))
    return status, filled, spec


def _wait(message) -> None:
    """Wait with the full deadline from now (a receive posted ahead started its clock early)."""
    message.start_s = time.monotonic()
    message.wait()
