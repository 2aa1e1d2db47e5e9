"""`plait bench --predict`: the cost model's time next to every measured row.

For each plait algorithm row: predicted = call overhead + closed-form alpha-beta-gamma
time on the calibrated profile (with ``--topology``: the simulator's time for the
schedule on that topology, which prices every plait algorithm), and the error
(predicted - measured) / measured. A profile with a transport model
(``plait.cost.transport_model``, plait calibrate since format 2) is priced with it:

    pred = call_s[collective] + work(schedule, link with beta(n) at the call's n bytes),

work being the tuner's pricing of the schedule (shared-host terms on a CPU profile,
closed forms otherwise) and the algorithm the one the row ran (auto: the tuner's pick).
``auto`` rows are priced as the algorithm the tuner chose, and get a regret: their
time over the best plait algorithm measured at that size, minus one. torch rows
have no schedule to price and get no prediction.

Summary: mean absolute percentage error (MAPE) per algorithm, over all sizes and
over sizes >= 1 MiB, and auto's median regret.
"""

from __future__ import annotations

import statistics

from plait.bench.buffers import TORCH_ALGORITHM
from plait.bench.collectives import AUTO_ALGORITHM, BenchRow, topology_tuner
from plait.bench.report import format_nbytes
from plait.comm.tuner import Tuner, tuner_from_profile
from plait.cost.alpha_beta import closed_form_algorithms

LARGE_NBYTES = 1 << 20


class Predictor:
    """Prices bench rows with one calibration profile."""

    def __init__(self, profile, *, world_size: int, source: str, topology=None) -> None:
        self.profile = profile
        self.world_size = world_size
        self.topology = topology
        self.tuner = (topology_tuner(topology, profile, source) if topology is not None
                      else tuner_from_profile(profile, source=source))
        self.source = source

    def algorithm_of(self, row: BenchRow) -> str | None:
        """The algorithm a row ran: auto resolves through the tuner."""
        if row.algorithm == AUTO_ALGORITHM:
            return self.tuner.choose(row.collective, row.size_bytes, row.nprocs)
        if row.algorithm == TORCH_ALGORITHM:
            return None
        if self.topology is None and row.algorithm not in closed_form_algorithms(row.collective):
            return None
        return row.algorithm

    @property
    def transport_model(self):
        """The profile's fitted transport model (None: an older profile, or a topology run)."""
        return None if self.topology is not None else getattr(self.profile, "transport_model", None)

    def predict_us(self, row: BenchRow) -> float | None:
        algorithm = self.algorithm_of(row)
        if algorithm is None:
            return None
        model = self.transport_model
        if model is None:
            return 1e6 * self.tuner.predict_s(row.collective, algorithm, row.size_bytes, row.nprocs)
        # the schedule priced as the tuner does, on the link at this size, with this kind's call cost
        work = Tuner(model.link_at(row.size_bytes), call_overhead_s=model.call_overhead_s(row.collective),
                     hierarchy=self.tuner.hierarchy, shared_host_ranks=self.tuner.shared_host_ranks)
        return 1e6 * work.predict_s(row.collective, algorithm, row.size_bytes, row.nprocs)

    def annotate(self, row: BenchRow) -> str:
        """Columns appended to a data row: predicted time, error, and for auto its pick."""
        if row.error is not None:
            return ""
        predicted = self.predict_us(row)
        if predicted is None:
            return f"  {'-':>9s}  {'-':>7s}"
        row.extra["predicted_us"] = predicted
        row.extra["error_pct"] = 100.0 * (predicted - row.time_us) / row.time_us
        text = f"  {predicted:9.1f}  {row.extra['error_pct']:+6.1f}%"
        if row.algorithm == AUTO_ALGORITHM:
            row.extra["auto_choice"] = self.algorithm_of(row)
            text += f"  ({row.extra['auto_choice']})"
        return text

    def header(self) -> list[str]:
        if self.topology is not None:
            overhead = self.profile.call_overhead_s if self.profile else 0.0
            return [f"# --predict: every schedule simulated on topology {self.source} ({self.topology.summary()}), "
                    f"plus a call overhead of {overhead * 1e6:.1f} us",
                    "# extra columns: pred(us) = overhead + simulated time; err = (pred - time) / time"]
        link = self.profile.link
        if self.transport_model is not None:
            return [f"# --predict: profile {self.source} (measured with {self.profile.world_size} processes): "
                    f"{self.transport_model.describe()}",
                    "# extra columns: pred(us) = call_s[collective] + schedule priced with beta(n); "
                    "err = (pred - time) / time"]
        return [
            f"# --predict: profile {self.source}: alpha {link.alpha_s * 1e6:.1f} us, "
            f"beta {link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, gamma "
            + (f"{1e-9 / link.gamma_s_per_byte:.3g} GB/s" if link.gamma_s_per_byte else "0")
            + f", call overhead {self.profile.call_overhead_s * 1e6:.1f} us"
            + f" (measured with {getattr(self.profile, 'world_size', '?')} processes)",
            "# extra columns: pred(us) = overhead + closed-form time; err = (pred - time) / time",
        ]


def mape(rows: list[BenchRow], algorithm: str, min_nbytes: int = 0) -> tuple[float, int] | None:
    """(mean |error| in %, number of rows) for one algorithm's predicted rows."""
    errors = [abs(row.extra["error_pct"]) for row in rows
              if row.algorithm == algorithm and "error_pct" in row.extra and row.size_bytes >= min_nbytes]
    return (sum(errors) / len(errors), len(errors)) if errors else None


def auto_regrets(rows: list[BenchRow]) -> dict[int, float]:
    """{size: t_auto / t_best_plait - 1}, the best over plait algorithms other than auto."""
    best: dict[int, float] = {}
    for row in rows:
        if row.error is None and row.algorithm not in (TORCH_ALGORITHM, AUTO_ALGORITHM) and row.time_us:
            best[row.size_bytes] = min(best.get(row.size_bytes, float("inf")), row.time_us)
    return {row.size_bytes: row.time_us / best[row.size_bytes] - 1.0 for row in rows
            if row.algorithm == AUTO_ALGORITHM and row.error is None and row.size_bytes in best}


def summary_lines(rows: list[BenchRow]) -> list[str]:
    lines = [f"# Prediction error (MAPE = mean |pred - time| / time) per algorithm; large = sizes >= "
             f"{LARGE_NBYTES >> 20} MiB:"]
    all_errors, large_errors = [], []
    for algorithm in dict.fromkeys(row.algorithm for row in rows):
        overall = mape(rows, algorithm)
        if overall is None:
            continue
        large = mape(rows, algorithm, LARGE_NBYTES)
        lines.append(f"#   {algorithm:<20s} all {overall[0]:6.1f}% ({overall[1]} sizes)"
                     + (f"   large {large[0]:6.1f}% ({large[1]} sizes)" if large else ""))
        all_errors += [abs(r.extra["error_pct"]) for r in rows if r.algorithm == algorithm and "error_pct" in r.extra]
        large_errors += [abs(r.extra["error_pct"]) for r in rows if r.algorithm == algorithm
                         and "error_pct" in r.extra and r.size_bytes >= LARGE_NBYTES]
    if all_errors:
        lines.append(f"# MAPE over all predicted rows: {sum(all_errors) / len(all_errors):.1f}% "
                     f"({len(all_errors)} rows)"
                     + (f"; sizes >= 1 MiB: {sum(large_errors) / len(large_errors):.1f}% ({len(large_errors)} rows)"
                        if large_errors else ""))
    regrets = auto_regrets(rows)
    if regrets:
        lines.append(f"# auto regret (t_auto / t_best plait algorithm - 1): median "
                     f"{100 * statistics.median(regrets.values()):.1f}%, max {100 * max(regrets.values()):.1f}% "
                     f"over {len(regrets)} sizes")
        picks = {}
        for row in rows:
            if row.algorithm == AUTO_ALGORITHM and "auto_choice" in row.extra:
                picks.setdefault(row.extra["auto_choice"], []).append(row.size_bytes)
        lines.append("#   auto picked: " + "; ".join(
            f"{name} ({_span(sizes)})" for name, sizes in picks.items()))
    return lines


def _span(sizes: list[int]) -> str:
    lo, hi = min(sizes), max(sizes)
    return format_nbytes(lo) if lo == hi else f"{format_nbytes(lo)}..{format_nbytes(hi)}"
