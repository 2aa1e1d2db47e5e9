"""`plait bench <collective>`: nccl-tests style bandwidth tables for torch and plait.

    plait bench all_reduce --nprocs 4 --min-bytes 1K --max-bytes 64M --algorithms ring,torch

With --nprocs N (default 4 outside torchrun) it spawns N local gloo workers; under
torchrun (RANK and WORLD_SIZE set, no --nprocs) it runs in that world (nccl when
CUDA is available). Measurement: plait.bench.collectives; output: plait.bench.report.

Training benchmarks, each with its own flags (e.g. plait bench dp --help):

    plait bench dp    data parallelism: plait's DataParallel vs torch DDP, gradient compressors
    plait bench tp    Megatron tensor parallelism on a small GPT, at several tp
    plait bench pp    pipeline schedules: bubble and activation memory, measured vs theory
    plait bench memory  recomputation x precision x offload: memory measured vs formulas, peers
    plait bench zero  ZeRO stages 1-3 against DataParallel, torch DDP and FSDP2
    plait bench fold  FoldedCNN: throughput of f = 2, 3, 4 vs the unfolded CNN, batch 1-1024
    plait bench hf    a Llama-style HF model: plait vs torch DDP, FSDP2 and parallelize_module (tokens/s)
    plait bench auto  the auto-parallel plan vs data parallel, single-strategy and knob-search plans, measured
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from plait.bench import report
from plait.bench.buffers import canonical_dtype_name, COLLECTIVES, DTYPE_NAMES, OPS, parse_dtype
from plait.bench.collectives import (accepted_algorithms, available_algorithms, BenchConfig, BenchRow, buffer_plan,
                                    message_sizes)
from plait.bench.limits import collective_rank_bytes, human_bytes, WORKER_BASE_BYTES
from plait.bench.memcpy import memcpy_gbps
from plait.bench.launch import choose_backend, in_torchrun, run_in_current_world, spawn_and_run, WorkerError
from plait.bench.predict import Predictor
from plait.comm.config import TRANSPORTS
from plait.cli.environment import cache_dir
from plait.cli.local_ranks import add_oversubscribe_flag, check_spawn
from plait.cli.output_paths import output_file, prepare_output_paths
from plait.cost.profile import default_profile_path, load_profile, profile_backend
from plait.cost.topology_io import load_topology
from plait.names.transports import AUTO, BACKENDS, GLOO, NCCL, SHM
from plait.train.budget import available_memory_bytes

_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_SCALES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_nbytes(text: str) -> int:
    """'1K' -> 1024, '64M' -> 67108864, '1.5K' -> 1536, '512' -> 512 (binary suffixes
    K/M/G/T, optional B or iB, as nccl-tests' -b/-e)."""
    match = _SIZE_PATTERN.match(str(text))
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use an integer with an optional K, M, G or T suffix (1K = 1024)")
    value = float(match.group(1)) * _SIZE_SCALES[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be a whole number of bytes >= 1")
    return int(value)


def parse_collective(text: str) -> str:
    """'all-reduce', 'allreduce' and 'all_reduce' all name all_reduce."""
    name = text.strip().lower().replace("-", "_")
    aliases = {collective.replace("_", ""): collective for collective in COLLECTIVES}
    name = aliases.get(name, name)
    if name not in COLLECTIVES:
        raise argparse.ArgumentTypeError(
            f"unknown collective {text!r}; valid: {', '.join(COLLECTIVES)}")
    return name


def resolve_algorithms(text: str | None, collective: str) -> tuple[str, ...]:
    """Comma-separated names (or 'all'/None: torch + every plait algorithm), checked
    against the algorithms available for `collective`."""
    if text is None or text.strip().lower() == "all":
        return tuple(available_algorithms(collective))
    valid = accepted_algorithms(collective)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        raise ValueError(f"unknown algorithm(s) {', '.join(map(repr, unknown)) or '(none given)'} "
                         f"for {collective}; valid: {', '.join(valid)}")
    return tuple(dict.fromkeys(names))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _dtype(text: str) -> str:
    try:
        return canonical_dtype_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench", help="benchmark a collective (nccl-tests format), torch vs plait algorithms; "
                      "bench dp, bench tp, bench pp: data, tensor and pipeline parallel training; "
                      "bench memory: recomputation, precision and offload; bench zero: ZeRO against DDP and FSDP2; "
                      "bench fold: FoldedCNN throughput; bench hf: a Hugging Face Llama vs DDP, FSDP2, torch TP; "
                      "bench auto: auto-parallel plans vs data parallel and the knob search, measured",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("collective", type=parse_collective, metavar="COLLECTIVE",
                        help=f"one of: {', '.join(COLLECTIVES)}; or dp, tp, pp, memory, zero, fold, hf, auto for the "
                             "training benchmarks below (plait bench dp --help)")
    parser.add_argument("--nprocs", "-n", type=_positive_int, default=None,
                        help="spawn this many local processes (default: the torchrun world "
                             "if RANK/WORLD_SIZE are set, else 4)")
    parser.add_argument("--min-bytes", "-b", type=parse_nbytes, default=parse_nbytes("1K"),
                        help="smallest size, K/M/G suffixes are binary (default 1K)")
    parser.add_argument("--max-bytes", "-e", type=parse_nbytes, default=parse_nbytes("64M"),
                        help="largest size (default 64M)")
    parser.add_argument("--factor", "-f", type=int, default=2, help="size multiplier (default 2)")
    parser.add_argument("--iters", type=_positive_int, default=20,
                        help="most timed calls per (algorithm, size) (default 20)")
    parser.add_argument("--warmup", "-w", type=int, default=5,
                        help="most untimed calls per (algorithm, size); 0 also turns off "
                             "the --time-budget scaling (default 5)")
    parser.add_argument("--rounds", type=_positive_int, default=1,
                        help="repeat the whole sweep N times (sizes outer, algorithms inner) and report "
                             "the median round per (algorithm, size); evens out machine drift (default 1)")
    parser.add_argument("--time-budget", type=float, default=0.5, metavar="SECONDS",
                        help="scale iters down so each timed loop lasts about this long; "
                             "0 always runs --iters (default 0.5)")
    parser.add_argument("--algorithms", "-a", default=None,
                        help="comma-separated algorithm names: 'torch' (torch.distributed), "
                             "plait's, or 'auto' (plait's default per size); default: torch "
                             "and every plait algorithm")
    parser.add_argument("--op", "-o", default="sum", choices=tuple(OPS), help="reduction (default sum)")
    parser.add_argument("--dtype", "-d", type=_dtype, default="float32",
                        help=f"one of {', '.join(DTYPE_NAMES)} (default float32)")
    parser.add_argument("--root", "-r", type=int, default=0, help="root rank (default 0)")
    parser.add_argument("--check", "-c", action="store_true",
                        help="check results against a local oracle; fills #wrong")
    parser.add_argument("--backend", default=AUTO, choices=BACKENDS,
                        help="auto: gloo for spawned workers, nccl under torchrun with CUDA")
    parser.add_argument("--arg-check", choices=("inband", "deep", "off"), default="inband",
                        help="plait's argument check: inband (default: a header in each call's first message "
                             "per peer), deep (an agreement all-gather per call) or off")
    parser.add_argument("--transport", choices=TRANSPORTS, default="auto",
                        help="how plait's messages between local ranks travel: auto (shared memory, default), shm "
                             "(shared memory or fail), gloo; a name like auto@gloo in --algorithms runs on its own "
                             "group with that transport, for a side-by-side comparison")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="per-collective timeout (default 120)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the --check inputs")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write rows as JSON to FILE ('-': stdout, the table goes to stderr)")
    parser.add_argument("--csv", metavar="FILE", default=None, help="write rows as CSV to FILE")
    parser.add_argument("--predict", action="store_true",
                        help="add the cost model's predicted time and its error to each plait row, "
                             "MAPE per algorithm and auto's regret (needs plait calibrate's profile)")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="calibration profile for --predict and for auto (default: the saved one)")
    parser.add_argument("--topology", default=None, metavar="PATH",
                        help="the cluster's topology file (e.g. from plait testbed probe): algorithms blink and "
                             "synth are built from it, auto and --predict price schedules on it with the simulator")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="plot busbw against size (log2 axis), one line per algorithm")
    add_oversubscribe_flag(parser)
    parser.set_defaults(run=run)
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        collective=args.collective, algorithms=resolve_algorithms(args.algorithms, args.collective),
        min_nbytes=args.min_bytes, max_nbytes=args.max_bytes, factor=args.factor, iters=args.iters,
        warmup=args.warmup, op=args.op, dtype=args.dtype, root=args.root, check=args.check,
        time_budget_s=args.time_budget, timeout_s=args.timeout, seed=args.seed, arg_check=args.arg_check,
        rounds=args.rounds, profile_path=args.profile, topology_path=args.topology, transport=args.transport)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    use_world = args.nprocs is None and in_torchrun()
    is_reporter = not use_world or int(os.environ.get("RANK", "0")) == 0
    stream = sys.stderr if args.json == "-" else sys.stdout
    if use_world:
        nprocs = int(os.environ["WORLD_SIZE"])
        backend = choose_backend(args.backend, spawned=False)
    else:
        nprocs = args.nprocs or 4
        backend = choose_backend(args.backend, spawned=True)
    if config.root >= nprocs:
        raise ValueError(f"--root {config.root} must be < the number of processes ({nprocs})")
    _checked_topology(args.topology, nprocs)
    if not use_world:
        _check_workers_fit(args, config, nprocs, backend)
    predictor = None
    if args.predict:
        predictor, config = _predictor(args, config, backend, nprocs)
    prepare_output_paths(output_file("--json", args.json, stdout_allowed=True), output_file("--csv", args.csv),
                         output_file("--plot", args.plot))
    printer = report.Printer(stream, predictor)
    if is_reporter:
        printer.write(report.format_header(config, nprocs=nprocs, backend=backend,
                                           device="cuda" if backend == NCCL else "cpu"))
        if predictor is not None:
            printer.write(predictor.header())
    try:
        if use_world:
            rows = run_in_current_world(config, backend, printer.on_event)
        else:
            rows = spawn_and_run(config, nprocs, backend, printer.on_event)
    except WorkerError as error:
        print(str(error), file=sys.stderr)
        return 1
    if not is_reporter:
        return 0
    printer.write(report.summary_lines(rows))
    if backend == GLOO and rows:
        printer.write(report.memcpy_lines(rows, memcpy_gbps()))
    if predictor is not None:
        from plait.bench import predict

        printer.write(predict.summary_lines(rows))
    _write_outputs(args, rows)
    # Exit 1 if any (algorithm, size) failed or computed wrong values: the run went on
    # to the end, but a script should not mistake it for a clean one.
    wrong = sum(row.wrong or 0 for row in rows)
    errors = sum(row.error is not None for row in rows)
    if wrong or errors:
        print(f"plait bench: {wrong} wrong elements, {errors} (algorithm, size) errors",
              file=sys.stderr)
        return 1
    return 0


def _checked_topology(path: str | None, nprocs: int):
    """--topology loaded and matched against the run's ranks before anything starts (the
    workers would each fail on it), or None without one."""
    if path is None:
        return None
    try:
        topology = load_topology(path, allocation=None)
    except ValueError as error:
        raise ValueError(str(error) if path in str(error) else f"--topology {path}: {error}") from None
    if topology.world_size != nprocs:
        raise ValueError(f"--topology {path} places {topology.world_size} ranks but the run has {nprocs} processes: "
                         f"give the topology of these {nprocs} ranks (plait testbed probe) or --nprocs "
                         f"{topology.world_size}")
    return topology


def _check_workers_fit(args: argparse.Namespace, config: BenchConfig, nprocs: int, backend: str) -> None:
    """Refuse, before any worker starts, a world this machine cannot hold: nprocs workers
    of plait.bench.limits' runtime plus (on CPU) the largest size's buffers and scratch."""
    element_size = parse_dtype(config.dtype).itemsize
    largest = 0
    if config.collective != "barrier":
        largest = max(buffer_plan(config.collective, nbytes, nprocs, element_size)[1]
                      for nbytes in message_sizes(config.min_nbytes, config.max_nbytes, config.factor))
    per_rank = 0 if backend == NCCL else collective_rank_bytes(
        config.collective, largest, nprocs, check=config.check, element_size=element_size)
    what, fix = "", "use a smaller --nprocs"
    if per_rank:
        what = (f"the {config.collective} buffers of {largest} B (the largest size of --min-bytes {config.min_nbytes} "
                f"--max-bytes {config.max_nbytes}), their receive scratch" + (" and the --check oracle"
                                                                                  if config.check else ""))
        room = available_memory_bytes() // nprocs - WORKER_BASE_BYTES
        fitting = int(largest * room / per_rank) if room > 0 else 0
        fix = (f"use --max-bytes {fitting} ({human_bytes(fitting)}) or less, or fewer --nprocs" if fitting >= 1
               else "use a smaller --nprocs")
    check_spawn(nprocs, allow_oversubscribe=args.allow_oversubscribe, per_rank_bytes=per_rank, what=what, fix=fix)


def _predictor(args: argparse.Namespace, config: BenchConfig, backend: str, nprocs: int):
    """The Predictor for --predict, and the config with the profile pinned so that
    the workers' algorithm="auto" follows the same profile the predictions use."""


    # the profile of the transport the run uses (calibrate --transport shm saves gloo+shm)
    transport = GLOO if args.transport == GLOO else SHM
    path = args.profile or str(default_profile_path(profile_backend(backend, transport), cache_dir()))
    profile = load_profile(path)
    if args.topology is not None:
        if args.profile is not None and profile is None:
            raise ValueError(f"--profile {path}: no calibration profile there")
        topology = load_topology(args.topology, allocation=None)
        return (Predictor(profile, world_size=nprocs, source=args.topology, topology=topology),
                dataclasses.replace(config, profile_path=path if args.profile else None))
    if profile is None:
        raise ValueError(f"--predict needs a calibration profile and there is none at {path}: "
                         f"run plait calibrate --nprocs {nprocs} first, or pass --profile PATH "
                         "(or --topology PATH to price on a topology)")
    return Predictor(profile, world_size=nprocs, source=path), dataclasses.replace(config, profile_path=path)


def _write_outputs(args: argparse.Namespace, rows: list[BenchRow]) -> None:
    if args.json == "-":
        report.write_json(rows, sys.stdout)
    elif args.json:
        with open(args.json, "w") as stream:
            report.write_json(rows, stream)
    if args.csv:
        with open(args.csv, "w", newline="") as stream:
            report.write_csv(rows, stream)
    if args.plot:
        report.write_plot(rows, args.plot)
