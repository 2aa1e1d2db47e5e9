"""`plait tune --show`: the tuner's switch points, the size ranges in which
algorithm="auto" runs each algorithm (like NCCL's tuning table).

The tuner prices every algorithm with the calibrated profile (``plait calibrate``)
or the link you give; overrides (PLAIT_ALGORITHMS) are shown where they apply. The
profile read is the one plait calibrate saves by default (profile-gloo+shm.json in the
cache directory: plait.cost.profile.default_profile_path), or --backend's, or --profile;
the output names the file.

    plait calibrate --nprocs 4 && plait tune --show --p 4
    plait tune --show --p 4 --backend gloo      # after plait calibrate --transport gloo
    plait tune --show --p 8 --collective all --alpha 5us --bandwidth 12.5GB/s
"""

from __future__ import annotations

import argparse
import json
import sys

from plait.cli.bench import parse_collective, parse_nbytes
from plait.cli.cost import parse_rate, parse_time_s
from plait.cli.environment import cache_dir
from plait.comm.algorithms import COLLECTIVES
from plait.comm.choice import default_algorithm
from plait.cli.comm_config import config_from_environment
from plait.comm.tuner import size_ranges, Tuner, tuner_from_profile
from plait.cost import LinkModel
from plait.cost.profile import (calibrate_command, DEFAULT_PROFILE_BACKEND, default_profile_path, load_profile,
                                profile_backend)


# The profiles plait calibrate saves: --transport shm (the default), --transport gloo, --backend nccl
PROFILE_BACKENDS = (DEFAULT_PROFILE_BACKEND, profile_backend("gloo", "gloo"), profile_backend("nccl", "shm"))


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("tune", help="show which algorithm algorithm='auto' picks per size",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--show", action="store_true", help="print the switch points (the default action)")
    parser.add_argument("--p", "--nprocs", dest="world_size", type=int, default=4, help="world size (default 4)")
    parser.add_argument("--collective", default="all_reduce",
                        help="a collective or 'all' (default all_reduce)")
    parser.add_argument("--min-bytes", type=parse_nbytes, default=1, help="smallest size (default 1 B)")
    parser.add_argument("--max-bytes", type=parse_nbytes, default=1 << 30, help="largest size (default 1 GB)")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="calibration profile (default: the one plait calibrate saved for --backend)")
    parser.add_argument("--backend", default=DEFAULT_PROFILE_BACKEND, choices=PROFILE_BACKENDS,
                        help=f"whose saved profile to read: {DEFAULT_PROFILE_BACKEND} (plait calibrate's default, "
                             f"--transport shm; the default here), gloo (plait calibrate --transport gloo) or nccl")
    parser.add_argument("--alpha", type=parse_time_s, default=None, help="latency per message, e.g. 5us")
    parser.add_argument("--bandwidth", type=parse_rate, default=None, help="e.g. 12.5GB/s or 100Gb/s")
    parser.add_argument("--reduce-bandwidth", type=parse_rate, default=None, help="e.g. 20GB/s")
    parser.add_argument("--hierarchy", default=None, help="equal groups, e.g. 2x4, to price hierarchical")
    parser.add_argument("--json", action="store_true", help="print the ranges as JSON")
    parser.set_defaults(run=run, parse_collective=parse_collective)
    return parser


def profile_path(args) -> str:
    """The profile file tune reads: --profile, else where plait calibrate saved --backend's."""
    return args.profile if args.profile is not None else str(default_profile_path(args.backend, cache_dir()))


def _tuner(args) -> Tuner | None:
    path = profile_path(args)
    profile = load_profile(path)
    if args.profile is not None and profile is None:
        raise ValueError(f"no calibration profile at {args.profile}; run plait calibrate --output {args.profile}")
    given = (args.alpha, args.bandwidth, args.reduce_bandwidth)
    if profile is None and all(x is None for x in given):
        return None
    if profile is None and (args.alpha is None or args.bandwidth is None):
        raise ValueError(f"without a calibration profile (none at {path}) give both --alpha and --bandwidth (or "
                         f"run {calibrate_command(args.backend)})")
    if profile is not None and profile.world_size != args.world_size:
        print(f"plait tune: note: {path} was measured with {profile.world_size} ranks, not --p {args.world_size}: "
              f"its link may misprice {args.world_size}-rank collectives (re-run "
              f"{calibrate_command(profile.backend, args.world_size)})", file=sys.stderr)

    if profile is not None and all(x is None for x in given):
        return tuner_from_profile(profile, source=f"profile {path}") if args.hierarchy is None else Tuner(
            profile.link, call_overhead_s=profile.call_overhead_s, hierarchy=args.hierarchy,
            source=f"profile {path}", shared_host_ranks=tuner_from_profile(profile).shared_host_ranks)
    base = profile.link if profile is not None else None
    link = LinkModel(
        args.alpha if args.alpha is not None else base.alpha_s,
        1 / args.bandwidth if args.bandwidth is not None else base.beta_s_per_byte,
        1 / args.reduce_bandwidth if args.reduce_bandwidth is not None else (base.gamma_s_per_byte if base else 0.0),
    )
    source = "command line" if profile is None else (
        f"profile {path}" + (" with command-line changes" if any(
            x is not None for x in given) else ""))
    return Tuner(link, call_overhead_s=profile.call_overhead_s if profile is not None else 0.0,
                 hierarchy=args.hierarchy, source=source)


def _table_ranges(collective: str, p: int, lo: int, hi: int) -> list[tuple[int, int, str]]:
    return size_ranges(lambda nbytes: default_algorithm(collective, nbytes, p), lo, hi)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def run(args) -> int:
    if args.world_size < 1:
        raise ValueError(f"--p {args.world_size} must be >= 1")
    if args.min_bytes > args.max_bytes:
        raise ValueError(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    if args.collective == "all":
        collectives = [c for c in COLLECTIVES if c != "barrier"]
    else:
        collectives = [args.parse_collective(args.collective)]
    tuner = _tuner(args)
    source = tuner.source if tuner is not None else (
        f"the default table (no calibration profile at {profile_path(args)}: run {calibrate_command(args.backend)})")
    out = []
    for collective in collectives:
        override = config_from_environment().algorithms.get(collective)
        if override:
            ranges = [(max(1, args.min_bytes), args.max_bytes + 1, override)]
            how = "override (PLAIT_ALGORITHMS, CommConfig.algorithms)"
        elif tuner is not None:
            ranges = tuner.switch_points(collective, args.world_size, args.min_bytes, args.max_bytes)
            how = source
        else:
            ranges = _table_ranges(collective, args.world_size, args.min_bytes, args.max_bytes)
            how = source
        rows = []
        for lo, hi, algorithm in ranges:
            row = {"collective": collective, "min_bytes": lo, "max_bytes": hi - 1, "algorithm": algorithm}
            if tuner is not None and not override:
                row["predicted_s_at_min"] = tuner.predict_s(collective, algorithm, lo, args.world_size)
                row["predicted_s_at_max"] = tuner.predict_s(collective, algorithm, hi - 1, args.world_size)
            rows.append(row)
        out.append((collective, how, rows))
    if args.json:
        print(json.dumps([row for _, _, rows in out for row in rows], indent=1))
        return 0
    if tuner is not None:
        link = tuner.links[0]
        model = (f"shared-host model over {tuner.shared_host_ranks} ranks" if tuner.shared_host_ranks
                 else "one-port closed forms")
        print(f"tuner: {source}: alpha {link.alpha_s * 1e6:.1f} us, {link.bandwidth_bytes_per_s / 1e9:.3g} GB/s"
              + (f", reduction {1e-9 / link.gamma_s_per_byte:.3g} GB/s" if link.gamma_s_per_byte else "")
              + f", call overhead {tuner.call_overhead_s * 1e6:.0f} us; {model}")
    for collective, how, rows in out:
        print(f"{collective}, p={args.world_size} ({how})")
        for row in rows:
            end = row["max_bytes"] + 1
            span = f"{_size(row['min_bytes'])} .. {_size(end if end & (end - 1) == 0 else end - 1)}"
            predicted = ""
            if "predicted_s_at_min" in row:
                predicted = (f"  predicted {row['predicted_s_at_min'] * 1e6:.0f} us .. "
                             f"{row['predicted_s_at_max'] * 1e6:.0f} us")
            print(f"  {span:<22} {row['algorithm']:<20}{predicted}")
    return 0
