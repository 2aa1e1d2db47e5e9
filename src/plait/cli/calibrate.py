"""`plait calibrate`: measure this machine's alpha, beta, gamma and call overhead.

    plait calibrate --nprocs 4 [--min-bytes 1K --max-bytes 64M --reps 7 --output PATH --json]

Spawns N local workers (or, under torchrun without --nprocs, uses that world),
times ring shifts of 1, 2 and 4 steps through plait's executor on all ranks at
once, copy and reduce, plus a two-rank ping-pong for reference
(``plait.bench.calibrate``), fits

    t(k, n, r) = c + k * (alpha + beta * n + r * gamma * n)

weighted by 1/t (``plait.cost.calibration``), and saves the profile
(``plait.cost.profile``) where the cost model and the tuner look for it:
$PLAIT_CACHE_DIR, else $XDG_CACHE_HOME/plait, else
~/.cache/plait, as profile-{backend}.json. The default (--transport shm, gloo workers)
is profile-gloo+shm.json, the file every reader takes when not told otherwise
(plait tune --show, plait cost, plait simulate --topology local, plait plan --cluster
local, plait bench --predict); the last line says how to read any other one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from plait.bench.calibrate import CalibrateConfig, describe_device, run_calibration
from plait.bench.calibrate_calls import CALL_KINDS
from plait.bench.launch import Job, WorkerError, choose_backend, in_torchrun, run_in_current_world, spawn_and_run
from plait.cli.calibrate_compute import add_compute_arguments, run_compute
from plait.cli.bench import parse_nbytes
from plait.cli.environment import cache_dir
from plait.cli.local_ranks import add_oversubscribe_flag, check_spawn
from plait.cli.output_paths import output_file, prepare_output_paths
from plait.cost.calibration import CalibrationReport, make_profile
from plait.names.transports import AUTO, BACKENDS, GLOO, SHM
from plait.cost.profile import (DEFAULT_PROFILE_BACKEND, default_profile_path, Profile, profile_backend,
                                save_profile)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid steps {text!r}: give comma-separated ints, e.g. 1,2,4") from None
    if len(set(steps)) < 2 or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"invalid steps {text!r}: need >= 2 distinct ints >= 1, e.g. 1,2,4")
    return steps


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "calibrate", help="measure alpha/beta/gamma of plait's executor on this machine; save a profile",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", "-n", type=_positive_int, default=None,
                        help="spawn this many local processes (default: the torchrun world if "
                             "RANK/WORLD_SIZE are set, else 4); measure with the p you will run")
    parser.add_argument("--transport", default=SHM, choices=(SHM, GLOO),
                        help="what the messages between the local ranks travel through: shm (plait's shared memory, "
                             "what runs on one host by default; the profile is saved as profile-gloo+shm.json) or "
                             "gloo (its TCP messages: profile-gloo.json). Calibrate each transport you run on")
    parser.add_argument("--backend", default=AUTO, choices=BACKENDS,
                        help="auto: gloo for spawned workers, nccl under torchrun with CUDA")
    parser.add_argument("--min-bytes", "-b", type=parse_nbytes, default=parse_nbytes("1K"),
                        help="smallest message, K/M/G binary suffixes (default 1K)")
    parser.add_argument("--max-bytes", "-e", type=parse_nbytes, default=parse_nbytes("64M"),
                        help="largest message (default 64M)")
    parser.add_argument("--factor", "-f", type=int, default=2, help="size multiplier (default 2)")
    parser.add_argument("--steps", type=_steps, default=(1, 2, 4),
                        help="ring-shift step counts, comma-separated (default 1,2,4)")
    parser.add_argument("--reps", type=_positive_int, default=7,
                        help="sweeps over all configurations; each sample is the median (default 7)")
    parser.add_argument("--time-budget", type=float, default=0.02, metavar="SECONDS",
                        help="back-to-back calls per rep fill about this long (default 0.02)")
    parser.add_argument("--max-calls", type=_positive_int, default=30,
                        help="most back-to-back calls per rep (default 30)")
    parser.add_argument("--warmup", "-w", type=int, default=1,
                        help="untimed calls per configuration before its first rep (default 1)")
    parser.add_argument("--no-ping-pong", action="store_true", help="skip the reference ping-pong")
    parser.add_argument("--no-calls", action="store_true",
                        help="skip the real calls (each collective and a p2p exchange at 64 B and 256 B) that fit "
                             "each kind's software cost; the profile then prices every call with the shift's c")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="per-call timeout (default 120)")
    parser.add_argument("--output", "-o", default=None, metavar="PATH",
                        help="where to save the profile (default: the cache path for the backend)")
    parser.add_argument("--json", action="store_true",
                        help="print the saved profile as JSON on stdout (the tables go to stderr)")
    add_oversubscribe_flag(parser)
    add_compute_arguments(parser)  # --compute: this CPU's kernels (plait.cli.calibrate_compute)
    parser.set_defaults(run=run)
    return parser


def config_from_args(args: argparse.Namespace) -> CalibrateConfig:
    return CalibrateConfig(min_nbytes=args.min_bytes, max_nbytes=args.max_bytes, factor=args.factor,
                           steps=args.steps, reps=args.reps, warmup=args.warmup, time_budget_s=args.time_budget,
                           max_calls_per_rep=args.max_calls, ping_pong=not args.no_ping_pong,
                           timeout_s=args.timeout, transport=args.transport,
                           call_kinds=() if args.no_calls else CALL_KINDS)


def _gbps(s_per_byte: float) -> str:
    return "inf" if s_per_byte <= 0 else f"{1e-9 / s_per_byte:.3f}"


def format_samples(profile: Profile) -> list[str]:
    """One line per sample: measured median, the model's time and the error (shift
    samples on the transport model when the profile has one; call samples: format_calls)."""
    link, transport = profile.link, profile.transport_model
    lines = ["#      kind  steps        size  op       time(us)    model(us)     err   reps min..max (us)"]
    for s in profile.samples:
        model_s = None
        if s.kind == "shift" and transport is not None:
            model_s = transport.base_call_s + s.steps * transport.step_time_s(s.nbytes, s.reduce)
        elif s.kind == "shift":
            model_s = profile.call_overhead_s + s.steps * (link.alpha_s + s.nbytes * link.beta_s_per_byte
                                                           + s.reduce * s.nbytes * link.gamma_s_per_byte)
        elif s.kind == "ping_pong" and profile.ping_pong_link is not None:
            model_s = profile.ping_pong_link.message_time_s(s.nbytes)
        elif s.kind == "call":
            continue
        model, err = (f"{'-':>12}", f"{'-':>7}") if model_s is None else \
            (f"{model_s * 1e6:12.1f}", f"{(model_s - s.time_s) / s.time_s * 100:+6.1f}%")
        spread = f"{min(s.rep_times_s) * 1e6:.0f}..{max(s.rep_times_s) * 1e6:.0f}" if s.rep_times_s else "-"
        lines.append(f"{s.kind:>11} {s.steps:>6} {s.nbytes:>11}  {'sum' if s.reduce else 'copy':<4} "
                     f"{s.time_s * 1e6:12.1f} {model} {err}   {spread}")
    return lines


def format_calls(profile: Profile) -> list[str]:
    """The call samples: measured, the messages' price, and the software cost left."""
    transport = profile.transport_model
    calls = [s for s in profile.samples if s.kind == "call"]
    if transport is None or not calls:
        return []
    lines = ["# real calls (software cost = time - messages' price):",
             "#      call           size   time(us)  messages(us)  software(us)"]
    for s in calls:
        link = transport.link_at(s.nbytes)
        work_s = s.terms[0] * link.alpha_s + s.terms[1] * link.beta_s_per_byte + s.terms[2] * link.gamma_s_per_byte
        lines.append(f"#   {s.collective:<15} {s.nbytes:>6} {s.time_s * 1e6:10.1f} {work_s * 1e6:13.1f} "
                     f"{(s.time_s - work_s) * 1e6:13.1f}")
    return lines


def format_fit(profile: Profile, report: CalibrationReport) -> list[str]:
    link = profile.link
    fit = report.shift
    lines = [f"# fit (least squares weighted by 1/t, i.e. relative error) over {fit.nsamples} shift samples:",
             "#   t(k, n, r) = c + k * (alpha + beta * n + r * gamma * n)",
             f"#   alpha         {link.alpha_s * 1e6:10.2f} us  (+- {fit.std_error('alpha_s') * 1e6:.2f})",
             f"#   beta          {_gbps(link.beta_s_per_byte):>10} GB/s   ({link.beta_s_per_byte:.4g} s/B "
             f"+- {fit.std_error('beta_s_per_byte'):.2g})",
             f"#   gamma         {_gbps(link.gamma_s_per_byte):>10} GB/s   ({link.gamma_s_per_byte:.4g} s/B "
             f"+- {_plus_minus(fit.std_error('gamma_s_per_byte'))})",
             f"#   call overhead {fit.value('call_overhead_s') * 1e6:10.2f} us  "
             f"(+- {_plus_minus(fit.std_error('call_overhead_s'), 1e6, '.2f')})",
             "#   R^2 " + "  ".join(f"{name} {value:.3f}" for name, value in profile.r2.items()),
             f"#   error vs samples: mean {fit.mean_abs_pct_error:.1f}%, max {fit.max_abs_pct_error:.1f}%"]
    if report.ping_pong is not None and profile.ping_pong_link is not None:
        ping = profile.ping_pong_link
        lines.append(f"# reference ping-pong (ranks 0-1, others idle; not the model): alpha "
                     f"{ping.alpha_s * 1e6:.2f} us, beta {_gbps(ping.beta_s_per_byte)} GB/s")
    transport = profile.transport_model
    if transport is not None:
        lines += ["# transport model (what bench --predict and the p2p price use; plait.cost.transport_model):",
                  "#   t(k, n, r) = c + k * (alpha + n * beta(n) + r * gamma * n),"
                  " beta(n) = beta_c + (beta_d - beta_c) * n / (L + n)",
                  f"#   {transport.describe()}",
                  f"#   call overhead used by the tuner and the planner: {profile.call_overhead_s * 1e6:.1f} us "
                  "(mean over the collectives' calls)" if transport.call_s else ""]
        if report.cache is not None:
            lines.append(f"#   cache fit: R^2 {report.cache.r2:.3f}, error vs samples mean "
                         f"{report.cache.mean_abs_pct_error:.1f}%, max {report.cache.max_abs_pct_error:.1f}%")
    lines += [f"# note: {note}" for note in profile.notes]
    return [line for line in lines if line]


def _plus_minus(value: float, scale: float = 1.0, spec: str = ".2g") -> str:
    return "clamped" if math.isnan(value) else format(value * scale, spec)


def reading_hint(path, profile_name: str, nprocs: int) -> str:
    """How the readers find the profile just saved at ``path``: by default, by --backend, or by path."""
    if str(path) != str(default_profile_path(profile_name, cache_dir())):
        return f"read it with plait tune --show --p {nprocs} --profile {path} (and --profile with the other commands)"
    if profile_name != DEFAULT_PROFILE_BACKEND:
        return f"read it with plait tune --show --p {nprocs} --backend {profile_name} (or --profile {path})"
    return f"read by default: plait tune --show --p {nprocs}, plait cost, plait plan --cluster local, ..."


def run(args: argparse.Namespace) -> int:
    if args.compute:
        return run_compute(args)
    config = config_from_args(args)
    use_world = args.nprocs is None and in_torchrun()
    is_reporter = not use_world or int(os.environ.get("RANK", "0")) == 0
    out = sys.stderr if args.json else sys.stdout
    if use_world:
        nprocs, backend = int(os.environ["WORLD_SIZE"]), choose_backend(args.backend, spawned=False)
    else:
        nprocs, backend = args.nprocs or 4, choose_backend(args.backend, spawned=True)
    if nprocs < 2:
        raise ValueError(f"calibration needs >= 2 processes, got {nprocs}: use --nprocs 2 or more")
    if not use_world:
        # each rank holds one buffer of max(2, p) x the largest size (plait.bench.calibrate) and receives into
        # up to one more of that size
        largest = max(config.sizes_nbytes)
        per_rank = 0 if backend == "nccl" else (max(2, nprocs) + 1) * largest
        check_spawn(nprocs, allow_oversubscribe=args.allow_oversubscribe, per_rank_bytes=per_rank,
                    what=f"a buffer of max(2, p) x {largest} B (the largest size, --max-bytes) and a receive buffer",
                    fix="use a smaller --max-bytes or --nprocs")
    profile_name = profile_backend(backend, config.transport)
    if is_reporter:  # the profile's path, given or default, before minutes of measuring
        if args.output is not None:
            prepare_output_paths(output_file("--output", args.output))
        else:
            prepare_output_paths(output_file("--output (default)", str(default_profile_path(profile_name, cache_dir()))))

    def on_event(kind: str, payload) -> None:
        if kind == "progress":
            print(f"# measuring: {payload}", file=sys.stderr, flush=True)

    if is_reporter:
        print(f"# plait calibrate: nprocs {nprocs}  backend {profile_name}  sizes {config.sizes_nbytes[0]}.."
              f"{config.sizes_nbytes[-1]} x{config.factor}  steps {','.join(map(str, config.steps))}  "
              f"reps {config.reps}", file=out, flush=True)
    start_s = time.monotonic()
    job = Job(run_calibration, config)
    try:
        if use_world:
            samples = run_in_current_world(job, backend, on_event)
        else:
            samples = spawn_and_run(job, nprocs, backend, on_event, label="plait calibrate")
    except WorkerError as error:
        print(str(error), file=sys.stderr)
        return 1
    if not is_reporter:
        return 0
    profile, report = make_profile(samples, backend=profile_name, device=describe_device(backend), world_size=nprocs)
    path = save_profile(profile, args.output, cache_dir=cache_dir())
    for line in format_samples(profile) + format_calls(profile) + format_fit(profile, report):
        print(line, file=out)
    print(f"# measured in {time.monotonic() - start_s:.1f} s; profile saved to {path}", file=out, flush=True)
    print(f"# {reading_hint(path, profile_name, nprocs)}", file=out, flush=True)
    if args.json:
        json.dump(profile.as_dict(), sys.stdout, indent=1)
        print()
    return 0
