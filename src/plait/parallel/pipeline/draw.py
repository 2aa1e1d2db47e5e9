"""Draw a pipeline timeline as a Gantt chart (ASCII rows or a PNG), store recorded
timelines as JSON, and the closed-form bubble and in-flight numbers to hold them against.

Input is a ``Timeline`` (``plait.parallel.pipeline.replay``): the unit-cost replay of a
schedule (forward 1, backward 2, each divided by v for interleaved chunks) or a real
run (``source="measured"``, times in seconds). Rows are ranks, top to bottom; the
bubble of rank r is 1 - busy_r / makespan, idle time shown as '.' (ASCII) or hatched
grey (PNG).

Formulas (p pipeline ranks, m micro-batches, v chunks per rank, r the rank):

- GPipe, 1F1B: bubble (p-1)/(m+p-1). In flight: GPipe m on every rank, 1F1B min(p-r, m).
- Interleaved 1F1B: bubble time (p-1)/v of a full forward+backward stage time, so
  fraction ((p-1)/v) / (m + (p-1)/v). In flight, counted in chunks of 1/v stage:
  Megatron's warm-up w_r = 2(p-r-1) + (v-1)p forwards, then one-forward-one-backward,
  so min(w_r + 1, m·v); m = p has no steady phase: m·v.
- Chimera (Li & Hoefler 2021): bubble (p-2)/(2m+p-2). Two 1F1B pipelines of m/2
  micro-batches merged: rank r holds stage r of "down" and stage p-1-r of "up", so
  min(p-r, m/2) + min(r+1, m/2) in flight, the paper's (p/2+1)..p at m = p. For
  m > p the paper concatenates basic units and gives no closed form: "n/a".
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from plait.names.schedules import GPIPE, INTERLEAVED_1F1B, ONE_F_ONE_B, ZERO_BUBBLE
from plait.parallel.pipeline.replay import Interval, Timeline
from plait.parallel.pipeline.schedules import BACKWARD, FORWARD, SCHEDULES, WEIGHT, PipelineSchedule

UNIT_COSTS = "unit costs"  # Timeline.source of the replay; anything else is a real run in seconds
JSON_FORMAT = "plait.pipeline.timeline"
JSON_VERSION = 1
_EXACT_MAX_COLUMNS = 400  # a unit-cost grid wider than this is quantised like a real run
_DEFAULT_COLUMNS = 80
_LABEL = re.compile(r"^[FB]\d+(?:\.(\d+))?$")  # F3, B3, F3.1 (chunk 1)


# ----- ASCII -------------------------------------------------------------------------------
def _grid(timeline: Timeline, width: int | None) -> tuple[float, float, int]:
    """(t0_s, column_s, columns): with ``width`` None, the exact grid of a timeline whose
    times are whole multiples of (shortest interval)/k, k <= 12, at most 400 columns (any
    unit-cost replay); else ``width`` (default 80) equal columns over the step."""
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        raise ValueError(f"width must be an int >= 1 (time columns), got {width!r}")
    if not timeline.intervals:
        return 0.0, 1.0, 0
    t0_s = min(i.start_s for i in timeline.intervals)
    span_s = timeline.makespan_s
    if width is None and span_s > 0:
        quantum = min(i.end_s - i.start_s for i in timeline.intervals)
        for divisor in range(1, 13):  # quantum/divisor: e.g. v=3 chunks cost 1/3 and 2/3
            column_s = quantum / divisor
            if column_s <= 0 or span_s / column_s > _EXACT_MAX_COLUMNS:
                break
            edges = [(t - t0_s) / column_s for i in timeline.intervals for t in (i.start_s, i.end_s)]
            if all(abs(edge - round(edge)) < 1e-6 for edge in edges):
                return t0_s, column_s, round(span_s / column_s)
    width = width or _DEFAULT_COLUMNS
    return t0_s, (span_s / width) if span_s > 0 else 1.0, width


def _columns(timeline: Timeline, t0_s: float, column_s: float, columns: int) -> list[list[int | None]]:
    """Per rank and column, the index of the interval covering most of the column, or
    None (idle) where all busy time together covers less than half of it."""
    best: dict[tuple[int, int], tuple[float, int]] = {}
    busy_s: dict[tuple[int, int], float] = {}
    for index, interval in enumerate(timeline.intervals):
        first = max(0, math.floor((interval.start_s - t0_s) / column_s + 1e-9))
        last = min(columns, math.ceil((interval.end_s - t0_s) / column_s - 1e-9))
        for column in range(first, last):
            lo, hi = t0_s + column * column_s, t0_s + (column + 1) * column_s
            overlap = min(hi, interval.end_s) - max(lo, interval.start_s)
            key = (interval.rank, column)
            busy_s[key] = busy_s.get(key, 0.0) + max(overlap, 0.0)
            if overlap > best.get(key, (0.0, -1))[0]:
                best[key] = (overlap, index)
    grid: list[list[int | None]] = [[None] * columns for _ in range(timeline.ranks)]
    for (rank, column), (_, index) in best.items():
        if busy_s[(rank, column)] >= column_s / 2 - 1e-12 and 0 <= rank < timeline.ranks:
            grid[rank][column] = index
    return grid


def _cell(kind: str, microbatch: int, span: int, digits: int) -> str:
    """Text of one run of ``span`` columns, each digits+1 wide: forward ' 3' per column,
    backward bracketed over the run, '[33]' for two columns."""
    number = str(microbatch)
    if kind == WEIGHT:  # the weight-gradient half of a split backward: braces
        length = span * (digits + 1)
        if length < len(number) + 2:
            return ("{" + number).rjust(length)[:length]
        return "{" + number.rjust(digits).center(length - 2) + "}"
    if kind != BACKWARD:
        return (" " + number.rjust(digits)) * span
    length = span * (digits + 1)
    if length < len(number) + 2:
        return ("[" + number).rjust(length)[:length]
    inner = length - 2
    return "[" + (number * inner if digits == 1 else number.rjust(digits).center(inner)) + "]"


def ascii_gantt(timeline: Timeline, width: int | None = None) -> list[str]:
    """One row per rank: 'rank r |' then one cell per time column (see ``ascii_legend``).
    A unit-cost timeline uses its exact grid (one column = the shortest cost); a real
    run is quantised into ``width`` columns (default 80), a column showing the
    computation covering most of it; '.' where less than half of it is busy."""
    t0_s, column_s, columns = _grid(timeline, width)
    grid = _columns(timeline, t0_s, column_s, columns)
    digits = len(str(max((i.microbatch for i in timeline.intervals), default=0)))
    label_width = len(str(max(timeline.ranks - 1, 0)))
    rows = []
    for rank, owners in enumerate(grid):
        cells, column = [], 0
        while column < columns:
            owner, start = owners[column], column
            while column < columns and owners[column] == owner:
                column += 1
            if owner is None:
                cells.append((" " * digits + ".") * (column - start))
            else:
                interval = timeline.intervals[owner]
                cells.append(_cell(interval.kind, interval.microbatch, column - start, digits))
        rows.append(f"rank {str(rank).rjust(label_width)} |{''.join(cells)}|")
    return rows


def time_unit(timeline: Timeline) -> tuple[str, float]:
    """(unit name, factor from the timeline's times): unit costs as they are, a real run in ms."""
    return ("time units", 1.0) if timeline.source == UNIT_COSTS else ("ms", 1e3)


def ascii_legend(timeline: Timeline, width: int | None = None) -> str:
    """What one column is and how forward, backward and idle cells read."""
    _, column_s, _ = _grid(timeline, width)
    unit, factor = time_unit(timeline)
    digits = len(str(max((i.microbatch for i in timeline.intervals), default=0)))
    forward, backward = _cell(FORWARD, 3, 1, digits).strip(), _cell(BACKWARD, 3, 2, digits)
    amount = column_s * factor
    if unit == "time units" and amount == 1:
        unit = "time unit"
    split = any(interval.kind == WEIGHT for interval in timeline.intervals)
    weight = f", '{_cell(WEIGHT, 3, 1, digits).strip()}' its weight-gradient pass (braced)" if split else ""
    return (f"one column = {amount:.4g} {unit}; '{forward}' forward of micro-batch 3, "
            f"'{backward}' its backward (bracketed over its columns){weight}, '.' idle (bubble)")


# ----- PNG ---------------------------------------------------------------------------------
def _chunk(interval: Interval) -> int:
    match = _LABEL.match(interval.label)
    return int(match.group(1)) if match and match.group(1) else 0


def _shade(hex_colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Chunk 0 in the full colour, later chunks mixed towards white (up to 55 %)."""
    rgb = [int(hex_colour[k:k + 2], 16) / 255 for k in (1, 3, 5)]
    mix = 0.55 * chunk / max(chunks - 1, 1)
    return tuple(c + (1 - c) * mix for c in rgb)


_COLOURS = {FORWARD: "#3f7fd0", BACKWARD: "#e0772e", WEIGHT: "#4a9c5d"}


def plot_gantt(timeline: Timeline, path, title: str, chunk_names: list[str] | None = None) -> Path:
    """Write the timeline as a PNG Gantt chart: rank rows top to bottom, forwards blue,
    backwards orange (later chunks lighter), micro-batch numbers in boxes wide enough,
    idle time hatched grey with each rank's bubble share on the right."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state (Agg canvas)
    from matplotlib.patches import Patch

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"plot path must end in .png, got {str(path)!r}")
    unit, factor = time_unit(timeline)
    t0_s = min((i.start_s for i in timeline.intervals), default=0.0)
    span = timeline.makespan_s * factor or 1.0
    shortest = min((i.end_s - i.start_s for i in timeline.intervals), default=1.0) * factor or span
    # the shortest box gets >= ~14 pt of axes width, within 8..24 inches of figure
    width_in = min(24.0, max(8.0, 14 * span / shortest / 72 + 2.5))
    height_in = 1.75 + 0.55 * timeline.ranks
    fig = Figure(figsize=(width_in, height_in), dpi=120)
    ax = fig.add_axes((1.0 / width_in, 1.0 / height_in, 1 - 2.1 / width_in, 1 - 1.5 / height_in))
    chunks = 1 + max((_chunk(i) for i in timeline.intervals), default=0)
    axes_width_pt = (1 - 2.1 / width_in) * width_in * 72
    digits = len(str(max((i.microbatch for i in timeline.intervals), default=0)))
    for rank in range(timeline.ranks):
        ax.barh(rank, span, left=0, height=0.8, color="#f3f3f3", hatch="///", edgecolor="#c8c8c8", linewidth=0)
        ax.text(span * 1.01, rank, f"idle {timeline.bubble_fraction(rank):.1%}", va="center", fontsize=8)
    for interval in timeline.intervals:
        start, length = (interval.start_s - t0_s) * factor, (interval.end_s - interval.start_s) * factor
        colour = _shade(_COLOURS.get(interval.kind, "#888888"), _chunk(interval), chunks)
        ax.barh(interval.rank, length, left=start, height=0.8, color=colour, edgecolor="white", linewidth=0.8)
        number = str(interval.microbatch)
        fontsize = 8 if timeline.ranks <= 16 else 6
        if length / span * axes_width_pt >= 0.62 * fontsize * digits + 2:  # widest number: all or none alike
            luminance = 0.299 * colour[0] + 0.587 * colour[1] + 0.114 * colour[2]
            ax.text(start + length / 2, interval.rank, number, ha="center", va="center", fontsize=fontsize,
                    color="white" if luminance < 0.6 else "black")
    ax.set_xlim(0, span)
    ax.set_ylim(timeline.ranks - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(timeline.ranks), [f"rank {r}" for r in range(timeline.ranks)])
    ax.set_xlabel(f"time ({UNIT_COSTS})" if unit == "time units" else "time (ms)")
    ax.set_title(title, fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    names = chunk_names or [f"chunk {c}" for c in range(chunks)]
    handles = [Patch(color=_shade(_COLOURS[kind], c, chunks), label=f"{word}" + (f" ({names[c]})" if chunks > 1
                     else "")) for kind, word in ((FORWARD, "forward"), (BACKWARD, "backward"), (WEIGHT, "weight grad"))
               if kind != WEIGHT or any(i.kind == WEIGHT for i in timeline.intervals) for c in range(chunks)]
    handles.append(Patch(facecolor="#f3f3f3", hatch="///", edgecolor="#c8c8c8", label="idle (bubble)"))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.02), ncol=len(handles), fontsize=8,
               frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


# ----- recorded timelines ------------------------------------------------------------------
def timeline_to_json(timeline: Timeline, meta: dict | None = None) -> dict:
    """A JSON-ready dict of the timeline (times in seconds as recorded); ``meta`` may name
    the run, e.g. {"schedule": "1f1b", "microbatches": 8, "virtual": 1}."""
    return {"format": JSON_FORMAT, "version": JSON_VERSION, "ranks": timeline.ranks, "source": timeline.source,
            "meta": dict(meta or {}),
            "intervals": [{"rank": i.rank, "label": i.label, "kind": i.kind, "microbatch": i.microbatch,
                           "start_s": i.start_s, "end_s": i.end_s} for i in timeline.intervals]}


def timeline_from_json(document: dict) -> Timeline:
    """The Timeline ``timeline_to_json`` wrote; ValueError naming the first bad field."""
    if not isinstance(document, dict) or document.get("format") != JSON_FORMAT:
        raise ValueError(f"not a pipeline timeline: expected \"format\": \"{JSON_FORMAT}\" (written by "
                         "plait.parallel.pipeline.draw.timeline_to_json)")
    ranks = document.get("ranks")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"timeline \"ranks\" must be an int >= 1, got {ranks!r}")
    intervals = []
    for n, item in enumerate(document.get("intervals") or []):
        try:
            interval = Interval(rank=int(item["rank"]), label=str(item["label"]), kind=str(item["kind"]),
                                microbatch=int(item["microbatch"]), start_s=float(item["start_s"]),
                                end_s=float(item["end_s"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"timeline interval {n} ({item!r}) needs rank, label, kind, microbatch, start_s, "
                             f"end_s: {error}") from None
        if not 0 <= interval.rank < ranks:
            raise ValueError(f"timeline interval {n}: rank {interval.rank} is outside 0..{ranks - 1}")
        if interval.kind not in (FORWARD, BACKWARD, WEIGHT):
            raise ValueError(f"timeline interval {n}: kind {interval.kind!r} must be 'F', 'B' or 'W'")
        if not interval.end_s >= interval.start_s:
            raise ValueError(f"timeline interval {n}: end_s {interval.end_s} < start_s {interval.start_s}")
        intervals.append(interval)
    return Timeline(ranks=ranks, intervals=tuple(intervals), source=str(document.get("source", "measured")))


def with_chunk_labels(timeline: Timeline, schedule: PipelineSchedule) -> Timeline:
    """The replay's timeline of ``schedule`` with chunk suffixes (F3.1) on ranks that hold
    several chunks; the replay records each rank's computations in list order."""
    by_rank: dict[int, list[Interval]] = {}
    for interval in timeline.intervals:
        by_rank.setdefault(interval.rank, []).append(interval)
    relabelled = {}
    for rank, intervals in by_rank.items():
        order = schedule.compute_order(rank)
        if len(order) != len(intervals) or len(schedule.stages_of(rank)) < 2:
            continue
        for interval, action in zip(intervals, order):
            chunk = schedule.chunk_of(rank, action.microbatch, action.stage)
            relabelled[id(interval)] = action.label(chunk)
    return Timeline(ranks=timeline.ranks, source=timeline.source, intervals=tuple(
        Interval(i.rank, relabelled.get(id(i), i.label), i.kind, i.microbatch, i.start_s, i.end_s)
        for i in timeline.intervals))


def timeline_peak_in_flight(timeline: Timeline) -> list[int]:
    """Per rank, the most forwards done whose backward has not started, in time order."""
    peaks = []
    freed_by = WEIGHT if any(i.kind == WEIGHT for i in timeline.intervals) else BACKWARD
    for rank in range(timeline.ranks):
        alive = peak = 0
        for interval in sorted((i for i in timeline.intervals if i.rank == rank), key=lambda i: i.start_s):
            alive += 1 if interval.kind == FORWARD else -1 if interval.kind == freed_by else 0
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


# ----- formulas ----------------------------------------------------------------------------
def theory(name: str, p: int, m: int, v: int = 1) -> dict:
    """The closed forms of the module docstring: bubble fraction with its formula, and
    the in-flight activations per rank (None where there is no closed form)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    for what, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"theory({name!r}): {what} must be an int >= 1, got {value!r}")
    unit = "micro-batches"
    if name in (GPIPE, ONE_F_ONE_B):
        bubble, bubble_formula = (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
        if name == GPIPE:
            peaks, peak_formula = [m] * p, "m"
        else:
            peaks, peak_formula = [min(p - r, m) for r in range(p)], "min(p-r, m)"
    elif name == INTERLEAVED_1F1B:
        bubble, bubble_formula = ((p - 1) / v) / (m + (p - 1) / v), "((p-1)/v)/(m+(p-1)/v)"
        if m == p:
            peaks, peak_formula = [m * v] * p, "m*v (m = p: all forwards first)"
        else:
            peaks, peak_formula = [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)], \
                "min(2(p-r-1)+(v-1)p+1, m*v)"
        unit = "chunks of 1/v stage"
    elif name == ZERO_BUBBLE:
        bubble, bubble_formula = (p - 1) / (3 * m + p - 1), "(p-1)/(3m+p-1) (F = B = W; m >= p)"
        peaks, peak_formula = [min(2 * p - r - 1, m) for r in range(p)], "min(2p-r-1, m) (forward to W)"
    else:  # chimera
        bubble, bubble_formula = (p - 2) / (2 * m + p - 2), "(p-2)/(2m+p-2)"
        if m <= p:
            half = m // 2
            peaks, peak_formula = [min(p - r, half) + min(r + 1, half) for r in range(p)], \
                "min(p-r, m/2)+min(r+1, m/2)"
        else:
            peaks, peak_formula = None, "n/a for m > p (paper: (p/2+1)..p at m = p)"
    return {"schedule": name, "p": p, "m": m, "v": v, "bubble_fraction": bubble, "bubble_formula": bubble_formula,
            "peak_in_flight": peaks, "peak_in_flight_max": max(peaks) if peaks else None,
            "peak_formula": peak_formula, "peak_unit": unit}
