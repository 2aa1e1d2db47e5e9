"""`plait cost table`: the alpha-beta comparison of every algorithm for one collective.

For each algorithm: message rounds, bytes the busiest worker sends, bytes on the
wire in total, links (distinct peers) per worker, and the predicted time. Counts
come from the schedule plait would run; the time from the closed form
(plait.cost.alpha_beta), on the calibrated profile or the link you give.

    plait cost table --p 8 --nbytes 100MB
    plait cost table --p 8 --nbytes 100MB --alpha 5us --bandwidth 12.5GB/s --json
"""

from __future__ import annotations

import argparse
import json
import re

from plait.cli.bench import parse_collective, parse_nbytes
from plait.cli.environment import cache_dir
from plait.comm.algorithms import algorithms_for, build_schedule, COLLECTIVES, ROOTED
from plait.cost import LinkModel
from plait.cost.alpha_beta import cost_terms, pipeline_segments
from plait.cost.profile import load_profile

MAX_TABLE_WORLD = 1024  # schedules grow as p^2 steps x transfers; beyond this use plait simulate

_TIME = re.compile(r"^\s*([0-9.]+(?:e-?\d+)?)\s*(s|ms|us|µs|ns)?\s*$", re.IGNORECASE)
_TIME_SCALE = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_RATE = re.compile(r"^\s*([0-9.]+(?:e\d+)?)\s*([kmgtKMGT]?)(b|B)(?:/s|ps)?\s*$")
_RATE_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}

# Used when there is no calibrated profile and no --alpha/--bandwidth: a 100 Gb/s
# network with 5 us latency, a common cluster link; the header says so.
DEFAULT_LINK = LinkModel(5e-6, 1 / 12.5e9, 0.0)


def parse_time_s(text: str) -> float:
    """'5us' -> 5e-6, '1.5ms' -> 1.5e-3, '2e-6' -> 2e-6 (seconds when no unit)."""
    match = _TIME.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"invalid time {text!r}: write e.g. 5us, 1.5ms or 2e-6 (seconds)")
    return float(match.group(1)) * _TIME_SCALE[(match.group(2) or "s").lower().replace("µs", "us") or None]


def parse_rate(text: str) -> float:
    """Bytes per second: '12.5GB/s' -> 12.5e9; '100Gb/s' (bits) -> 12.5e9; decimal units."""
    match = _RATE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid bandwidth {text!r}: write e.g. 12.5GB/s (bytes) or 100Gb/s (bits)")
    value = float(match.group(1)) * _RATE_SCALE[match.group(2).lower()]
    if match.group(3) == "b":
        value /= 8
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid bandwidth {text!r}: must be > 0")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "cost", help="alpha-beta cost model: compare algorithms before running them",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="cost_command", metavar="ACTION", required=True)
    table = actions.add_parser("table", help="rounds, bytes, links and predicted time per algorithm",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    table.add_argument("--p", "--nprocs", dest="world_size", type=int, default=8, help="world size (default 8)")
    table.add_argument("--nbytes", type=parse_nbytes, default=100 << 20,
                       help="message size, e.g. 100MB (binary units: 1MB = 2^20 bytes; default 100MB)")
    table.add_argument("--collective", type=parse_collective, default="all_reduce")
    table.add_argument("--alpha", type=parse_time_s, default=None, help="latency per message, e.g. 5us")
    table.add_argument("--bandwidth", type=parse_rate, default=None, help="link bandwidth, e.g. 12.5GB/s or 100Gb/s")
    table.add_argument("--reduce-bandwidth", type=parse_rate, default=None,
                       help="reduction throughput (gamma = 1/this), e.g. 20GB/s; default: none")
    table.add_argument("--profile", default=None, help="calibration profile (default: the one plait calibrate saved)")
    table.add_argument("--hierarchy", default=None, help="for hierarchical: equal groups, e.g. 2x4 (default: flat)")
    table.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    table.set_defaults(run=run)
    return parser


def _resolve_link(args) -> tuple[LinkModel, str]:
    """The link from flags, else the calibrated profile, else DEFAULT_LINK."""
    base, source = DEFAULT_LINK, "default link (100 Gb/s, 5 us; run plait calibrate or pass --alpha/--bandwidth)"
    profile = _load_profile(args.profile)
    if profile is not None:
        base, source = profile.link, f"calibrated profile {args.profile or '(default path)'}"
    if args.alpha is None and args.bandwidth is None and args.reduce_bandwidth is None:
        return base, source
    alpha = base.alpha_s if args.alpha is None else args.alpha
    beta = base.beta_s_per_byte if args.bandwidth is None else 1.0 / args.bandwidth
    gamma = base.gamma_s_per_byte if args.reduce_bandwidth is None else 1.0 / args.reduce_bandwidth
    return LinkModel(alpha, beta, gamma), "given on the command line" + (
        f" (rest from {source})" if None in (args.alpha, args.bandwidth, args.reduce_bandwidth) else "")


def _load_profile(path):
    """The calibration profile at ``path`` (or the default one); None when there is none."""

    profile = load_profile(path, cache_dir=cache_dir())
    if profile is None and path is not None:
        raise ValueError(f"no calibration profile at {path}; run plait calibrate --output {path}")
    return profile


def table_rows(collective: str, world_size: int, nbytes: int, link: LinkModel, hierarchy=None) -> list[dict]:
    """One row per algorithm: rounds, bytes_per_worker, total_bytes, links_per_worker, time_s."""
    p = world_size
    if not 1 <= p <= MAX_TABLE_WORLD:
        raise ValueError(f"--p {p} must be in 1..{MAX_TABLE_WORLD} (the table builds each schedule; "
                         "price larger worlds with plait simulate)")
    rows = []
    root = 0 if collective in ROOTED else None
    segments = pipeline_segments(nbytes)
    numel = 2 * nbytes if collective == "all_to_all" else nbytes  # one-byte elements
    if collective == "all_to_all":
        numel -= numel % (2 * p)
    for algorithm in algorithms_for(collective):
        spec = hierarchy if algorithm == "hierarchical" else None
        schedule = build_schedule(collective, algorithm, p, numel, root, segments, spec)
        terms = cost_terms(collective, algorithm, nbytes, p, hierarchy=spec, segments=segments)
        rows.append({
            "algorithm": algorithm,
            "rounds": schedule.num_steps,
            "bytes_per_worker": schedule.max_sent_numel(),
            "total_bytes": schedule.total_numel_on_wire(),
            "links_per_worker": schedule.max_peers(),
            "time_s": terms.time_s(link),
        })
    return rows


def _format_bytes(nbytes: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _format_time(time_s: float) -> str:
    if time_s >= 1:
        return f"{time_s:.3f} s"
    if time_s >= 1e-3:
        return f"{time_s * 1e3:.3f} ms"
    return f"{time_s * 1e6:.1f} us"


def run(args) -> int:
    if args.collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {args.collective!r}")
    link, source = _resolve_link(args)
    rows = table_rows(args.collective, args.world_size, args.nbytes, link, args.hierarchy)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    best = min(rows, key=lambda r: r["time_s"])["time_s"]
    print(f"{args.collective}: p={args.world_size}, {_format_bytes(args.nbytes)}; link alpha "
          f"{link.alpha_s * 1e6:.2f} us, bandwidth {link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, "
          + (f"reduction {1e-9 / link.gamma_s_per_byte:.3g} GB/s" if link.gamma_s_per_byte else "no reduction cost")
          + f" ({source})")
    header = ("algorithm", "rounds", "bytes/worker", "total bytes", "links/worker", "time", "vs best")
    lines = [header]
    for row in rows:
        lines.append((row["algorithm"], str(row["rounds"]), _format_bytes(row["bytes_per_worker"]),
                      _format_bytes(row["total_bytes"]), str(row["links_per_worker"]),
                      _format_time(row["time_s"]), f"{row['time_s'] / best:.2f}x" if best > 0 else "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for index, line in enumerate(lines):
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    print("bytes/worker: sent by the busiest rank; links/worker: distinct peers of the busiest rank")
    return 0
