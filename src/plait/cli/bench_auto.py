"""`plait bench auto`: the auto-parallel plan against pure data parallelism, the best
single-strategy plan and the best knob-search plan, on models that are not
Megatron-shaped (plait.models.auto_zoo: a wide-then-narrow MLP, a mixture of experts,
an MLP-Mixer), each plan run for real and shown next to its predicted step time
(plait.bench.auto, plait.bench.auto_plans).

    plait bench auto                                   # every model, 2 and 4 processes, quiet then busy
    plait bench auto --models wide_mlp --nprocs 2 --rounds 3 --busy-loop off
    plait bench auto --size tiny --rounds 1 --steps 2  # a toy run (seconds)

Predictions price this CPU measured at the model's matmul shapes and the link of
plait calibrate's profile (--profile, default the saved one; plait's placeholder
link without one, said in the header). --busy-loop also (the default) measures the
same plans twice: on the machine as it is, then with a process spinning at nice 19.
"""

from __future__ import annotations

import argparse
import os

from plait.bench.auto import AutoBenchConfig, plan_world, run_auto_bench, SIZES, summarize
from plait.bench.busy import busy_loop
from plait.bench.launch import in_torchrun, run_in_fresh_worlds
from plait.bench.report import write_json_document
from plait.cli.environment import cache_dir
from plait.cli.local_ranks import add_oversubscribe_flag, check_spawn
from plait.cli.output_paths import output_file, prepare_output_paths
from plait.cost.presets import PLACEHOLDER_LOCAL_LINK
from plait.cost.profile import DEFAULT_PROFILE_BACKEND, default_profile_path, load_profile
from plait.models.auto_zoo import ZOO

BUSY_LOOP_MODES = ("also", "only", "off")
_INT_FLAGS = ("rounds", "warmup", "steps", "seed")


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be a comma list of whole numbers, e.g. 2,4") from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    # No help=: listed in plait bench --help (see plait.cli.bench_dp)
    parser = subparsers.add_parser("bench-auto", prog="plait bench auto", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    d = AutoBenchConfig()
    parser.add_argument("--models", type=_names, default=d.models, help=f"comma list of {','.join(ZOO)} (default all)")
    parser.add_argument("--nprocs", type=_counts, default=d.nprocs,
                        help="comma list of world sizes, one fresh world each (default 2,4)")
    parser.add_argument("--size", choices=SIZES, default=d.size, help="the models' sizes (tiny: a toy run)")
    parser.add_argument("--dtype", default=d.dtype, help=f"float32 or float64 (default {d.dtype})")
    for name in _INT_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name),
                            help=f"(default {getattr(d, name)})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"SGD's learning rate (default {d.lr})")
    parser.add_argument("--time-limit", type=float, default=d.time_limit_s, metavar="SECONDS",
                        help=f"each ILP solve's limit (default {d.time_limit_s:g})")
    parser.add_argument("--model-shapes", action="store_true",
                        help="measure this CPU at the model's own matmul shapes (default: squares 32..512)")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="plait calibrate's profile for the link (default: the saved one)")
    parser.add_argument("--busy-loop", choices=BUSY_LOOP_MODES, default="also",
                        help="also (default): measure quiet, then with a nice -n 19 busy loop; only; off")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every row and the table ('-': stdout)")
    add_oversubscribe_flag(parser)
    parser.set_defaults(run=run)
    return parser


def config_from_args(args) -> AutoBenchConfig:
    return AutoBenchConfig(models=args.models, nprocs=args.nprocs, size=args.size, dtype=args.dtype, lr=args.lr,
                           time_limit_s=args.time_limit, model_shapes=args.model_shapes, **{name: getattr(args, name) for name in _INT_FLAGS})


def _link(profile_path: str | None):
    """(link, call overhead, source) of the calibration profile, else plait's placeholder."""
    path = profile_path or str(default_profile_path(DEFAULT_PROFILE_BACKEND, cache_dir()))
    profile = load_profile(path)
    if profile is None:
        if profile_path:
            raise ValueError(f"--profile {profile_path}: no calibration profile there; run plait calibrate "
                             f"--output {profile_path}")
        return PLACEHOLDER_LOCAL_LINK, 0.0, "placeholder link (run `plait calibrate` to measure)"
    link = profile.link
    return link, profile.call_overhead_s, (f"calibration profile {path} (alpha {link.alpha_s * 1e6:.3g} us, "
                                           f"{1e-9 / link.beta_s_per_byte:.3g} GB/s)")


def _load_average() -> str:
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


def table_lines(table: list[dict]) -> list[str]:
    """model, mesh, plan, predicted, measured median [min-max], error %, runner."""
    lines = [f"{'model':<9}{'p':>2} {'mesh':<5}{'plan':<16}{'predicted ms':>13}{'measured ms':>12}"
             f"{'[min-max]':>18}{'error %':>9}  run by"]
    for row in table:
        if row["measured_ms"] is None:
            measured, spread, error = "-", "(refused)" if row["refused"] else "(not run)", "-"
        else:
            measured = f"{row['measured_ms']:.2f}"
            spread = f"[{row['min_ms']:.2f}-{row['max_ms']:.2f}]"
            error = f"{row['error_pct']:+.0f}"
        lines.append(f"{row['model']:<9}{row['nprocs']:>2} {row['mesh']:<5}{row['plan']:<16}"
                     f"{row['predicted_ms']:>13.2f}{measured:>12}{spread:>18}{error:>9}  {row['runner'] or '-'}")
    return lines


def verdict_lines(table: list[dict]) -> list[str]:
    """Per model and world: the fastest measured side, auto's measured ratio to each other."""
    lines = [f"# {row['model']} p={row['nprocs']} {row['plan']}: refused by the executor: {row['refused']}"
             for row in table if row["refused"]]
    for key in dict.fromkeys((row["model"], row["nprocs"]) for row in table):
        mine = [row for row in table if (row["model"], row["nprocs"]) == key and row["measured_ms"] is not None]
        auto = next((row for row in mine if row["plan"] == "auto"), None)
        if auto is None or len(mine) < 2:
            continue
        others = ", ".join(f"{row['plan']} {row['measured_ms'] / auto['measured_ms']:.2f}x" for row in mine
                           if row is not auto)
        best = min(mine, key=lambda row: row["measured_ms"])
        agree = "yes" if auto["losses_agree"] else "NO"
        lines.append(f"# {key[0]} p={key[1]}: fastest measured {best['plan']}; others' time / auto's: {others}; "
                     f"step-1 losses agree: {agree}")
    return lines


def run(args) -> int:
    if in_torchrun():
        raise ValueError("plait bench auto starts its own worlds: run it without torchrun")
    config = config_from_args(args)
    problems = config.problems()
    if problems:
        raise ValueError("; ".join(problems))
    for nprocs in config.nprocs:
        check_spawn(nprocs, allow_oversubscribe=args.allow_oversubscribe)
    prepare_output_paths(output_file("--json", args.json, stdout_allowed=True))
    link, overhead_s, source = _link(args.profile)
    conditions = {"also": (False, True), "only": (True,), "off": (False,)}[args.busy_loop]
    document, tables, status = {"config": {**config.__dict__}, "link": source, "measurements": []}, [], 0
    print(f"# plait bench auto: models {', '.join(config.models)} ({config.size}, {config.dtype}); {os.cpu_count()} "
          f"cores; link: {source}; {config.rounds} rounds x {config.steps} timed steps (after {config.warmup} "
          f"warm-up), sides rotated per round; load average {_load_average()}", flush=True)
    for nprocs in config.nprocs:
        job = plan_world(config, nprocs, link, call_overhead_s=overhead_s, link_source=source,
                         emit=lambda text: print(text, flush=True))
        for busy in conditions:
            with busy_loop(busy) as spinner_pid:
                load = f"with a nice -n 19 busy loop (pid {spinner_pid})" if busy else "no load added"
                print(f"# {nprocs} processes, {load}", flush=True)
                rows = run_in_fresh_worlds(run_auto_bench, job, [nprocs], _print_row, "plait bench auto")
            if rows is None:
                return 1
            table = summarize(job, rows, busy=busy)
            for line in table_lines(table) + verdict_lines(table):
                print(line, flush=True)
            tables += table
            document["measurements"].append({"nprocs": nprocs, "busy_loop": busy, "rows": rows, "table": table})
            # a side the executor refused or whose step-1 loss differs is a failure (shown, then exit 1)
            good = all((row["losses_agree"] or row["measured_ms"] is None) and not row["refused"] for row in table)
            status = status or (0 if good else 1)
    if args.json:
        write_json_document(document, args.json)
    return status


def _print_row(kind, row) -> None:
    if kind == "row" and "refused" in row:
        print(f"  {row['model']:<9} {row['side']:<16} refused by the executor: {row['refused']}", flush=True)
    elif kind == "row":
        print(f"  round {row['round']} {row['model']:<9} {row['side']:<16} {row['step_s'] * 1e3:8.2f} ms "
              f"(step-1 loss {row['first_loss']:.6f})", flush=True)
