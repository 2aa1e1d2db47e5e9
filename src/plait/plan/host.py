"""The host the ranks run on, as the planner prices it: how many ranks share how many
cores, what that sharing does to every CPU-bound time, and what it adds to every
synchronising call.

Sharing. ``ranks`` processes of ``threads_per_rank`` threads on ``cores`` cores: when
all compute at once each thread gets

    share(ranks) = min(1, cores / (ranks · threads_per_rank))

of a core, so CPU-bound work (compute, and the per-call Python/software cost of every
collective and p2p call; on one host the shared-memory and gloo transports copy with
the CPU too) takes 1/share times its one-rank-alone time. A profile measured with all
p ranks running at once (``plait calibrate --compute`` and ``plait calibrate --nprocs
p``) already holds share(p): use it as it is for a world of p ranks, whatever the size
of the group it prices (a tp=2 group of a 4-rank world shares the cores with the other
group: its price is the 4-rank profile's). A profile measured at p0 ranks used for p
ranks is rescaled by ``cpu_time_scale(p0)`` = share(p0) / share(p), never silently
reused.

Waiting for the slowest. Time-slicing lets the ranks drift apart: after the same work
they reach a collective (or a pipeline receive) at different times, and the group
waits for the last. Per call on a group of ``size`` > 1 ranks after ``segment_s``
seconds of compute (priced with the sharing) since the group's previous
synchronisation, on top of the call's calibrated price (which ``plait calibrate``
measures back-to-back, i.e. at segment 0):

    wait(n, segment) = a_n + b_n · segment                        n a measured group size
    wait(n, segment) = (a_ref + b_ref · segment) · f(n) / f(n_ref)  any other size > 1
    f(n) = (n − 1) / (n + 1)
    wait(n, 0) = 0                                                  back-to-back calls

(a_n, b_n) are ``sync_wait_by_size``; (a_ref, b_ref) = (``sync_wait_s``,
``sync_wait_per_compute``) at n_ref = ``sync_group_size`` (0: all ``ranks``). f(n) is
twice the expected maximum minus the expected mean of n i.i.d. uniform lateness: the
group waits for its latest rank, and the latest of n grows with n. ``fit_sync_wait``
fits the terms per measured size from ``plait.bench.sync_drift``'s rows (and reports
how well f carries the largest size's terms to the others); nothing is assumed. With
no time-slicing (ranks·threads <= cores) there is no drift to wait for: ``for_ranks``
gives zero terms there and refuses to carry a fit to another time-sliced rank count
(the drift depends on the scheduler's slicing there; measure it).

``spare_cores`` (cores − ranks·threads, at least 0) says whether a rank's background
communication (plait's comm thread) can run beside its compute: with none spare it
takes its CPU time from the ranks' compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["HostModel", "SyncWaitFit", "fit_sync_wait", "lateness_factor", "sharing"]


def sharing(ranks: int, cores: int, threads_per_rank: int = 1) -> float:
    """The fraction of a core each thread gets with all ranks busy: min(1, cores / (ranks·threads))."""
    return min(1.0, cores / (ranks * threads_per_rank))


def lateness_factor(size: int) -> float:
    """f(n) = (n − 1) / (n + 1) = 2·(E[max] − E[mean]) of n i.i.d. uniform lateness on
    [0, 1] (E[max] = n/(n+1), E[mean] = 1/2); 0 for one rank. Only ratios are used."""
    return (size - 1) / (size + 1) if size > 1 else 0.0


@dataclass(frozen=True, kw_only=True)
class HostModel:
    """``ranks`` processes of ``threads_per_rank`` threads on ``cores`` cores, and the
    fitted wait for the slowest rank of a group per synchronising call (seconds, and
    seconds per second of compute since the group's previous synchronisation) at group
    size ``sync_group_size`` (0: ``ranks``); ``sync_wait_by_size``: ((size, a_s, b), ...)
    the terms fitted at each measured group size, used as they are at that size."""

    ranks: int
    cores: int
    threads_per_rank: int = 1
    sync_wait_s: float = 0.0
    sync_wait_per_compute: float = 0.0
    source: str = ""
    sync_group_size: int = 0
    sync_wait_by_size: tuple = ()

    def __post_init__(self) -> None:
        problems = []
        for key in ("ranks", "cores", "threads_per_rank"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{key}={value!r} must be a whole number >= 1")
        group = self.sync_group_size
        if isinstance(group, bool) or not isinstance(group, int) or group < 0 or group == 1:
            problems.append(f"sync_group_size={group!r} must be 0 (: ranks) or a whole number >= 2")
        elif isinstance(self.ranks, int) and group > self.ranks:
            problems.append(f"sync_group_size={group} > ranks={self.ranks}: a group is at most the world")
        for key in ("sync_wait_s", "sync_wait_per_compute"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                problems.append(f"{key}={value!r} must be a finite number >= 0")
        table = self.sync_wait_by_size  # a JSON round trip gives lists: held as a tuple of tuples
        table = tuple(tuple(entry) if isinstance(entry, (list, tuple)) else entry for entry in table) \
            if isinstance(table, (list, tuple)) else (table,)
        object.__setattr__(self, "sync_wait_by_size", table)
        for entry in table:
            if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], int)
                    and not isinstance(entry[0], bool) and 2 <= entry[0] <= (self.ranks if isinstance(self.ranks, int)
                                                                          else 0)
                    and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in entry[1:])):
                problems.append(f"sync_wait_by_size entry {entry!r} must be (size in [2, ranks], a_s >= 0, b >= 0)")
        if problems:
            raise ValueError("HostModel: " + "; ".join(problems))

    @property
    def oversubscribed(self) -> bool:
        """More runnable threads than cores: the ranks are time-sliced."""
        return self.ranks * self.threads_per_rank > self.cores

    @property
    def spare_cores(self) -> int:
        return max(self.cores - self.ranks * self.threads_per_rank, 0)

    @property
    def share(self) -> float:
        """The fraction of a core each rank's thread gets with all ranks busy."""
        return sharing(self.ranks, self.cores, self.threads_per_rank)

    def cpu_time_scale(self, measured_ranks: int, measured_threads_per_rank: int | None = None) -> float:
        """The factor turning a CPU-bound time measured with ``measured_ranks`` ranks (of
        ``measured_threads_per_rank`` threads; None: this host's) busy at once into this
        host's: share(measured) / share(ranks). 1 for a profile measured with this host's
        ranks (it already holds the sharing); 2 for a 2-rank profile used by 4 ranks on
        2 cores."""
        threads = self.threads_per_rank if measured_threads_per_rank is None else measured_threads_per_rank
        for key, value in (("measured_ranks", measured_ranks), ("measured_threads_per_rank", threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be a whole number >= 1")
        return sharing(measured_ranks, self.cores, threads) / self.share

    def for_ranks(self, ranks: int) -> "HostModel":
        """This host with ``ranks`` ranks: the same model for the same count; with no
        time-slicing at ``ranks`` (ranks·threads <= cores) zero wait terms; another
        time-sliced count is refused (the drift comes from the scheduler's slicing at
        that count: measure it there)."""
        if ranks == self.ranks:
            return self
        moved = replace(self, ranks=ranks, sync_group_size=0, sync_wait_s=0.0, sync_wait_per_compute=0.0,
                        sync_wait_by_size=(),
                        source=f"{ranks} ranks x {self.threads_per_rank} threads on {self.cores} cores: not "
                               "time-sliced, no drift to wait for")
        if moved.oversubscribed:
            raise ValueError(f"HostModel.for_ranks({ranks}): this model's wait is for {self.ranks} ranks; "
                             f"{ranks} ranks x {self.threads_per_rank} threads on {self.cores} cores are "
                             f"time-sliced differently: run `python -m plait.bench.sync_drift --nprocs {ranks}` and "
                             "fit_sync_wait its rows")
        return moved

    def wait_s(self, size: int, segment_s: float) -> float:
        """The wait for the slowest of ``size`` ranks at one synchronising call, after
        ``segment_s`` seconds of compute since the group last synchronised: a measured
        size's own terms, else the reference terms scaled by f(size) / f(n_ref). 0
        with no compute before the call (``segment_s`` <= 0: a call right after the
        group's previous one, which the link's back-to-back calibration already prices)."""
        if size <= 1 or segment_s <= 0:
            return 0.0
        for measured, a_s, b in self.sync_wait_by_size:
            if measured == size:
                return a_s + b * segment_s
        reference = self.sync_group_size or self.ranks
        scale = lateness_factor(size) / lateness_factor(reference) if reference > 1 else 1.0
        return (self.sync_wait_s + self.sync_wait_per_compute * segment_s) * scale


@dataclass(frozen=True, kw_only=True)
class SyncWaitFit:
    """``fit_sync_wait``'s answer. ``by_size``: {group size: (a_s, b)}, each size's own
    least-squares terms; ``sync_wait_s``, ``sync_wait_per_compute``: those of the
    largest size ``group_size``. ``residuals``: per point (group_size, segment_s CPU
    work, work_s compute with the sharing, measured wait, its size's fitted wait);
    ``scaled_residuals``: the same points against the largest size's terms scaled by
    f(n)/f(group_size) (how well the i.i.d.-lateness rule carries a fit to an unmeasured
    size); ``latency_s``: the segment-0 blocked time subtracted, per size;
    ``slowdown``: {segment_s: mean wall / mean CPU time of the segments} over the largest
    size's rows, the sharing as measured (1/share holds for segments the ranks spend
    mostly computing; short segments between frequent syncs run faster, the other ranks
    being blocked then)."""

    sync_wait_s: float
    sync_wait_per_compute: float
    group_size: int
    world_size: int
    threads_per_rank: int
    by_size: dict
    residuals: tuple[tuple[int, float, float, float, float], ...]
    scaled_residuals: tuple[tuple[int, float, float, float, float], ...]
    latency_s: dict
    slowdown: dict

    @property
    def rms_residual_s(self) -> float:
        return _rms(self.residuals)

    @property
    def scaled_rms_residual_s(self) -> float:
        return _rms(self.scaled_residuals)

    def host(self, cores: int, source: str = "") -> HostModel:
        """The HostModel of this fit for its world on a host of ``cores`` cores."""
        return HostModel(ranks=self.world_size, cores=cores, threads_per_rank=self.threads_per_rank,
                         sync_wait_s=self.sync_wait_s, sync_wait_per_compute=self.sync_wait_per_compute,
                         sync_group_size=self.group_size,
                         sync_wait_by_size=tuple((size, *terms) for size, terms in sorted(self.by_size.items())),
                         source=source or f"fit_sync_wait over {len(self.residuals)} points")

    def describe(self) -> str:
        lines = [f"sync wait, {self.world_size} ranks x {self.threads_per_rank} threads: "
                 + "; ".join(f"size {size}: a = {a_s * 1e3:.3f} ms, b = {b:.4f}"
                             for size, (a_s, b) in sorted(self.by_size.items()))
                 + f"; rms residual {self.rms_residual_s * 1e3:.3f} ms (size {self.group_size}'s terms scaled "
                 f"by f(n) to every size: {self.scaled_rms_residual_s * 1e3:.3f} ms); latency subtracted "
                 + ", ".join(f"size {size}: {value * 1e3:.3f} ms" for size, value in sorted(self.latency_s.items())),
                 f"  compute wall / CPU time (size {self.group_size}): "
                 + ", ".join(f"{segment * 1e3:g} ms CPU {ratio:.2f}x"
                             for segment, ratio in sorted(self.slowdown.items()))]
        lines += [f"  size {size} cpu {segment * 1e3:6.2f} ms  compute {work * 1e3:7.3f} ms  wait "
                  f"{wait * 1e3:7.3f} ms  fit {fitted * 1e3:7.3f} ms  scaled {scaled[4] * 1e3:7.3f} ms"
                  for (size, segment, work, wait, fitted), scaled in zip(self.residuals, self.scaled_residuals)]
        return "\n".join(lines)


def _rms(points) -> float:
    return math.sqrt(sum((wait - fitted) ** 2 for *_, wait, fitted in points) / len(points))


def fit_sync_wait(rows) -> SyncWaitFit:
    """Fit ``wait = a_n + b_n·x`` per group size n to ``plait.bench.sync_drift`` rows.

    Per group (its ``group_ranks``) and segment: x = mean over its ranks of ``work_s``
    (the compute with the sharing) and blocked = mean of ``blocked_s``; the group's
    blocked time at segment 0 is the call's own latency (what the link's calibration
    prices, back-to-back calls), so wait = blocked − latency at every segment > 0.
    (a_n, b_n) by least squares over size n's points, constrained to a, b >= 0 (a
    boundary refit with one term when the free fit makes the other negative)."""
    groups: dict[tuple, dict[float, list[dict]]] = {}
    world, threads = set(), set()
    for row in rows:
        groups.setdefault(tuple(row["group_ranks"]), {}).setdefault(float(row["segment_s"]), []).append(row)
        world.add(int(row["world_size"]))
        threads.add(int(row["threads"]))
    if len(world) != 1 or len(threads) != 1:
        raise ValueError(f"fit_sync_wait: rows from worlds {sorted(world)} with threads {sorted(threads)}: fit the "
                         "rows of one run (one world size, one thread count)")
    points, latency_by_size = [], {}
    for ranks, by_segment in groups.items():
        if 0.0 not in by_segment:
            raise ValueError(f"fit_sync_wait: group {list(ranks)} has no segment 0 (the call's own latency): "
                             "measure with 0 among segments_s")
        latency_s = sum(row["blocked_s"] for row in by_segment[0.0]) / len(by_segment[0.0])
        latency_by_size.setdefault(len(ranks), []).append(latency_s)
        for segment, found in sorted(by_segment.items()):
            if segment > 0:
                work_s = sum(row["work_s"] for row in found) / len(found)
                wait_s = sum(row["blocked_s"] for row in found) / len(found) - latency_s
                points.append((len(ranks), segment, work_s, wait_s))
    if not points:
        raise ValueError("fit_sync_wait: every row has segment_s 0 (the call's own latency): no segment > 0 to fit "
                         "the wait on; measure with segments_s holding 0 and at least two segments > 0")
    by_size = {}
    for size in sorted({point[0] for point in points}):
        mine = [(1.0, work_s, wait_s) for n, _, work_s, wait_s in points if n == size]
        if len({work_s for _, work_s, _ in mine}) < 2:
            raise ValueError(f"fit_sync_wait: group size {size} has < 2 distinct segments > 0: need two to "
                             "separate a from b")
        by_size[size] = _nonnegative_least_squares(mine)
    reference = max(by_size)
    a_ref, b_ref = by_size[reference]
    residuals = tuple((n, segment, work_s, wait_s, by_size[n][0] + by_size[n][1] * work_s)
                      for n, segment, work_s, wait_s in points)
    scaled = tuple((n, segment, work_s, wait_s,
                    (a_ref + b_ref * work_s) * lateness_factor(n) / lateness_factor(reference))
                   for n, segment, work_s, wait_s in points)
    largest = [row for row in rows if len(row["group_ranks"]) == reference and float(row["segment_s"]) > 0]
    slowdown = {segment: sum(row["work_s"] for row in largest if row["segment_s"] == segment)
                / sum(row["work_cpu_s"] for row in largest if row["segment_s"] == segment)
                for segment in sorted({float(row["segment_s"]) for row in largest})}
    return SyncWaitFit(sync_wait_s=a_ref, sync_wait_per_compute=b_ref, group_size=reference, world_size=world.pop(),
                       threads_per_rank=threads.pop(), by_size=by_size, residuals=residuals, scaled_residuals=scaled,
                       latency_s={size: sum(values) / len(values) for size, values in latency_by_size.items()},
                       slowdown=slowdown)


def _nonnegative_least_squares(points) -> tuple[float, float]:
    """min Σ (s·a + s·x·b − y)² over a, b >= 0 for points (s, x, y): the free normal
    equations, else the better of the two one-term fits (a = 0 or b = 0) clipped at 0
    (for two unknowns the constrained optimum is the free one or lies on an axis)."""
    suu = sum(s * s for s, _, _ in points)
    suv = sum(s * s * x for s, x, _ in points)
    svv = sum((s * x) ** 2 for s, x, _ in points)
    suy = sum(s * y for s, _, y in points)
    svy = sum(s * x * y for s, x, y in points)
    determinant = suu * svv - suv * suv
    if determinant > 1e-12 * suu * svv:
        a_s, b = (svv * suy - suv * svy) / determinant, (suu * svy - suv * suy) / determinant
        if a_s >= 0 and b >= 0:
            return a_s, b

    def cost(a_s: float, b: float) -> float:
        return sum((s * a_s + s * x * b - y) ** 2 for s, x, y in points)

    only_a = (max(suy / suu, 0.0), 0.0)
    only_b = (0.0, max(svy / svv, 0.0) if svv > 0 else 0.0)
    return min(only_a, only_b, key=lambda terms: cost(*terms))
