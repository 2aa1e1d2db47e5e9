"""Schedules as data: who sends which slice of its buffer to whom, at which step.

Every collective algorithm in plait is a function that returns a :class:`Schedule`.
A schedule knows nothing about torch: it is a list of :class:`Step` s, each a tuple
of :class:`Transfer` s that happen concurrently. Three consumers read it: the
virtual executor (``plait.comm.virtual``), the torch executor
(``plait.comm.executor``) and the cost model.

Buffer model. Each rank owns one flat 1-D buffer of ``buffer_numel`` elements (the
collective decides what it holds: for all-reduce the tensor itself, for all-gather
the output with the rank's own input already in place, ...). A transfer copies
``numel`` elements starting at ``src_offset`` of the sender's buffer into the
receiver's buffer at ``dst_offset``; with ``reduce=True`` the receiver combines
them with what it has (``local = op(local, incoming)``) instead of overwriting.

Step semantics. All sends of a step read the buffers as they were at the start of
the step; receives are applied after every transfer of the step has arrived, in
the order the transfers are listed. So a rank may send a region and receive into
another in the same step, and both executors give bit-identical results.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "Transfer",
    "Step",
    "Schedule",
    "ScheduleError",
    "chunk_bounds",
    "chunk_sizes",
    "wrapped_run",
    "sequential",
    "parallel",
]


class ScheduleError(ValueError):
    """A schedule breaks the rules of the buffer model (a bug in its builder)."""


class Transfer(NamedTuple):
    """One message: ``numel`` elements from ``src``'s buffer to ``dst``'s buffer.

    A named tuple rather than a dataclass: large schedules hold millions of these
    (a 1,024-rank ring all-reduce has 2M), and tuples are built ~4x faster.
    """

    src: int
    dst: int
    src_offset: int
    dst_offset: int
    numel: int
    reduce: bool = False

    @property
    def src_range(self) -> tuple[int, int]:
        return (self.src_offset, self.src_offset + self.numel)

    @property
    def dst_range(self) -> tuple[int, int]:
        return (self.dst_offset, self.dst_offset + self.numel)


@dataclass(frozen=True, slots=True)
class Step:
    """Transfers that run concurrently; the next step starts when all have landed."""

    transfers: tuple[Transfer, ...]


@dataclass(frozen=True)
class Schedule:
    """A collective algorithm as data.

    ``world_size`` ranks each hold a buffer of ``buffer_numel`` elements;
    ``steps`` run in order. ``collective`` and ``algorithm`` name what it does
    (e.g. ``"all_reduce"``, ``"ring"``); ``root`` is the root rank where the
    collective has one, else ``None``.
    """

    collective: str
    algorithm: str
    world_size: int
    buffer_numel: int
    steps: tuple[Step, ...]
    root: int | None = None
    _per_rank: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # ----- counts the cost model and the tests read -------------------------------
    @property
    def num_steps(self) -> int:
        """Sequential message rounds (steps with at least one transfer)."""
        return sum(1 for step in self.steps if step.transfers)

    def sent_numel(self, rank: int) -> int:
        """Elements ``rank`` sends over the whole schedule."""
        return sum(t.numel for s in self.steps for t in s.transfers if t.src == rank)

    def recv_numel(self, rank: int) -> int:
        """Elements ``rank`` receives over the whole schedule."""
        return sum(t.numel for s in self.steps for t in s.transfers if t.dst == rank)

    def reduced_numel(self, rank: int) -> int:
        """Elements ``rank`` combines with ``op`` (the gamma term of the cost)."""
        return sum(t.numel for s in self.steps for t in s.transfers if t.dst == rank and t.reduce)

    def messages(self, rank: int) -> int:
        """Messages ``rank`` sends."""
        return sum(1 for s in self.steps for t in s.transfers if t.src == rank)

    def max_peers(self) -> int:
        """Most distinct ranks any rank exchanges messages with (the links it uses)."""
        peers: dict[int, set[int]] = {}
        for step in self.steps:
            for t in step.transfers:
                peers.setdefault(t.src, set()).add(t.dst)
                peers.setdefault(t.dst, set()).add(t.src)
        return max((len(v) for v in peers.values()), default=0)

    def max_sent_numel(self) -> int:
        return max((self.sent_numel(r) for r in range(self.world_size)), default=0)

    def critical_path_numel(self) -> int:
        """Sum over steps of the largest message of the step.

        With one port per rank and all messages of a step concurrent, this is the
        beta term of the alpha-beta model along the critical path.
        """
        total = 0
        for step in self.steps:
            per_rank: dict[int, int] = {}
            for t in step.transfers:
                per_rank[t.src] = per_rank.get(t.src, 0) + t.numel
                per_rank[-1 - t.dst] = per_rank.get(-1 - t.dst, 0) + t.numel
            total += max(per_rank.values(), default=0)
        return total

    def total_numel_on_wire(self) -> int:
        return sum(t.numel for s in self.steps for t in s.transfers)

    # ----- validation ----------------------------------------------------------
    def validate(self) -> "Schedule":
        """Check ranks and bounds, that no copy lands where anything else lands in the same
        step, and that reductions landing together cover identical ranges."""
        p, n = self.world_size, self.buffer_numel
        if p < 1:
            raise ScheduleError(f"world_size must be >= 1, got {p}")
        for index, step in enumerate(self.steps):
            landing: dict[int, list[tuple[int, int, bool]]] = {}
            for t in step.transfers:
                src, dst, src_offset, dst_offset, numel, reduce = t
                problem = None
                if not (0 <= src < p and 0 <= dst < p):
                    problem = f"rank outside [0, {p})"
                elif src == dst:
                    problem = "a rank sends to itself"
                elif numel < 0 or src_offset < 0 or dst_offset < 0:
                    problem = "negative offset or size"
                elif src_offset + numel > n or dst_offset + numel > n:
                    problem = f"outside the buffer of {n} elements"
                if problem is not None:
                    raise ScheduleError(f"{self.algorithm} {self.collective} step {index}: {t}: {problem}")
                landing.setdefault(dst, []).append((dst_offset, dst_offset + numel, reduce))
            for dst, ranges in landing.items():
                ranges.sort()
                for (a0, a1, a_red), (b0, b1, b_red) in zip(ranges, ranges[1:]):
                    if b0 < a1 and not (a_red and b_red):
                        raise ScheduleError(
                            f"{self.algorithm} {self.collective} step {index}: rank {dst} "
                            f"receives overlapping copies [{a0},{a1}) and [{b0},{b1})"
                        )
                    if b0 < a1 and (a0, a1) != (b0, b1):
                        # reductions into one region are combined in rank order, so
                        # they must cover exactly the same elements
                        raise ScheduleError(
                            f"{self.algorithm} {self.collective} step {index}: rank {dst} "
                            f"reduces into partly overlapping ranges [{a0},{a1}) and [{b0},{b1})"
                        )
        return self

    def digest(self) -> int:
        """A crc32 of every transfer of every step (cached): equal on ranks that built
        the same schedule, which the argument check compares for the algorithms built
        from a topology."""
        cached = self._per_rank.get("digest")
        if cached is None:
            cached = 0
            for step in self.steps:
                cached = zlib.crc32(repr(step.transfers).encode(), cached)
            self._per_rank["digest"] = cached
        return cached

    # ----- per-rank view the executor uses -----------------------------------------
    def rank_steps(self, rank: int) -> list[tuple[list[Transfer], list[Transfer]]]:
        """For each step with work for ``rank``: (sends, receives), in listed order."""
        cached = self._per_rank.get(rank)
        if cached is None:
            cached = []
            for step in self.steps:
                sends = [t for t in step.transfers if t.src == rank and t.numel > 0]
                recvs = [t for t in step.transfers if t.dst == rank and t.numel > 0]
                cached.append((sends, recvs))
            self._per_rank[rank] = cached
        return cached

    # ----- display -------------------------------------------------------------------
    def table(self, max_steps: int = 64) -> str:
        """A step x rank table: each cell lists what the rank sends (``->dst[a:b]``,
        ``+`` marks a reducing receive at the destination)."""
        header = ["step"] + [f"rank {r}" for r in range(self.world_size)]
        rows = []
        for index, step in enumerate(self.steps[:max_steps]):
            cells = [""] * self.world_size
            for t in step.transfers:
                mark = "+" if t.reduce else ""
                text = f"->{t.dst}{mark}[{t.src_offset}:{t.src_offset + t.numel}]"
                cells[t.src] = f"{cells[t.src]} {text}".strip()
            rows.append([str(index)] + [c or "." for c in cells])
        widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
        lines = [
            f"{self.algorithm} {self.collective}: p={self.world_size}, "
            f"n={self.buffer_numel}, steps={self.num_steps}"
            + (f", root={self.root}" if self.root is not None else ""),
            "  ".join(h.ljust(w) for h, w in zip(header, widths)),
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
        if len(self.steps) > max_steps:
            lines.append(f"... {len(self.steps) - max_steps} more steps")
        return "\n".join(lines)


# ----- chunking --------------------------------------------------------------------
def chunk_sizes(numel: int, parts: int) -> list[int]:
    """Split ``numel`` into ``parts`` near-equal sizes; the first ``numel % parts``
    get one more. Works for numel < parts (trailing chunks are empty)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(numel, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def chunk_bounds(start: int, numel: int, parts: int) -> list[tuple[int, int]]:
    """(offset, numel) of each of ``parts`` chunks of the region [start, start+numel)."""
    bounds = []
    offset = start
    for size in chunk_sizes(numel, parts):
        bounds.append((offset, size))
        offset += size
    return bounds


def wrapped_run(bounds, first: int, count: int, src: int, dst: int) -> list[Transfer]:
    """Copies of the ``count`` chunks first, first+1, ... (mod p) from ``src`` to
    ``dst`` at their own offsets; a run that wraps past the last chunk travels as
    two messages. ``bounds`` is ``chunk_bounds`` of the p chunks."""
    p = len(bounds)
    pieces = [(first, min(count, p - first))]
    if first + count > p:
        pieces.append((0, first + count - p))
    transfers = []
    for chunk_index, chunk_count in pieces:
        offset = bounds[chunk_index][0]
        last = bounds[chunk_index + chunk_count - 1]
        transfers.append(Transfer(src, dst, offset, offset, last[0] + last[1] - offset, False))
    return transfers


# ----- composition (the builders assemble schedules from phases) ------------------------
def sequential(*phases: list[Step]) -> list[Step]:
    """Phases one after the other."""
    out: list[Step] = []
    for phase in phases:
        out.extend(phase)
    return out


def parallel(*phases: list[Step]) -> list[Step]:
    """Phases that run at the same time: step i of the result holds step i of each.

    The phases must touch disjoint buffer regions (their transfers are concurrent).
    """
    length = max((len(p) for p in phases), default=0)
    out = []
    for i in range(length):
        transfers: list[Transfer] = []
        for phase in phases:
            if i < len(phase):
                transfers.extend(phase[i].transfers)
        out.append(Step(tuple(transfers)))
    return out


def make_schedule(
    collective: str,
    algorithm: str,
    world_size: int,
    buffer_numel: int,
    steps: list[Step],
    root: int | None = None,
) -> Schedule:
    """Build, drop empty transfers and empty steps, and validate."""
    cleaned = []
    for step in steps:
        transfers = tuple(t for t in step.transfers if t.numel > 0)
        if transfers:
            cleaned.append(Step(transfers))
    return Schedule(collective, algorithm, world_size, buffer_numel, tuple(cleaned), root).validate()
