"""`plait bench pp`: run GPipe, 1F1B, interleaved 1F1B, Chimera and zero bubble for
real and compare their bubble and activation memory with the theory (plait.bench.pp).
`plait bench pp --vs-torch`: plait's engine against torch.distributed.pipelining on
the same model, split and processes, rounds alternating (plait.bench.pp_vs_torch),
plait over gloo and over shared memory (--transports), on a quiet host and beside a
nice -n 19 busy loop (--busy-loop)."""

from __future__ import annotations

import argparse
import os

import torch

from plait.bench.busy import busy_loop
from plait.bench.launch import in_torchrun, run_in_fresh_worlds
from plait.bench.pp import SCHEDULE_NAMES, PpBenchConfig, run_pp_bench
from plait.bench.pp_vs_torch import (LOSS_RTOL, VS_TORCH_SCHEDULES, VS_TORCH_TRANSPORTS, PpVsTorchConfig,
                                    run_pp_vs_torch)
from plait.bench.report import write_json_document
from plait.cli.local_ranks import add_oversubscribe_flag, check_spawn
from plait.cli.output_paths import output_directory, output_file, prepare_output_paths
from plait.parallel.pipeline import Interval, Timeline, timeline_to_json


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {text!r}") from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    # No help=: listed in plait bench --help (see plait.cli.bench_dp)
    parser = subparsers.add_parser("bench-pp", prog="plait bench pp", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = PpBenchConfig()
    parser.add_argument("--stages", type=_ints, default=defaults.stages, help="pipeline sizes p (default 2,4)")
    parser.add_argument("--schedules", type=lambda text: tuple(text.split(",")), default=None,
                        help=f"comma list of {','.join(SCHEDULE_NAMES)} (default all; with --vs-torch all but chimera)")
    for name in ("microbatches", "virtual", "layers", "width", "batch", "steps", "warmup"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--vs-torch", action="store_true",
                        help="time plait's engine against torch.distributed.pipelining instead (--steps per side per round)")
    parser.add_argument("--rounds", type=int, default=PpVsTorchConfig().rounds,
                        help="with --vs-torch: rounds, each running both sides, alternating which goes first")
    parser.add_argument("--transports", type=lambda text: tuple(text.split(",")), default=VS_TORCH_TRANSPORTS,
                        help="with --vs-torch: plait's transports, each its own rows (default gloo,shm; torch: gloo)")
    parser.add_argument("--busy-loop", choices=BUSY_LOOP_MODES, default="also",
                        help="with --vs-torch: also (default): quiet, then beside a nice -n 19 busy loop; only; off")
    parser.add_argument("--timeline-out", default=None, metavar="DIR",
                        help="write each run's measured timeline as JSON (plait schedule --timeline draws it)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every row as JSON ('-': stdout)")
    add_oversubscribe_flag(parser)
    parser.set_defaults(run=run)
    return parser


BUSY_LOOP_MODES = ("also", "only", "off")


def _optional(value, spec: str, unit: str) -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _kib(values) -> str:
    return "/".join(f"{value / 1024:.0f}" for value in values)


def run(args) -> int:
    if in_torchrun():
        raise ValueError("plait bench pp starts its own worlds: run it without torchrun")
    # before the config, which builds every schedule at every p (a list-scheduled one at p = 1000 runs for hours)
    check_spawn(max(args.stages, default=1), allow_oversubscribe=args.allow_oversubscribe, flag="--stages")
    if args.vs_torch:
        return run_vs_torch(args)
    config = PpBenchConfig(stages=args.stages, schedules=args.schedules or SCHEDULE_NAMES, microbatches=args.microbatches,
                           virtual=args.virtual, layers=args.layers, width=args.width, batch=args.batch,
                           steps=args.steps, warmup=args.warmup)
    prepare_output_paths(output_file("--json", args.json, stdout_allowed=True),
                         output_directory("--timeline-out", args.timeline_out))
    print(f"# plait bench pp: MLP {config.layers} x Linear({config.width},{config.width})+Tanh, batch "
          f"{config.batch} in m={config.microbatches} micro-batches, float32, SGD; v={config.virtual} for "
          f"interleaved; {config.steps} timed steps after {config.warmup} warm-up, the median step's timeline")
    print(f"# each p: a fresh world of p gloo processes on this machine ({os.cpu_count()} CPU cores), 1 thread each")
    print("# bubble: measured (mean over ranks of 1 - compute/step) | unit-cost replay | formula;  "
          "activation KiB per rank: measured (peak of live storages saved for backward) | predicted from the "
          "schedule and the engine's per-micro-batch bytes")
    print(f"{'p':>2} {'schedule':<17}{'step ms':>9}{'samples/s':>10}{'bubble':>8}{'replay':>8}{'formula':>8}"
          f"  {'measured KiB / rank':<24}{'predicted':<24}in-flight (formula)")

    def on_event(kind, row):
        if kind != "row":
            return
        formula = "/".join("-" if value is None else str(value) for value in row["in_flight_formula"])
        print(f"{row['p']:>2} {row['schedule']:<17}{row['step_ms']:>9.1f}{row['samples_per_s']:>10.0f}"
              f"{row['bubble_measured']:>8.3f}{row['bubble_unit_replay']:>8.3f}{row['bubble_formula']:>8.3f}"
              f"  {_kib(row['measured_bytes']):<24}{_kib(row['predicted_bytes']):<24}"
              f"{'/'.join(map(str, row['in_flight']))} ({formula})", flush=True)
        if args.timeline_out:
            path = os.path.join(args.timeline_out, f"{row['schedule']}-p{row['p']}.json")
            timeline = Timeline(ranks=row["p"], source="measured",
                                intervals=tuple(Interval(*fields) for fields in row["timeline"]))
            meta = {"schedule": row["schedule"], "microbatches": row["m"], "virtual": row["v"]}
            write_json_document(timeline_to_json(timeline, meta), path)

    rows = run_in_fresh_worlds(run_pp_bench, config, config.stages, on_event, "plait bench pp")
    if rows is None:
        return 1
    if args.json:
        write_json_document({"config": config.__dict__, "rows": rows}, args.json)
    return 0


def run_vs_torch(args) -> int:
    config = PpVsTorchConfig(stages=args.stages, schedules=args.schedules or VS_TORCH_SCHEDULES,
                             microbatches=args.microbatches, virtual=args.virtual, layers=args.layers,
                             width=args.width, batch=args.batch, steps=args.steps, warmup=args.warmup,
                             rounds=args.rounds, transports=args.transports)
    prepare_output_paths(output_file("--json", args.json, stdout_allowed=True))
    print(f"# plait bench pp --vs-torch: MLP {config.layers} x Linear({config.width},{config.width})+Tanh, batch "
          f"{config.batch} in m={config.microbatches} micro-batches, float32, SGD; v={config.virtual} for interleaved")
    print(f"# plait PipelineEngine vs torch.distributed.pipelining (torch {torch.__version__}) on the same split and "
          f"processes: each p a fresh world of p gloo processes ({os.cpu_count()} CPU cores), 1 thread each")
    print(f"# {config.warmup} warm-up step(s) per side, then {config.rounds} rounds of {config.steps} timed steps per "
          "side (plait first in even rounds, torch in odd); a step: the slowest rank's time from a barrier")
    print("# ms: median over rounds of each side's median step; torch/plait: median of per-round ratios "
          "(> 1: plait faster), (min-max) over rounds")
    print("# compute: plait's forward/backward/weight time on the slowest rank ("
          "-: more ranks than cores); ceiling: torch ms / compute, the most any engine reaches on these computations")
    print(f"# losses: step by step, plait's mean micro-batch loss vs torch's, agree within relative {LOSS_RTOL:g}")
    print(f"{'p':>2} {'schedule':<17}{'plait over':<11}{'torch schedule':<31}{'plait ms':>9}{'torch ms':>9}  "
          f"{'torch/plait (min-max)':<23}{'compute':>8}{'ceiling':>8}{'loss rel diff':>14}  losses")

    def on_event(kind, row):
        if kind != "row":
            return
        spread = f"{row['ratio']:.3f}x ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})"
        print(f"{row['p']:>2} {row['schedule']:<17}{row['transport']:<11}{row['torch_schedule']:<31}"
              f"{row['plait_ms']:>9.1f}{row['torch_ms']:>9.1f}  {spread:<23}{_optional(row['compute_floor_ms'], '.1f', ''):>8}"
              f"{_optional(row['ceiling'], '.3f', 'x'):>8}{row['loss_max_rel_diff']:>14.1e}  "
              f"{'agree' if row['losses_agree'] else 'DIFFER'} ({len(row['plait_losses'])} steps)", flush=True)

    rows = []
    for busy in {"also": (False, True), "only": (True,), "off": (False,)}[args.busy_loop]:
        with busy_loop(busy) as spinner_pid:
            load = f"beside a nice -n 19 busy loop (pid {spinner_pid})" if busy else "no load added"
            print(f"# {load}; load average before: {' '.join(f'{value:.2f}' for value in os.getloadavg())}",
                  flush=True)
            measured = run_in_fresh_worlds(run_pp_vs_torch, config, config.stages, on_event,
                                           "plait bench pp --vs-torch")
        if measured is None:
            return 1
        rows += [{**row, "busy_loop": busy} for row in measured]
    print(f"# load average after: {' '.join(f'{value:.2f}' for value in os.getloadavg())}")
    differ = [f"p={row['p']} {row['schedule']} over {row['transport']}{' busy' if row['busy_loop'] else ''}"
              for row in rows if not row["losses_agree"]]
    print("# losses agree on every row" if not differ else f"# losses DIFFER: {', '.join(differ)}")
    if args.json:
        write_json_document({"config": config.__dict__, "rows": rows}, args.json)
    return 1 if differ else 0
