"""Predicted vs measured step time: `plait plan --cluster local` against `plait train`
over the issue-36 grid of 4-process configurations, on plait train's default GPT.

    .venv/bin/python bench/plan_vs_train.py --quick               # 6 layouts, zero 0, recompute none, 1 repeat
    .venv/bin/python bench/plan_vs_train.py --dry-run [grid flags] # the grid, the commands, the runtime estimate
    .venv/bin/python bench/plan_vs_train.py [--grid cross|star] [--repeats 2] [--steps 30] [--warmup 5]
        [--layouts 4x1x1,1x1x4] [--recompute none,selective,full] [--zero-stages 0,1,2,3]
        [--offload-optimizer] [--busy] [--out bench-results/plan-vs-train/summary.json]

The grid (bench/plan_vs_train_stats.py): layouts dp4, tp4, pp4, dp2xtp2, dp2xpp2,
tp2xpp2 (--layouts as DPxTPxPP), each with every --recompute mode and every ZeRO stage
that applies (> 0 needs dp > 1; 3 needs pp = 1, as plait train refuses stage 3 with a
pipeline): --grid cross takes every combination (42 with the defaults), --grid star the
ZeRO stages at the first recompute mode plus the other modes at the first stage (26).

Per configuration:

- prediction (once, before any run): `plait plan --cluster local --nprocs 4 --global-batch
  16 --dp D --tp T --pp P --micro-batch 4 --schedule 1f1b|none --recompute MODE
  --zero-stage S --no-sequence-parallel --untied-head --top 1 --json` (what plait train
  runs by default: fp32 AdamW, 4 layers, hidden 128, 4 heads, seq 64, an untied head,
  global batch 16, micro-batch 4): its step_time_s, time_breakdown_s (exposed time per
  part: they add up to the step) and hidden_breakdown_s (communication hidden under
  compute) when the plan has it;
- measurement, --repeats times, ALTERNATED (every configuration once, then all again):
  `plait train --dp D --tp T --pp P --steps N --eval-interval 0 --checkpoint-interval 0
  --sample-chars 0 --recompute MODE --zero-stage S --out DIR`; a run's step time is the
  median of rank 0's step times (metrics.jsonl step_s) after the first --warmup steps;
  the configuration's is the median over repeats, its spread (max - min) / median.

Printed: the step-time table (predicted, measured, spread, ratio = measured / predicted,
error, rank columns), Spearman over all configurations and per layout (its ZeRO and
recompute variants) and per variant (the layouts), the geometric-mean ratio, the
largest |error| and how many are within 15%; the per-part table (the plan's parts beside
the run's measured parts, ms per step, mean over ranks, median over repeats: from
report.json's part breakdown when it has one, else the older compute/comm/bubble/other
split, to which the plan's parts are summed); the memory table (the plan's worst pipeline
rank against the largest over the ranks). The JSON (--out) holds every command, every
run's numbers and step times, the load average before and after each run, and is
rewritten after every run, so an interrupted benchmark keeps what it measured.

--busy: a `nice -n 19` busy loop runs during the predictions and the runs (ended on every
exit path: normal, error, Ctrl-C, SIGTERM; it also dies with this process). Other jobs
disturb the timings (4 processes on 2 cores): compare configurations within one
invocation, and read the spread and the load averages before trusting a rank swap.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from plan_vs_train_stats import build_grid, Config, measured_parts, NPROCS, run_order
from plan_vs_train_runs import run_command, tail
from plan_vs_train_tables import ms, print_tables, summarize_configs

LAYOUTS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
RECOMPUTE_MODES = ("none", "selective", "full")
GLOBAL_BATCH, MICRO_BATCH = 16, 4
# runtime estimate on this 2-core machine (2026-11-27): a plait train run costs a fixed start-up and tear-down
# (torchrun, 4 imports, data, the report with its plan, a checkpoint: 16.5 s at load 2.4, 19-34 s at load 6-8)
# plus its steps; a plait plan 4 s (4-10 s loaded). Step times (ms, quiet: docs/limits.md and this issue's
# baseline) of zero 0, recompute none; other variants scaled by the factors (ZeRO 3: 1.8-2.6x measured).
RUN_FIXED_S, PLAN_S = 20.0, 4.0
STEP_GUESS_MS = {"dp4": 100.0, "tp4": 430.0, "pp4": 95.0, "dp2xtp2": 180.0, "dp2xpp2": 90.0, "tp2xpp2": 200.0}
VARIANT_FACTOR = {"selective": 1.05, "full": 1.35, 1: 1.1, 2: 1.2, 3: 2.2}
BUSY_FACTOR = 1.3


def parse_layouts(text: str | None) -> list[tuple[int, int, int]]:
    """'4x1x1,1x1x4' -> [(4, 1, 1), (1, 1, 4)] (dp x tp x pp, product 4)."""
    if not text:
        return list(LAYOUTS)
    layouts, problems = [], []
    for item in text.split(","):
        try:
            dp, tp, pp = (int(part) for part in item.strip().lower().split("x"))
        except ValueError:
            problems.append(f"{item!r} is not DPxTPxPP")
            continue
        if dp * tp * pp != NPROCS:
            problems.append(f"{item!r}: dp({dp}) * tp({tp}) * pp({pp}) = {dp * tp * pp} != {NPROCS}")
            continue
        layouts.append((dp, tp, pp))
    if problems:
        raise SystemExit("--layouts: " + "; ".join(problems))
    return layouts


def plan_command(config: Config) -> list[str]:
    return [sys.executable, "-m", "plait", "plan", "--cluster", "local", "--nprocs", str(NPROCS),
            "--global-batch", str(GLOBAL_BATCH), "--dp", str(config.dp), "--tp", str(config.tp),
            "--pp", str(config.pp), "--micro-batch", str(MICRO_BATCH),
            "--schedule", "none" if config.pp == 1 else "1f1b", "--recompute", config.recompute,
            "--zero-stage", str(config.zero), "--no-sequence-parallel", "--untied-head", "--top", "1", "--json"] \
        + (["--offload-optimizer"] if config.offload else [])


def train_command(config: Config, steps: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "plait", "train", "--dp", str(config.dp), "--tp", str(config.tp),
            "--pp", str(config.pp), "--steps", str(steps), "--eval-interval", "0", "--checkpoint-interval", "0",
            "--sample-chars", "0", "--recompute", config.recompute, "--zero-stage", str(config.zero),
            "--out", str(run_dir)] + (["--offload", "optimizer"] if config.offload else [])


def predict(config: Config, env: dict, timeout_s: float) -> dict:
    """One `plait plan --json` for this fixed configuration: its first (only) plan."""
    command = plan_command(config)
    load_before = os.getloadavg()
    started_s = time.perf_counter()
    result = run_command(command, env, timeout_s)
    if result.returncode:
        raise RuntimeError(f"plait plan exited {result.returncode}:\n{tail(result.stderr or result.stdout)}")
    plans = json.loads(result.stdout)
    if not plans:
        raise RuntimeError(f"plait plan found no feasible plan:\n{tail(result.stderr)}")
    plan = plans[0]
    return {"command": " ".join(command[1:]), "command_s": time.perf_counter() - started_s,
            "load_average_before": load_before, "notes": result.stderr.strip().splitlines(),
            "step_s": plan["step_time_s"], "breakdown_s": plan["time_breakdown_s"],
            "hidden_s": plan.get("hidden_breakdown_s"), "memory_bytes": plan["memory_breakdown_bytes"],
            "plan": plan}


def measure(config: Config, steps: int, warmup: int, run_dir: Path, env: dict, timeout_s: float) -> dict:
    """One `plait train` run: median step time after warm-up, the measured parts, memory, collectives."""
    shutil.rmtree(run_dir, ignore_errors=True)
    command = train_command(config, steps, run_dir)
    load_before = os.getloadavg()
    started_utc = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    started_s = time.perf_counter()
    result = run_command(command, env, timeout_s)
    command_s = time.perf_counter() - started_s
    if result.returncode:
        raise RuntimeError(f"plait train exited {result.returncode}:\n{tail(result.stderr or result.stdout)}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_times_s = [record["step_s"] for record in sorted(records, key=lambda record: record["step"])]
    steady_s = step_times_s[warmup:] or step_times_s
    report = json.loads((run_dir / "report.json").read_text())
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the final one plait train always writes
    median_s = statistics.median(steady_s)
    quartiles = statistics.quantiles(steady_s, n=4) if len(steady_s) >= 2 else [median_s] * 3
    per_rank = (report.get("collectives") or {}).get("per_rank", {})
    calls = [sum(entry["calls"] for entry in stats.values()) for stats in per_rank.values()]
    collective_s = [sum(entry["time_s"] for entry in stats.values()) for stats in per_rank.values()]
    rank_steps = max(len(per_rank), 1) * len(step_times_s)
    return {"command": " ".join(command[1:]), "started_utc": started_utc, "command_s": command_s,
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "step_s": median_s, "step_p25_s": quartiles[0], "step_p75_s": quartiles[2],
            "mean_step_s": statistics.fmean(steady_s), "steps_measured": len(steady_s),
            "warmup_steps_excluded": len(step_times_s) - len(steady_s), "step_times_s": step_times_s,
            "parts": measured_parts(report), "time_totals": report.get("time_totals"),
            "collective_calls_per_step": max(calls) / len(step_times_s) if calls else 0.0,
            "collective_mean_per_rank_step_s": sum(collective_s) / rank_steps if calls else 0.0,
            "slowest_rank": report.get("slowest_rank"),
            "mfu_steady": (report.get("mfu") or {}).get("steady_value"),
            "time_to_first_step_s": report.get("time_to_first_step_s"),
            "memory_bytes": measured_memory(report.get("memory") or [])}


def measured_memory(rows: list[dict]) -> dict:
    """The largest figure over the ranks (the plan prices the worst pipeline rank)."""
    keys = {"activations": "saved_activations_peak_bytes", "parameters": "params_bytes",
            "gradients": "grads_bytes", "optimizer": "optimizer_bytes", "optimizer_in_files": "offloaded_bytes"}
    return {name: max((row.get(key) or 0) for row in rows) if rows else None for name, key in keys.items()}


def estimate_s(grid: list[Config], repeats: int, steps: int, busy: bool) -> dict:
    """Up-front runtime estimate from this machine's constants (RUN_FIXED_S, STEP_GUESS_MS, ...)."""
    run_s = 0.0
    for config in grid:
        step_ms = STEP_GUESS_MS.get(config.layout, 200.0) * VARIANT_FACTOR.get(config.recompute, 1.0) \
            * VARIANT_FACTOR.get(config.zero, 1.0)
        run_s += RUN_FIXED_S + steps * step_ms / 1e3
    factor = BUSY_FACTOR if busy else 1.0
    plans_s = PLAN_S * len(grid) * factor
    return {"plans_s": plans_s, "runs_s": run_s * repeats * factor, "total_s": plans_s + run_s * repeats * factor,
            "runs": len(grid) * repeats}


def _die_with_parent() -> None:
    """In the spinner (before exec): SIGKILL it when this script dies, even by SIGKILL (Linux prctl)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def busy_loop(enabled: bool):
    """A `nice -n 19` process spinning for the block (yields its pid, or None), ended by pid
    whatever the block raises."""
    if not enabled:
        yield None
        return
    spinner = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=_die_with_parent)
    try:
        yield spinner.pid
    finally:
        spinner.kill()
        spinner.wait(timeout=10)


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds: the busy loop and a running plait command are ended by pid


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="six layouts x zero 0 x recompute none, 1 repeat, 20 steps (flags given still win)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the grid, the commands and the estimate; run nothing")
    parser.add_argument("--grid", choices=("cross", "star"), default="cross",
                        help="cross: every recompute x ZeRO combination; star: one factor at a time (default cross)")
    parser.add_argument("--repeats", type=int, default=None, help="alternated repeats of the whole grid (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="plait train steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of a run's median (default 5)")
    parser.add_argument("--layouts", default=None, help="subset, e.g. 4x1x1,1x1x4 (dp x tp x pp; default all six)")
    parser.add_argument("--zero-stages", default=None, help="comma list out of 0,1,2,3 (default all)")
    parser.add_argument("--recompute", default=None, help="comma list out of none,selective,full (default all)")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help="run each ZeRO stage > 0 once more with its optimizer state offloaded to files")
    parser.add_argument("--busy", action="store_true", help="a nice -n 19 busy loop runs throughout")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="start another repeat only if the last one (as long again) fits in this many minutes "
                             "from the start; the repeats run are reported (default: no limit)")
    parser.add_argument("--out", default="bench-results/plan-vs-train/summary.json",
                        help="summary JSON; the runs go in runs/ next to it (default bench-results/plan-vs-train/...)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per plait command (default 600)")
    parser.add_argument("--tables", metavar="SUMMARY_JSON", default=None,
                        help="print the tables of a summary this script wrote (an interrupted one too); run nothing")
    args = parser.parse_args(argv)
    quick = args.quick
    args.repeats = args.repeats if args.repeats is not None else (1 if quick else 2)
    args.steps = args.steps if args.steps is not None else (20 if quick else 30)
    args.zero_stages = args.zero_stages or ("0" if quick else "0,1,2,3")
    args.recompute = args.recompute or ("none" if quick else "none,selective,full")
    if args.steps <= args.warmup:
        parser.error(f"--steps({args.steps}) must exceed --warmup({args.warmup})")
    if args.repeats < 1:
        parser.error(f"--repeats({args.repeats}) must be >= 1")
    modes = [mode.strip() for mode in args.recompute.split(",") if mode.strip()]
    if not modes or any(mode not in RECOMPUTE_MODES for mode in modes):
        parser.error(f"--recompute {args.recompute!r}: give modes out of {', '.join(RECOMPUTE_MODES)}")
    try:
        stages = [int(stage) for stage in args.zero_stages.split(",") if stage.strip()]
    except ValueError:
        stages = []
    if not stages or any(stage not in (0, 1, 2, 3) for stage in stages):
        parser.error(f"--zero-stages {args.zero_stages!r}: give stages out of 0, 1, 2, 3")
    return args, build_grid(parse_layouts(args.layouts), modes, stages, args.grid, args.offload_optimizer)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def print_saved(path: Path) -> int:
    """The tables of a saved summary (``--tables``): its grid, predictions and the runs it holds."""
    summary = json.loads(path.read_text())
    grid = [Config(**fields) for fields in summary["grid_configs"]] if "grid_configs" in summary else \
        [Config.from_label(label) for label in summary["configs"]]
    repeats_run = 1 + max((run["repeat"] for run in summary["runs"]), default=-1)
    rows, stats = summarize_configs(grid, summary["predictions"], summary["runs"])
    print_tables(rows, stats, argparse.Namespace(repeats_run=repeats_run, warmup=summary["warmup_steps_excluded"],
                                                 steps=summary["steps"]))
    print(f"{len(summary['runs'])} runs of {len(grid)} configurations; finished "
          f"{summary.get('finished_utc', '- (interrupted)')}")
    return 0


def main(argv=None) -> int:
    args, grid = parse_args(argv)
    if args.tables:
        return print_saved(Path(args.tables))
    out = Path(args.out)
    estimate = estimate_s(grid, args.repeats, args.steps, args.busy)
    print(f"{len(grid)} configurations x {args.repeats} alternated repeat(s) = {estimate['runs']} plait train runs of "
          f"{args.steps} steps{' with a busy loop' if args.busy else ''}; estimated {estimate['total_s'] / 60:.1f} min "
          f"({estimate['plans_s'] / 60:.1f} predicting, {estimate['runs_s'] / 60:.1f} training; this machine's "
          f"constants: {RUN_FIXED_S:.0f} s per run + its steps, {PLAN_S:.0f} s per plan)", file=sys.stderr, flush=True)
    if args.dry_run:
        for config in grid:
            print(f"{config.label:<28} {' '.join(plan_command(config)[1:])}\n{'':<28} "
                  f"{' '.join(train_command(config, args.steps, out.parent / 'runs' / config.slug)[1:])}")
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    summary = {"argv": sys.argv if argv is None else argv, "git_commit": git_commit(), "cpu_count": os.cpu_count(),
               "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "steps": args.steps, "warmup_steps_excluded": args.warmup, "repeats": args.repeats, "grid": args.grid,
               "nprocs": NPROCS, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH, "busy": args.busy,
               "plait_comm_check": os.environ.get("PLAIT_COMM_CHECK", "1"), "estimate": estimate,
               "configs": [config.label for config in grid], "grid_configs": [asdict(config) for config in grid],
               "predictions": {}, "runs": []}
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(summary, indent=1))

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    started_s = time.perf_counter()
    with busy_loop(args.busy) as spinner_pid:
        summary["busy_pid"] = spinner_pid
        for config in grid:
            try:
                summary["predictions"][config.label] = predict(config, env, args.timeout_s)
                print(f"plan {config.label}: {ms(summary['predictions'][config.label]['step_s'])} ms "
                      f"({summary['predictions'][config.label]['command_s']:.0f} s)", file=sys.stderr, flush=True)
            except (RuntimeError, OSError, ValueError, KeyError) as error:
                summary["predictions"][config.label] = {"error": f"{type(error).__name__}: {error}"}
                print(f"{config.label}: plan failed: {error}", file=sys.stderr)
        save()
        repeat_started_s = time.perf_counter()
        for repeat, index in run_order(len(grid), args.repeats):
            if index == 0 and repeat and args.budget_min is not None:
                last_s, now_s = time.perf_counter() - repeat_started_s, time.perf_counter() - started_s
                if now_s + last_s > 60 * args.budget_min:
                    summary["stopped_by_budget"] = f"after {repeat} repeat(s): {now_s / 60:.1f} min + another " \
                                                   f"{last_s / 60:.1f} > --budget-min {args.budget_min:g}"
                    print(f"stopping: {summary['stopped_by_budget']}", file=sys.stderr, flush=True)
                    break
                repeat_started_s = time.perf_counter()
            config = grid[index]
            run = {"config": config.label, "repeat": repeat}
            try:
                run["measured"] = measure(config, args.steps, args.warmup, out.parent / "runs" / config.slug, env,
                                          args.timeout_s)
                predicted = summary["predictions"][config.label].get("step_s")
                print(f"[{repeat + 1}/{args.repeats}] {config.label}: measured {ms(run['measured']['step_s'])} ms, "
                      f"predicted {ms(predicted)} ms ({run['measured']['command_s']:.0f} s)", file=sys.stderr,
                      flush=True)
            except (RuntimeError, OSError, ValueError, KeyError) as error:
                run["error"] = f"{type(error).__name__}: {error}"
                print(f"[{repeat + 1}/{args.repeats}] {config.label}: failed: {error}", file=sys.stderr, flush=True)
            summary["runs"].append(run)
            save()
            if repeat == 0 and index == len(grid) - 1 and args.repeats > 1:
                first_s = time.perf_counter() - started_s
                print(f"first repeat (with the predictions) took {first_s / 60:.1f} min; about "
                      f"{first_s * (args.repeats - 1) / 60:.1f} min to go", file=sys.stderr, flush=True)
    summary["elapsed_s"] = time.perf_counter() - started_s
    summary["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    args.repeats_run = summary["repeats_run"] = 1 + max((run["repeat"] for run in summary["runs"]), default=-1)
    rows, stats = summarize_configs(grid, summary["predictions"], summary["runs"])
    summary.update(stats)
    summary["rows"] = rows
    print_tables(rows, stats, args)
    notes = next((p["notes"] for p in summary["predictions"].values() if "notes" in p), [])
    for line in notes:
        print(f"plan: {line}")
    print(f"elapsed {summary['elapsed_s'] / 60:.1f} min (estimated {estimate['total_s'] / 60:.1f}); summary: {out}")
    save()
    return 0 if any("measured" in run for run in summary["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
