"""The arithmetic of bench/plan_vs_train.py, pure and torch-free (tested in
tests/bench/test_plan_vs_train.py): the grid of configurations, the alternated run
order, the per-configuration summary over repeats, ranks and Spearman, and reading a
run's measured step parts out of report.json.

- Grid: each layout (dp, tp, pp) of 4 processes x recompute mode x ZeRO stage, where
  ZeRO > 0 only with dp > 1 (it shards over the dp group) and stage 3 only with pp = 1
  (plait train refuses zero_stage=3 with a pipeline). ``cross``: every combination;
  ``star``: the ZeRO stages at the first recompute mode and the other recompute modes
  at the first stage (one factor at a time).
- Order: repeat r runs every configuration in grid order before repeat r + 1 starts
  (ABC ABC, never AAA BBB), so a slow spell of the host spreads over all configurations.
- Summary: the median of the repeats' medians; spread = (max - min) / median.
- Spearman: Pearson correlation of the ranks, ties sharing their mean rank.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

STEP_PARTS = ("compute", "tp_comm", "pp_comm", "pp_bubble", "dp_comm", "optimizer", "data", "other")
COARSE_PARTS = ("compute", "comm", "bubble", "other")
# plan part -> coarse part (a report without fine parts)
COARSE_OF = {"compute": "compute", "tp_comm": "comm", "dp_comm": "comm", "pp_comm": "bubble", "pp_bubble": "bubble",
             "optimizer": "other", "data": "other", "other": "other"}
NPROCS = 4


@dataclass(frozen=True)
class Config:
    """One measured configuration: a layout of NPROCS processes, a recompute mode, a ZeRO stage."""

    dp: int
    tp: int
    pp: int
    recompute: str = "none"
    zero: int = 0
    offload: bool = False  # ZeRO's optimizer state in files (plait train --offload optimizer)

    @property
    def layout(self) -> str:
        """dp4, tp4, pp4, dp2xtp2, ... (the axes of degree > 1)."""
        axes = [f"{axis}{size}" for axis, size in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp)) if size > 1]
        return "x".join(axes) or "single"

    @property
    def label(self) -> str:
        return f"{self.layout} z{self.zero} {self.recompute}" + (" offload" if self.offload else "")

    @classmethod
    def from_label(cls, label: str) -> "Config":
        """The inverse of ``label``: 'dp2xtp2 z1 full offload' -> Config(2, 2, 1, 'full', 1, True)."""
        layout, zero, mode, *rest = label.split()
        sizes = {"dp": 1, "tp": 1, "pp": 1}
        for part in layout.split("x"):
            sizes[part[:2]] = int(part[2:])
        return cls(sizes["dp"], sizes["tp"], sizes["pp"], mode, int(zero[1:]), offload=rest == ["offload"])

    @property
    def slug(self) -> str:
        return f"{self.layout}-z{self.zero}-{self.recompute}" + ("-offload" if self.offload else "")


def applies(dp: int, pp: int, zero: int) -> bool:
    """ZeRO shards over the dp group (so > 0 needs dp > 1); stage 3 needs pp = 1."""
    return (zero == 0 or dp > 1) and (zero < 3 or pp == 1)


def build_grid(layouts, modes, stages, shape: str = "cross", offload: bool = False) -> list[Config]:
    """The configurations, layout-major (module docstring); ``offload``: each stage > 0 once more
    with the optimizer state offloaded."""
    if shape not in ("cross", "star"):
        raise ValueError(f"grid shape {shape!r}: cross or star")
    grid = []
    for dp, tp, pp in layouts:
        for mode in modes:
            for zero in stages:
                if not applies(dp, pp, zero):
                    continue
                if shape == "star" and mode != modes[0] and zero != stages[0]:
                    continue
                grid.append(Config(dp, tp, pp, mode, zero))
                if offload and zero:
                    grid.append(Config(dp, tp, pp, mode, zero, offload=True))
    return grid


def run_order(count: int, repeats: int) -> list[tuple[int, int]]:
    """(repeat, index) pairs: every configuration once per repeat, repeats one after another."""
    return [(repeat, index) for repeat in range(repeats) for index in range(count)]


def summarize(values: list[float]) -> dict:
    """Median, min, max and relative spread (max - min) / median of one configuration's repeats."""
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values), "n": len(values),
            "spread": (max(values) - min(values)) / median if median else None}


def ranks_of(values: list[float]) -> list[float]:
    """1 = smallest; ties share their mean rank."""
    order = sorted(range(len(values)), key=lambda index: values[index])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation of the ranks (exact with ties); None below 2 points or with no variation."""
    if len(xs) < 2:
        return None
    rx, ry = ranks_of(xs), ranks_of(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else None


def geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(value) for value in values)) if values else None


def compare(rows: list[dict], groups: dict[str, list[int]]) -> dict:
    """Over rows holding "predicted_s" and "measured_s": each row's ratio (measured /
    predicted), error (ratio - 1) and ranks (added in place); Spearman over all and per
    group (row indices), the geometric-mean ratio, the largest |error| and how many rows
    are within 15%."""
    predicted = [row["predicted_s"] for row in rows]
    measured = [row["measured_s"] for row in rows]
    for row, rp, rm in zip(rows, ranks_of(predicted), ranks_of(measured)):
        row["ratio"] = row["measured_s"] / row["predicted_s"]
        row["error"] = row["ratio"] - 1.0
        row["predicted_rank"], row["measured_rank"] = rp, rm
    per_group = {name: spearman([predicted[i] for i in members], [measured[i] for i in members])
                 for name, members in groups.items() if len(members) >= 2}
    errors = [abs(row["error"]) for row in rows]
    return {"spearman": spearman(predicted, measured), "spearman_per_group": per_group,
            "geomean_ratio": geomean([row["ratio"] for row in rows]),
            "max_abs_error": max(errors) if errors else None,
            "within_15pct": sum(error <= 0.15 for error in errors), "count": len(rows)}


def _find_breakdown(report: dict, depth: int = 2) -> dict | None:
    """The first dict (breadth first, ``depth`` levels) holding "parts_ms" keyed by step parts."""
    level = [report]
    for _ in range(depth):
        following = []
        for node in level:
            for value in node.values():
                if isinstance(value, dict):
                    parts = value.get("parts_ms")
                    if isinstance(parts, dict) and "compute" in parts:
                        return value
                    following.append(value)
        level = following
    return None


def measured_parts(report: dict) -> dict:
    """A run's measured step parts, ms per step, mean over ranks: {"source", "parts_ms", "wall_ms"}.

    fine: report.json's part breakdown (plait.train.step_breakdown: steady steps, receive
    waits split into pp_comm and pp_bubble by the senders' post times); fine_ranks: each
    rank's ``steady.parts_s`` (or ``parts_s``) averaged here, receive waits kept apart as
    "receive"; coarse: the older compute/comm/bubble/other totals (all steps)."""
    breakdown = _find_breakdown(report)
    if breakdown is not None:
        parts = breakdown["parts_ms"]
        wall = parts.get("wall", {}).get("mean_ms")
        return {"source": "fine", "parts_ms": {part: parts[part]["mean_ms"] for part in STEP_PARTS if part in parts},
                "max_ms": {part: parts[part].get("max_ms") for part in STEP_PARTS if part in parts},
                "wall_ms": wall}
    ranks = [rank for rank in report.get("ranks") or [] if "parts_s" in rank]
    if ranks:
        totals: dict[str, float] = {}
        for rank in ranks:
            steady = rank.get("steady") or {}
            source, steps = (steady["parts_s"], steady["steps"]) if steady.get("steps") else \
                (rank["parts_s"], rank.get("steps") or 1)
            for name, seconds in source.items():
                totals[name] = totals.get(name, 0.0) + 1e3 * seconds / steps / len(ranks)
        parts = {part: totals.get(f"{part}_s", 0.0) for part in STEP_PARTS}
        parts["receive"] = totals.get("receive_s", 0.0)
        return {"source": "fine_ranks", "parts_ms": parts, "wall_ms": totals.get("wall_s")}
    totals = report["time_totals"]
    steps = (report.get("run") or {}).get("steps") or 1
    scale = 1e3 / (totals["ranks"] * steps)
    return {"source": "coarse", "parts_ms": {part: totals[f"{part}_s"] * scale for part in COARSE_PARTS},
            "wall_ms": totals["wall_s"] * scale}


def coarse_plan(parts_s: dict) -> dict:
    """The plan's parts (seconds) summed into the coarse split, in ms."""
    out = {part: 0.0 for part in COARSE_PARTS}
    for part, seconds in parts_s.items():
        out[COARSE_OF.get(part, "other")] += 1e3 * seconds
    return out


def median_parts(samples: list[dict]) -> dict:
    """Per part, the median over repeats of each repeat's ms (parts missing in a repeat count as absent)."""
    names = sorted({name for sample in samples for name in sample}, key=lambda name: (
        STEP_PARTS.index(name) if name in STEP_PARTS else len(STEP_PARTS), name))
    return {name: statistics.median([sample[name] for sample in samples if sample.get(name) is not None])
            for name in names if any(sample.get(name) is not None for sample in samples)}
