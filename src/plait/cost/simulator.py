"""Replay a schedule on a topology: flow-level, contention-aware, bulk-synchronous.

Each step's transfers start together as flows on their routes and share links max-min
fairly (``plait.cost.flows``). A flow of n bytes lands at

    path latency + the time its n bytes take at its (changing) fair rate,

a rank that receives reducing flows reduces after the last of them lands, for
gamma_rank x (bytes it reduces), and the step ends when every flow has landed and
every reduction is done; the next step starts then. On a uniform topology (one port
of bandwidth 1/beta per device into a non-blocking switch, path latency alpha) a step
costs alpha + beta max(bytes a port moves) + gamma max(bytes a rank reduces): the
alpha-beta model's step cost, which the tests check.

Speed: steps with the same (src, dst, numel, reduce) signature (a ring's steps, the
rounds of a butterfly) are solved once; a solve is numpy over the step's flows.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from plait.cost.flows import transmit

__all__ = ["simulate", "SimulationResult", "CriticalStep", "LinkLoad"]

# Byte counts go through float64: beyond 2**53 they stop being exact.
MAX_NBYTES = 1 << 53
_CACHE_STEPS = 512


@dataclass(frozen=True, kw_only=True)
class CriticalStep:
    """The transfer that finished last in a step: it lands ``transfer_s`` after the step
    starts, its receiver then reduces for ``reduce_s``; ``bottleneck_link`` is the
    directed link that limited its rate longest."""

    step: int
    src_rank: int
    dst_rank: int
    nbytes: int
    time_s: float
    transfer_s: float
    reduce_s: float
    bottleneck_link: int


@dataclass(frozen=True, kw_only=True)
class LinkLoad:
    """A directed link's traffic over a whole simulation."""

    link: int
    name: str
    nbytes: float
    utilisation: float


@dataclass(frozen=True, kw_only=True, eq=False)
class SimulationResult:
    """Total and per-step times, bytes per directed link and the critical path.

    utilisation of a link = its bytes / (its capacity x total time): 1.0 means it was
    busy for the whole collective.
    """

    collective: str
    algorithm: str
    world_size: int
    itemsize: int
    total_time_s: float
    step_times_s: np.ndarray
    link_bytes: np.ndarray
    critical_path: tuple[CriticalStep, ...]
    topology: object = field(repr=False)

    @property
    def utilisation(self) -> np.ndarray:
        if self.total_time_s <= 0:
            return np.zeros_like(self.link_bytes)
        return self.link_bytes / (np.asarray(self.topology.capacity_bytes_per_s) * self.total_time_s)

    def busiest_links(self, count: int = 1) -> list[LinkLoad]:
        """The ``count`` directed links with the highest utilisation."""
        utilisation = self.utilisation
        order = np.argsort(-utilisation, kind="stable")[:count]
        return [LinkLoad(link=int(i), name=self.topology.link_name(int(i)), nbytes=float(self.link_bytes[i]),
                         utilisation=float(utilisation[i])) for i in order]

    def critical_links(self) -> list[tuple[str, int, float]]:
        """(link name, critical steps it bottlenecked, their share of the total time),
        most time first."""
        time_by_link: dict[int, list] = {}
        for step in self.critical_path:
            entry = time_by_link.setdefault(step.bottleneck_link, [0, 0.0])
            entry[0] += 1
            entry[1] += step.time_s
        total = self.total_time_s or 1.0
        rows = [(self.topology.link_name(link) if link >= 0 else "(latency only)", count, spent / total)
                for link, (count, spent) in time_by_link.items()]
        return sorted(rows, key=lambda row: -row[2])

    def critical_summary(self) -> str:
        """One line: which link bottlenecks the critical path most of the time."""
        if not self.critical_path:
            return "no steps"
        name, count, share = self.critical_links()[0]
        return f"{name} in {count}/{len(self.critical_path)} steps ({share:.0%} of the time)"

    def as_dict(self, top_links: int = 5) -> dict:
        return {
            "collective": self.collective, "algorithm": self.algorithm, "world_size": self.world_size,
            "itemsize": self.itemsize, "time_s": self.total_time_s, "steps": len(self.step_times_s),
            "busiest_links": [vars(load) for load in self.busiest_links(top_links)],
            "critical_links": [{"link": n, "steps": c, "time_share": s} for n, c, s in self.critical_links()[:top_links]],
        }


@dataclass
class _StepSolution:
    time_s: float
    critical: tuple  # (src, dst, nbytes, transfer_s, reduce_s, bottleneck_link)
    link_ids: np.ndarray
    link_bytes: np.ndarray


def _signature(transfers) -> np.ndarray:
    """(src, dst, numel, reduce) of each transfer as an int64 (F, 4) array: one
    np.fromiter per field is ~3x faster than building a list of tuples."""
    count = len(transfers)
    rows = np.empty((count, 4), dtype=np.int64)
    try:
        for column, name in enumerate(("src", "dst", "numel", "reduce")):
            rows[:, column] = np.fromiter(map(attrgetter(name), transfers), dtype=np.int64, count=count)
    except OverflowError:
        raise ValueError("a transfer's numel does not fit in 64 bits; the simulator handles "
                         f"messages up to {MAX_NBYTES} bytes") from None
    return rows


def _solve_step(rows: np.ndarray, topology, itemsize: int, gamma: np.ndarray) -> _StepSolution:
    src, dst, numel, reduce = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3].astype(bool)
    nbytes = numel.astype(np.float64) * itemsize
    paths = [topology.route(s, d) for s, d in zip(src.tolist(), dst.tolist())]
    lengths = np.fromiter(map(len, paths), dtype=np.int64, count=len(paths))
    if (lengths == 0).any():
        bad = int(np.flatnonzero(lengths == 0)[0])
        raise ValueError(f"transfer {int(src[bad])} -> {int(dst[bad])} has no route: both ranks are one device; "
                         "a schedule's transfers go between different ranks")
    ptr = np.zeros(len(paths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=ptr[1:])
    entries = np.fromiter(itertools.chain.from_iterable(paths), dtype=np.int64, count=int(ptr[-1]))
    link_ids, local = np.unique(entries, return_inverse=True)
    capacity = np.asarray(topology.capacity_bytes_per_s)[link_ids]
    finish, bottleneck = transmit(ptr, local, nbytes, capacity)
    arrival = finish + np.add.reduceat(np.asarray(topology.latency_s)[entries], ptr[:-1])
    # reductions: a rank starts after its last reducing flow lands
    world = gamma.shape[0]
    reduced = np.bincount(dst[reduce], weights=nbytes[reduce], minlength=world)
    last_reducing = np.full(world, -np.inf)
    np.maximum.at(last_reducing, dst[reduce], arrival[reduce])
    reduce_s = reduced * gamma
    done = last_reducing + reduce_s
    flow_last = int(np.argmax(arrival))
    rank_last = int(np.argmax(done))
    if done[rank_last] > arrival[flow_last]:
        into = np.flatnonzero(reduce & (dst == rank_last))
        flow, step_time, red = int(into[np.argmax(arrival[into])]), float(done[rank_last]), float(reduce_s[rank_last])
    else:
        flow, step_time, red = flow_last, float(arrival[flow_last]), 0.0
    entry_flow = np.repeat(np.arange(len(paths)), lengths)
    per_link = np.bincount(local, weights=nbytes[entry_flow], minlength=link_ids.shape[0])
    critical = (int(src[flow]), int(dst[flow]), int(numel[flow]) * itemsize, float(arrival[flow]), red,
                int(link_ids[bottleneck[flow]]) if bottleneck[flow] >= 0 else -1)
    return _StepSolution(step_time, critical, link_ids, per_link)


def simulate(schedule, topology, itemsize: int) -> SimulationResult:
    """Replay ``schedule`` (anything with ``world_size`` and ``steps``, each with
    ``transfers`` of ``src, dst, numel, reduce``) on ``topology`` with elements of
    ``itemsize`` bytes; rank r runs on the topology's r-th allocated device."""
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"itemsize={itemsize!r} must be a whole number of bytes >= 1 (4 for float32)")
    world = int(schedule.world_size)
    if world != topology.world_size:
        raise ValueError(
            f"the schedule is for {world} ranks but topology {topology.name!r} allocates {topology.world_size} "
            f"devices; allocate {world} (allocation='...') or build the schedule for {topology.world_size}")
    numel = getattr(schedule, "buffer_numel", None)
    if numel is not None and numel * itemsize > MAX_NBYTES:
        raise ValueError(f"buffer of {numel} x {itemsize} bytes is more than the simulator's {MAX_NBYTES} bytes "
                         "(2**53, where float64 byte counts stop being exact); simulate a smaller size")
    gamma = np.array([topology.gamma_s_per_byte(r) for r in range(world)])
    cache: dict[bytes, _StepSolution] = {}
    step_times: list[float] = []
    critical: list[CriticalStep] = []
    link_bytes = np.zeros(topology.num_directed_links)
    for index, step in enumerate(schedule.steps):
        transfers = step.transfers
        if not hasattr(transfers, "__len__"):
            transfers = tuple(transfers)
        if not transfers:
            step_times.append(0.0)
            continue
        rows = _signature(transfers)
        key = rows.tobytes()
        solution = cache.get(key)
        if solution is None:
            solution = _solve_step(rows, topology, itemsize, gamma)
            if len(cache) >= _CACHE_STEPS:
                cache.pop(next(iter(cache)))
            cache[key] = solution
        step_times.append(solution.time_s)
        link_bytes[solution.link_ids] += solution.link_bytes
        s, d, nbytes, transfer_s, reduce_s, link = solution.critical
        critical.append(CriticalStep(step=index, src_rank=s, dst_rank=d, nbytes=nbytes, time_s=solution.time_s,
                                     transfer_s=transfer_s, reduce_s=reduce_s, bottleneck_link=link))
    times = np.array(step_times)
    total = math.fsum(step_times)
    return SimulationResult(
        collective=getattr(schedule, "collective", "?"), algorithm=getattr(schedule, "algorithm", "?"),
        world_size=world, itemsize=itemsize, total_time_s=total, step_times_s=times, link_bytes=link_bytes,
        critical_path=tuple(critical), topology=topology)
