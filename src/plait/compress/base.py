"""The gradient-compressor contract: buckets in, averaged buckets out, bytes counted.

A data-parallel step hands each :class:`GradBucket` (a flat gradient buffer and the
parameter views into it) to a :class:`Compressor`, whose ``reduce`` averages the
buffer across the group *in place*, lossily, and returns the bytes this rank put on
the wire. Most compressors are :class:`PayloadCompressor` s: each rank encodes its
buffer into a :class:`Payload` (a few small tensors), every rank receives every
payload (one all-gather of the payloads' bytes) and decodes the average locally::

    x_r --compress--> payload_r --all-gather--> [payload_0..payload_{p-1}] --aggregate--> mean

Cost per step, alpha-beta, with ``w = wire_nbytes(n)``: one all-gather of ``w`` bytes
per rank, ``T = a·(rounds) + (p-1)·w·b`` for a ring, against the ring all-reduce's
``2(p-1)/p · n·itemsize·b``. Gathering only wins when ``w`` is below ``2/p`` of the
dense size, which is why compressors aim at ratios of 1/32 and less.

Randomised compressors seed a fresh generator per (seed, rank, step, key) with
:func:`derive_seed`, so a run is reproducible and any rank can replay any other
rank's compression (the tests' oracle).
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait import comm
from plait.comm.communicator import process_group

_MASK64 = (1 << 64) - 1


@dataclass
class GradBucket:
    """One bucket of gradients: a flat buffer and the parameters' views into it.

    ``index`` is stable across steps (per-bucket state such as error-feedback
    residuals and PowerSGD's Q is keyed on it); ``views`` are (parameter name, view
    into ``buffer`` shaped like the parameter) in buffer order; ``step`` is the
    training step (PowerSGD's ``start_iter``, the random compressors' seeds).
    """

    index: int
    buffer: torch.Tensor
    views: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    step: int = 0

    def __post_init__(self):
        if not isinstance(self.buffer, torch.Tensor) or self.buffer.dim() != 1 or not self.buffer.is_contiguous():
            shape = tuple(self.buffer.shape) if isinstance(self.buffer, torch.Tensor) else type(self.buffer).__name__
            raise ValueError(
                f"GradBucket {self.index}: buffer must be a flat contiguous 1-D tensor, got {shape}; "
                f"pass tensor.reshape(-1) and views into it"
            )


@dataclass
class Payload:
    """What one rank really sends: named tensors encoding a flat tensor of ``numel``
    elements of ``dtype`` (e.g. ``{"values", "indices"}`` or ``{"bits", "scale"}``)."""

    tensors: dict[str, torch.Tensor]
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Sum of the tensors' bytes: the message size on the wire."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixing integer ``parts`` (seed, rank, step, key) with splitmix64,
    so nearby tuples (rank 0 step 1, rank 1 step 0) give unrelated streams."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (int(part) & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
        state ^= state >> 31
    return state & ((1 << 63) - 1)


def generator_for(device: torch.device, *parts: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``derive_seed(*parts)``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(*parts))
    return generator


def check_ratio(owner: str, ratio) -> float:
    """``ratio`` as a float in (0, 1], else ValueError naming the value."""
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise ValueError(f"{owner} ratio must be a number in (0, 1], got {ratio!r} ({type(ratio).__name__})")
    value = float(ratio)
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{owner} ratio must be in (0, 1], got {ratio!r}; e.g. 0.01 keeps 1% of the elements")
    return value


def check_int(owner: str, what: str, value, low: int, high: int | None = None, hint: str = "") -> int:
    """``value`` as an int in [low, high], else ValueError naming it."""
    bad = isinstance(value, bool) or not isinstance(value, numbers.Integral)
    if not bad:
        value = int(value)
        bad = value < low or (high is not None and value > high)
    if bad:
        wanted = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
        raise ValueError(f"{owner} {what} must be {wanted}, got {value!r}{hint}")
    return value


def check_floating(owner: str, dtype: torch.dtype) -> None:
    """Compressors encode floating-point gradients only."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"{owner} compresses floating-point gradients, got {dtype}; "
            f"use float16, bfloat16, float32 or float64"
        )


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of half-precision values are taken in float32 (p values of 6e4 overflow float16)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def group_rank_and_size(group) -> tuple[int, int]:
    """(this rank in ``group``, the group's size); (0, 1) without a process group.
    ``group`` may be a process group (None: the world), a 1-D torch DeviceMesh or a
    plait.comm.Communicator."""
    if isinstance(group, comm.Communicator):
        return group.rank, group.size
    if group is None and (not dist.is_available() or not dist.is_initialized()):
        return 0, 1
    group = process_group(group)  # a 1-D torch DeviceMesh: its process group
    return dist.get_rank(group), dist.get_world_size(group)


def payload_to_bytes(payload: Payload) -> torch.Tensor:
    """The payload's tensors (in name order) as one flat uint8 tensor of ``payload.nbytes``."""
    parts = [payload.tensors[name].contiguous().reshape(-1).view(torch.uint8) for name in sorted(payload.tensors)]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def payload_from_bytes(data: torch.Tensor, template: Payload) -> Payload:
    """Inverse of :func:`payload_to_bytes`: split ``data`` into tensors shaped like
    ``template``'s. Slices are cloned first, since viewing bytes at an odd offset as
    int32 or float32 is not allowed."""
    if data.numel() != template.nbytes:
        raise ValueError(f"payload_from_bytes: got {data.numel()} bytes, the template holds {template.nbytes}")
    tensors, offset = {}, 0
    for name in sorted(template.tensors):
        like = template.tensors[name]
        size = like.numel() * like.element_size()
        tensors[name] = data[offset : offset + size].clone().view(like.dtype).reshape(like.shape)
        offset += size
    return Payload(tensors, template.numel, template.dtype)


class Compressor(ABC):
    """Averages a gradient bucket across a group, lossily, in place."""

    name: str = "compressor"
    collectives: tuple[str, ...] = ("all_reduce",)  # what reduce() calls with its algorithm

    def validate(self, named_shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        """Raise ValueError before training if some parameter cannot be compressed."""

    @abstractmethod
    def reduce(self, bucket: GradBucket, group=None, *, algorithm="auto") -> int:
        """Average ``bucket.buffer`` across ``group`` in place; return this rank's payload
        bytes. Called on the comm thread: collectives run synchronously, no threads.
        A group of one rank is a no-op returning 0."""

    @abstractmethod
    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """One rank's payload bytes for a flat tensor of ``numel`` elements, by formula."""

    def ratio(self, numel: int, dtype: torch.dtype) -> float:
        """Compression ratio wire_nbytes / (numel · itemsize); < 1 means fewer bytes."""
        dense = numel * torch.empty((), dtype=dtype).element_size()
        if dense == 0:
            raise ValueError(f"{self.describe()}: ratio of an empty tensor is undefined; use numel >= 1")
        return self.wire_nbytes(numel, dtype) / dense

    def describe(self) -> str:
        """A short label for reports, e.g. ``"topk(ratio=0.01)+ef"``."""
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


class PayloadCompressor(Compressor):
    """A compressor whose message is a :class:`Payload` gathered from every rank.

    Subclasses define ``payload_layout`` (the wire format, from which ``wire_nbytes``
    and ``empty_payload`` follow), ``compress`` and ``decompress``; ``aggregate``
    defaults to the mean of the decoded payloads, (1/p) Σ_r D(C(x_r)).
    """

    collectives: tuple[str, ...] = ("all_gather",)

    @abstractmethod
    def payload_layout(self, numel: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The payload's tensors for a flat tensor of ``numel`` elements: name -> (shape, dtype)."""

    @abstractmethod
    def compress(self, flat: torch.Tensor, *, rank: int = 0, step: int = 0, key: int | None = None) -> Payload:
        """Encode ``flat`` (any shape, read as 1-D). ``rank``, ``step`` and ``key`` (the
        bucket index) seed the random compressors and key ErrorFeedback's residual."""

    @abstractmethod
    def decompress(self, payload: Payload) -> torch.Tensor:
        """Decode to a flat tensor of ``payload.numel`` elements of ``payload.dtype``."""

    def aggregate(self, payloads: list[Payload]) -> torch.Tensor:
        """Every rank's payload -> the averaged flat tensor: (1/p) Σ_r decompress(payload_r),
        summed in float32 for half-precision dtypes."""
        numel, dtype = self.check_payloads(payloads)
        total = None
        for payload in payloads:
            decoded = self.decompress(payload).to(accumulate_dtype(dtype))
            total = decoded if total is None else total.add_(decoded)
        return total.div_(len(payloads)).to(dtype)

    def check_payloads(self, payloads: list[Payload]) -> tuple[int, torch.dtype]:
        """(numel, dtype) shared by all ``payloads``, else ValueError."""
        if not payloads:
            raise ValueError(f"{self.describe()}: aggregate needs at least one payload, got none")
        kinds = {(p.numel, p.dtype) for p in payloads}
        if len(kinds) != 1:
            raise ValueError(f"{self.describe()}: payloads encode different tensors {sorted(map(str, kinds))}; "
                             f"aggregate payloads of the same bucket only")
        return payloads[0].numel, payloads[0].dtype

    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        check_floating(self.describe(), dtype)
        layout = self.payload_layout(numel, dtype)
        return sum(math.prod(shape) * torch.empty((), dtype=wire).element_size() for shape, wire in layout.values())

    def empty_payload(self, numel: int, dtype: torch.dtype, device=None) -> Payload:
        """Uninitialised tensors shaped like a peer's payload, to receive it into."""
        check_floating(self.describe(), dtype)
        layout = self.payload_layout(numel, dtype)
        tensors = {name: torch.empty(shape, dtype=wire, device=device) for name, (shape, wire) in layout.items()}
        return Payload(tensors, numel, dtype)

    def reduce(self, bucket: GradBucket, group=None, *, algorithm="auto") -> int:
        """compress -> one all-gather of every rank's payload bytes -> aggregate -> copy
        into ``bucket.buffer``. Bytes sent by a ring all-gather: (p-1)·nbytes."""
        rank, world_size = group_rank_and_size(group)
        if world_size == 1:
            return 0
        buffer = bucket.buffer
        payload = self.compress(buffer, rank=rank, step=bucket.step, key=bucket.index)
        mine = payload_to_bytes(payload).to(buffer.device)
        gathered = torch.empty(world_size * mine.numel(), dtype=torch.uint8, device=buffer.device)
        comm.all_gather_into_tensor(gathered, mine, group, algorithm=algorithm)
        chunks = gathered.view(world_size, mine.numel())
        payloads = [payload_from_bytes(chunks[r], payload) for r in range(world_size)]
        buffer.copy_(self.aggregate(payloads))
        return payload.nbytes
