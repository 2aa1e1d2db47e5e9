"""Price a pipeline schedule from the schedule itself: plait's own builder
(``plait.parallel.pipeline.schedules``) makes the per-rank action lists for (p, m, v),
and a replay of them with the planner's costs gives the idle time and the
micro-batches in flight.

Costs. One rank's work for one micro-batch is 1 unit, split as the planner's per-stage
estimate splits it: forward f, backward b (input gradient) and, for a split backward
(zero_bubble), weight gradient w; f + b + w = 1, each rounded to 1/24 (so a search
replays a schedule for few cost ratios). An interleaved rank's chunk costs 1/v of that;
a Chimera rank runs a whole stage per micro-batch on one of its two replicas. The replay
is the library's, ``plait.parallel.pipeline.replay`` (the one the engine's tests check
real runs against): sends cost nothing and never block, a receive waits for its send,
collectives at the end cost nothing here.

Result (``SchedulePrice``): idle_units = makespan - m (each rank is busy m units), so
with the planner's per-rank times t_r (slowest t_max) the pipeline takes
T = m·t_max + idle_units·(Σ t_r - t_max)/(p-1): the fill and drain pass the other
stages. For GPipe and 1F1B idle_units = p-1, which is Alpa's Σ t_r + (m-1)·max t_r and,
for equal stages, DESIGN §6's bubble (p-1)/(m+p-1); interleaved gives (p-1)/v; Chimera
and zero_bubble what their builders' orders give. Peaks: per rank and per chunk the
most micro-batches whose forward has run and whose activations are not yet freed (by B,
or by W for a split backward).

Cost of pricing. A schedule with m <= m2 is replayed at m. Beyond, it is replayed at
m1 < m2, the two smallest valid m >= 2p, where GPipe, 1F1B, interleaved and
zero_bubble are in their steady state, and idle time and peaks are extrapolated
linearly in m (the tests check this against full replays). Chimera is not: its builder
picks forward- or backward-first per m, so its peaks jump (5 or m-1 at p = 4); it is
always replayed at m, up to 2·m·p = ``MAX_CHIMERA_COMPUTE`` computations. GPipe, 1F1B and interleaved schedules larger than
``REPLAY_COMPUTE_LIMIT`` computations use their closed forms, which the tests check
equal the replay. Chimera and zero_bubble are built by list scheduling, O(p³m²): the
planner offers them up to pp = ``MAX_LIST_SCHEDULED_PP``. Everything is cached per
(schedule, p, m, v) and cost ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plait.names.schedules import CHIMERA, GPIPE, INTERLEAVED_1F1B, ONE_F_ONE_B
from plait.parallel.pipeline.replay import peak_in_flight, peak_in_flight_per_chunk, replay, validate_structure
from plait.parallel.pipeline.schedules import LIST_SCHEDULED, PipelineSchedule, build

__all__ = ["LIST_SCHEDULED", "MAX_LIST_SCHEDULED_PP", "REPLAY_COMPUTE_LIMIT", "RATIO_STEPS", "SchedulePrice",
           "schedule_problem", "price_schedule", "cost_units", "stats"]

MAX_LIST_SCHEDULED_PP = 8
MAX_CHIMERA_COMPUTE = 256  # 2·m·p: Chimera is replayed at m itself (its order is not periodic in m)
REPLAY_COMPUTE_LIMIT = 1024  # computations (F, B, W over all ranks) of the largest schedule replayed
RATIO_STEPS = 24  # 1/2, 1/3, 1/4, 1/6, 1/8 exact

_COUNTS = {"builds": 0, "replays": 0}


@dataclass(frozen=True)
class SchedulePrice:
    """One schedule at (p, m, v) and a cost ratio: idle units (makespan - m, in units of a
    rank's time per micro-batch), per rank the peak micro-batches in flight (in units of the
    rank's whole share: chunk-micro-batches / v) and per chunk the peak count (None for a
    closed form that does not know it), and how it was obtained."""

    name: str
    ranks: int
    microbatches: int
    virtual: int
    idle_units: float
    peak_units: tuple[float, ...]
    peak_per_chunk: tuple[tuple[float, ...], ...] | None
    source: str  # "replay m=..", "extrapolated from m=.., .." or "closed form"

    def bubble_fraction(self) -> float:
        """Idle share of the step with equal stages: idle / (m + idle)."""
        return self.idle_units / (self.microbatches + self.idle_units)


def schedule_problem(name: str, p: int, m: int, v: int) -> str | None:
    """Why the planner cannot use schedule ``name`` at (p, m, v), in the builder's words
    where the builder has a rule, or None."""
    if name in LIST_SCHEDULED and p > MAX_LIST_SCHEDULED_PP:
        return (f"{name} is built by list scheduling (O(p^3 m^2)); the planner prices it up to "
                f"pp={MAX_LIST_SCHEDULED_PP}, got pp={p}")
    if name == CHIMERA and 2 * m * p > MAX_CHIMERA_COMPUTE and not (p % 2 or m % 2):
        return (f"chimera is replayed at m itself (its builder picks forward- or backward-first per m, so its "
                f"peaks do not extrapolate); the planner builds it up to 2·m·pp = {MAX_CHIMERA_COMPUTE} "
                f"computations, got m={m}, pp={p}")
    if name == CHIMERA and (p % 2 or m % 2):
        try:  # the builder checks these before any scheduling: cheap
            build(CHIMERA, p, m)
        except ValueError as error:
            return str(error)
    if name == INTERLEAVED_1F1B and m % p:
        return f"{INTERLEAVED_1F1B} needs num_microbatches({m}) to be a multiple of pp({p})"
    return None


def cost_units(forward: float, backward: float, weight: float, split: bool) -> tuple[int, int, int]:
    """(f, b, w) in 1/RATIO_STEPS of their sum, summing to RATIO_STEPS; a backward that is
    not split is b + w with w = 0 (so the ratio, and the cache key, has one fewer part)."""
    total = forward + backward + weight
    if total <= 0:
        return (RATIO_STEPS // 3, RATIO_STEPS - RATIO_STEPS // 3, 0)
    f = min(RATIO_STEPS - 1, max(1, round(RATIO_STEPS * forward / total)))
    if not split:
        return (f, RATIO_STEPS - f, 0)
    w = min(RATIO_STEPS - f - 1, max(0, round(RATIO_STEPS * weight / total)))
    return (f, RATIO_STEPS - f - w, w)


def _base(name: str, p: int, v: int) -> tuple[int, int]:
    """m1 < m2: the two smallest valid micro-batch counts >= 2p."""
    step = p if name == INTERLEAVED_1F1B else 2 if name == CHIMERA else 1
    first = -(-2 * p // step) * step
    return first, first + step


@lru_cache(maxsize=256)
def _built(name: str, p: int, m: int, v: int) -> tuple[PipelineSchedule, tuple, tuple]:
    """plait's own schedule ``name`` at (p, m, v), checked by the library's validator once,
    and its peaks (which depend on the order alone, not on the costs): per rank the peak
    chunk-micro-batches in flight, and per rank per chunk."""
    _COUNTS["builds"] += 1
    schedule = build(name, p, m, v if name == INTERLEAVED_1F1B else None)
    validate_structure(schedule)
    return schedule, tuple(peak_in_flight(schedule)), tuple(peak_in_flight_per_chunk(schedule))


@lru_cache(maxsize=4096)
def _replay(name: str, p: int, m: int, v: int, units: tuple[int, int, int]) -> tuple[float, tuple, tuple]:
    """(makespan in units, per-rank peak chunk-micro-batches, per-rank per-chunk peaks):
    the library's replay (``plait.parallel.pipeline.replay``) with forward f, backward
    b + w and, for a split backward, W w, in 1/RATIO_STEPS."""
    schedule, peaks, per_chunk = _built(name, p, m, v)
    _COUNTS["replays"] += 1
    f, b, w = units
    timeline = replay(schedule, forward=f, backward=b + w, weight=w, check=False)  # _built validated it
    return timeline.makespan_s / RATIO_STEPS, peaks, per_chunk


def _closed_form(name: str, p: int, m: int, v: int) -> SchedulePrice:
    """GPipe, 1F1B, interleaved (DESIGN §6) and their in-flight counts as plait builds them."""
    if name == GPIPE:
        return SchedulePrice(name, p, m, v, float(p - 1), (float(m),) * p, tuple((float(m),) for _ in range(p)),
                             "closed form")
    if name == ONE_F_ONE_B:
        peaks = tuple(float(min(m, p - r)) for r in range(p))
        return SchedulePrice(name, p, m, v, float(p - 1), peaks, tuple((x,) for x in peaks), "closed form")
    units = [m * v if m == p else min(m * v, (p - r - 1) * 2 + (v - 1) * p + 1) for r in range(p)]
    per_chunk = tuple((float(m),) * v for _ in range(p)) if m == p else None
    return SchedulePrice(name, p, m, v, (p - 1) / v, tuple(u / v for u in units), per_chunk, "closed form")


@lru_cache(maxsize=8192)
def price_schedule(name: str, p: int, m: int, v: int = 1, units: tuple[int, int, int] = (8, 16, 0)) -> SchedulePrice:
    """The schedule ``name`` (``plait.names.schedules``: gpipe, 1f1b, interleaved_1f1b,
    chimera, zero_bubble) at p ranks, m micro-batches, v chunks per rank, priced with cost
    ``units`` (``cost_units``); see the module docstring."""
    problem = schedule_problem(name, p, m, v)
    if problem:
        raise ValueError(problem)
    m1, m2 = _base(name, p, v)
    if name not in LIST_SCHEDULED and 2 * min(m, m2) * v * p > REPLAY_COMPUTE_LIMIT:
        return _closed_form(name, p, m, v)
    if m <= m2 or name == CHIMERA:
        makespan, peaks, per_chunk = _replay(name, p, m, v, units)
        return SchedulePrice(name, p, m, v, makespan - m, tuple(x / v for x in peaks),
                             tuple(tuple(float(c) for c in row) for row in per_chunk), f"replay m={m}")
    low, high = _replay(name, p, m1, v, units), _replay(name, p, m2, v, units)

    def line(y1: float, y2: float) -> float:
        return y2 + (y2 - y1) * (m - m2) / (m2 - m1)

    idle = line(low[0] - m1, high[0] - m2)
    peaks = tuple(line(a, c) / v for a, c in zip(low[1], high[1]))
    per_chunk = tuple(tuple(line(a, c) for a, c in zip(ra, rc)) for ra, rc in zip(low[2], high[2]))
    return SchedulePrice(name, p, m, v, idle, peaks, per_chunk, f"extrapolated from m={m1}, {m2}")


def stats() -> dict[str, int]:
    """How many schedules were built and replayed in this process (the caches' misses)."""
    return dict(_COUNTS)
