"""Print benchmark rows in the nccl-tests format; summaries; JSON, CSV and plots.

Every line that is not a data row starts with "#", so `grep -v '^#'` leaves
exactly the rows `size count type redop root time algbw busbw #wrong`.
Comparisons with torch use time ratios t_torch / t_algorithm, which equal busbw
ratios at the same size (and still make sense for barrier, whose busbw is 0).
"""

from __future__ import annotations

import csv
import json
import sys
import math
from typing import IO, Iterable

from plait.bench.buffers import NCCL_TYPE_NAMES, TORCH_ALGORITHM
from plait.bench.collectives import BUSBW_FORMULAS, BenchConfig, BenchRow, busbw_factor

COLUMN_HEADER = (
    "#       size         count      type   redop    root     time   algbw   busbw #wrong\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       "
)
ROW_FIELDS = ("collective", "algorithm", "nprocs", "size_bytes", "count", "dtype", "op", "root",
              "time_us", "algbw_gbps", "busbw_gbps", "wrong", "iters", "error")
# Size ranges of the "best plait algorithm vs torch" summary: [low, high) bytes.
SIZE_RANGES = ((0, 64 * 1024, "< 64K"), (64 * 1024, 4 * 1024 * 1024, "64K-4M"),
               (4 * 1024 * 1024, math.inf, ">= 4M"))


def geometric_mean(values: Iterable[float]) -> float:
    """exp(mean(log v)) of positive values; nan for none."""
    values = list(values)
    if not values:
        return math.nan
    if any(not value > 0 for value in values):
        raise ValueError(f"geometric mean needs positive values, got {values}")
    return math.exp(sum(math.log(value) for value in values) / len(values))


def format_nbytes(nbytes: float) -> str:
    """1024 -> '1K', 67108864 -> '64M' (binary, as nccl-tests -b/-e); else plain bytes."""
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes // scale)}{suffix}"
    return f"{int(nbytes)}"


def mib(nbytes: float) -> str:
    """Bytes as MiB with one decimal (the training benches' tables)."""
    return f"{nbytes / 2 ** 20:.1f}"


def _format_time_us(time_us: float) -> str:
    # nccl-tests: fewer decimals as the time grows.
    if time_us >= 10000.0:
        return f"{time_us:7.0f}"
    if time_us >= 100.0:
        return f"{time_us:7.1f}"
    return f"{time_us:7.2f}"


def format_row(row: BenchRow) -> str:
    """One data row (no leading '#'), or a '#' comment line for an error."""
    if row.error is not None:
        return f"# error at size {row.size_bytes} ({row.algorithm}): {row.error}"
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    type_name = NCCL_TYPE_NAMES.get(row.dtype, row.dtype) if row.count else "none"
    return (f"{row.size_bytes:12d}  {row.count:12d}  {type_name:>8s}  {row.op:>6s}  {row.root:6d}  "
            f"{_format_time_us(row.time_us)}  {row.algbw_gbps:6.3f}  {row.busbw_gbps:6.3f}  {wrong:>5s}")


def format_header(config: BenchConfig, *, nprocs: int, backend: str, device: str) -> list[str]:
    factor = busbw_factor(config.collective, nprocs)
    sizes = ("no sizes (barrier)" if config.collective == "barrier" else
             f"sizes {format_nbytes(config.min_nbytes)}..{format_nbytes(config.max_nbytes)} "
             f"x{config.factor}")
    if config.time_budget_s > 0 and config.warmup > 0:
        probes = min(config.warmup, 2)
        budget = (f"timed iters per (algorithm, size) = clamp({config.time_budget_s:g} s / t_probe, 1, "
                  f"{config.iters}), t_probe = max over ranks of warm-up call {probes}; "
                  f"warm-up calls = {probes}"
                  + (f" + min({config.warmup - probes}, timed iters)" if config.warmup > probes else ""))
    else:
        budget = f"timed iters per (algorithm, size) = {config.iters} (no time budget)"
    return [
        f"# plait bench {config.collective}: nprocs {nprocs}  backend {backend}  device {device}  "
        f"dtype {config.dtype}  op {config.reported_op}  root {config.reported_root}",
        f"# {sizes}  iters {config.iters}  warmup {config.warmup}  check "
        f"{'on' if config.check else 'off'}  rounds {config.rounds}",
        "# order: sizes outer, algorithms inner, whole sweep repeated per round; "
        "each row is the median round",
        f"# {budget}",
        "# time = max over ranks of elapsed/iters of back-to-back calls after a barrier; "
        f"GB = 1e9 B; busbw = algbw x {BUSBW_FORMULAS[config.collective]} = {factor:.4g}",
        f"# plait's argument check: {config.arg_check} (inband: a header in each call's first message "
        "per peer; off: none, like torch)",
        f"# algorithms: {' '.join(config.algorithms)}",
        "#",
    ]


def format_block_start(algorithm: str) -> list[str]:
    return [f"# algorithm: {algorithm}", COLUMN_HEADER]


def format_block_end(algorithm: str, rows: list[BenchRow]) -> list[str]:
    measured = [row for row in rows if row.algorithm == algorithm and row.error is None]
    lines = []
    if measured:
        average = sum(row.busbw_gbps for row in measured) / len(measured)
        lines.append(f"# Avg bus bandwidth ({algorithm}): {average:.4f} GB/s")
    wrong = sum(row.wrong or 0 for row in measured)
    if any(row.wrong is not None for row in measured):
        lines.append(f"# Out of bounds values ({algorithm}): {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return lines + ["#"]


def ratios_vs_baseline(rows: list[BenchRow],
                       baseline: str = TORCH_ALGORITHM) -> dict[str, dict[int, float]]:
    """{algorithm: {size_bytes: t_baseline / t_algorithm}} over sizes both measured."""
    base = {row.size_bytes: row.time_us for row in rows
            if row.algorithm == baseline and row.error is None and row.time_us}
    ratios: dict[str, dict[int, float]] = {}
    for row in rows:
        if row.algorithm == baseline:
            continue
        per_size = ratios.setdefault(row.algorithm, {})
        if row.error is None and row.time_us and row.size_bytes in base:
            per_size[row.size_bytes] = base[row.size_bytes] / row.time_us
    return ratios


def best_per_size(rows: list[BenchRow], baseline: str = TORCH_ALGORITHM) -> dict[int, tuple[str, float]]:
    """{size_bytes: (fastest non-baseline algorithm, t_baseline / t_best)}."""
    best: dict[int, tuple[str, float]] = {}
    for algorithm, per_size in ratios_vs_baseline(rows, baseline).items():
        for size_bytes, ratio in per_size.items():
            if size_bytes not in best or ratio > best[size_bytes][1]:
                best[size_bytes] = (algorithm, ratio)
    return dict(sorted(best.items()))


def summary_lines(rows: list[BenchRow], baseline: str = TORCH_ALGORITHM) -> list[str]:
    """Geometric-mean speed-up of each algorithm over the baseline, then the best
    algorithm per size and its geometric mean per size range and overall."""
    if not any(row.algorithm == baseline for row in rows):
        return [f"# summary: no {baseline} rows to compare with"]
    if all(row.algorithm == baseline for row in rows):
        return [f"# Summary: only {baseline} was run, nothing to compare"]
    lines = [f"# Summary: busbw ratio vs {baseline} = t_{baseline} / t_algorithm "
             "(> 1: faster than torch), geometric mean over sizes"]
    for algorithm, per_size in ratios_vs_baseline(rows, baseline).items():
        if per_size:
            wins = sum(ratio > 1 for ratio in per_size.values())
            lines.append(f"#   {algorithm:<20s} {geometric_mean(per_size.values()):7.3f}x   "
                         f"faster at {wins}/{len(per_size)} sizes")
        else:
            lines.append(f"#   {algorithm:<20s}     n/a   (no size measured by both)")
    best = best_per_size(rows, baseline)
    if not best:
        return lines
    lines.append(f"# Best plait algorithm per size vs {baseline}:")
    lines.append(f"#   {'size':>12s}  {'algorithm':<20s} {'ratio':>7s}")
    for size_bytes, (algorithm, ratio) in best.items():
        lines.append(f"#   {size_bytes:12d}  {algorithm:<20s} {ratio:7.3f}x")
    for low, high, label in SIZE_RANGES:
        in_range = [ratio for size, (_, ratio) in best.items() if low <= size < high]
        if in_range and len(in_range) < len(best):
            lines.append(f"# Best plait vs {baseline}, sizes {label}: {geometric_mean(in_range):.3f}x "
                         f"(geomean over {len(in_range)} sizes)")
    overall = geometric_mean(ratio for _, ratio in best.values())
    lines.append(f"# Best plait vs {baseline}, all sizes: {overall:.3f}x "
                 f"(geomean over {len(best)} sizes)")
    return lines


def memcpy_lines(rows: list[BenchRow], memcpy_gbps: float) -> list[str]:
    """Each algorithm's best busbw as a fraction of the measured one-core copy
    bandwidth (what a shared-memory transport copies at)."""
    lines = [f"# memcpy (one core, 64 MiB, median of 5, measured after the run): {memcpy_gbps:.2f} GB/s; "
             "best busbw per algorithm as a fraction of it:"]
    best: dict[str, BenchRow] = {}
    for row in rows:
        if row.busbw_gbps is not None and (row.algorithm not in best or row.busbw_gbps > best[row.algorithm].busbw_gbps):
            best[row.algorithm] = row
    for algorithm, row in best.items():
        lines.append(f"#   {algorithm:<20s} {row.busbw_gbps:7.3f} GB/s at {row.size_bytes} B = "
                     f"{row.busbw_gbps / memcpy_gbps:6.1%} of memcpy")
    return lines


class Printer:
    """Prints header, blocks and summary as benchmark events arrive."""

    def __init__(self, stream: IO[str], predictor=None) -> None:
        self.stream = stream
        self.rows: list[BenchRow] = []
        self.predictor = predictor  # plait.bench.predict.Predictor with --predict

    def write(self, lines: list[str]) -> None:
        for line in lines:
            print(line, file=self.stream)
        self.stream.flush()

    def on_event(self, kind: str, payload: object) -> None:
        if kind == "progress":  # to stderr, so stdout stays the nccl-tests table
            print(f"# measuring: {payload}", file=sys.stderr, flush=True)
        elif kind == "begin":
            lines = format_block_start(payload)
            if self.predictor is not None:
                lines[-1] = lines[-1].replace("\n", "  pred(us)     err\n", 1)
            self.write(lines)
        elif kind == "row":
            previous = self.rows[-1] if self.rows else None
            self.rows.append(payload)
            if (payload.error is not None and previous is not None
                    and previous.algorithm == payload.algorithm and previous.error == payload.error):
                self.write([f"# error at size {payload.size_bytes} ({payload.algorithm}): "
                            "same as above"])
            else:
                suffix = self.predictor.annotate(payload) if self.predictor is not None else ""
                self.write([format_row(payload) + suffix])
        elif kind == "end":
            self.write(format_block_end(payload, self.rows))


def write_json(rows: list[BenchRow], stream: IO[str]) -> None:
    json.dump([row.as_dict() for row in rows], stream, indent=1)
    stream.write("\n")


def write_json_document(document: dict, path: str) -> None:
    """``document`` as indented JSON to ``path``, or to standard output for "-"."""
    text = json.dumps(document, indent=1, default=str)
    if path == "-":
        print(text)
        return
    with open(path, "w") as handle:
        handle.write(text + "\n")


def write_csv(rows: list[BenchRow], stream: IO[str]) -> None:
    writer = csv.DictWriter(stream, fieldnames=ROW_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if value is None else value for key, value in row.as_dict().items()})


def write_plot(rows: list[BenchRow], path: str) -> None:
    """busbw (time for barrier) against size on a log2 axis, one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    measured = [row for row in rows if row.error is None]
    collective = rows[0].collective if rows else "?"
    by_time = collective == "barrier"
    figure, axes = plt.subplots(figsize=(8, 5))
    algorithms = list(dict.fromkeys(row.algorithm for row in measured))
    for algorithm in algorithms:
        points = sorted((row.size_bytes, row.time_us if by_time else row.busbw_gbps)
                        for row in measured if row.algorithm == algorithm)
        style = {"linewidth": 2.5, "color": "black"} if algorithm == TORCH_ALGORITHM else {}
        if by_time:
            axes.bar(algorithm, points[0][1])
        else:
            axes.plot([size for size, _ in points], [value for _, value in points], marker="o",
                      label=algorithm, **style)
    if by_time:
        axes.set_ylabel("time (us)")
    else:
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
            lambda value, _: format_nbytes(value) if value >= 1 and float(value).is_integer() else ""))
        axes.set_xlabel("size (bytes)")
        axes.set_ylabel("busbw (GB/s)")
        if algorithms:
            axes.legend(fontsize="small")
        axes.grid(True, which="both", alpha=0.3)
    nprocs = rows[0].nprocs if rows else 0
    axes.set_title(f"plait bench {collective}, {nprocs} processes")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
