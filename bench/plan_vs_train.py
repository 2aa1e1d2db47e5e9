"""Predicted vs measured step time: `plait plan --cluster local` against `plait train`
for every (dp, tp, pp) layout of 4 processes, on plait train's default GPT.

    .venv/bin/python bench/plan_vs_train.py [--steps 40] [--warmup 5] [--layouts 4x1x1,1x1x4]
                                           [--recompute none,selective,full] [--zero-stages 0,1,2,3]
                                           [--offload-optimizer]
                                           [--out bench-results/plan-vs-train/summary.json]

Per layout (dp x tp x pp, 4 processes, gloo on CPU):

- prediction: one `plait plan --cluster local --nprocs 4 --global-batch 16 --dp D --tp T
  --pp P --micro-batch 4 --schedule 1f1b|none --recompute MODE --zero-stage 0
  --no-sequence-parallel --untied-head --top 1 --json` (schedule none when pp = 1),
  i.e. what plait train runs by default (fp32 AdamW, 4 layers, hidden 128, 4 heads,
  seq 64, an untied head, global batch 16, micro-batch 4; --untied-head because plait
  train's head is untied by default, while plait plan's GPT defaults to a tied one);
  its `step_time_s` and `time_breakdown_s`;
- measurement: one `plait train --dp D --tp T --pp P --steps N --eval-interval 0
  --checkpoint-interval 0 --sample-chars 0 --out DIR`; the measured step time is the
  median of rank 0's per-step wall times (`step_s` in metrics.jsonl) with the first
  --warmup steps excluded.

Each layout runs once per --recompute mode (plait train --recompute MODE, the plan
priced with the same mode) and, with dp > 1, once per --zero-stages stage (plait train
--zero-stage S, the plan priced with --zero-stage S; with --offload-optimizer each stage
> 0 once more with plait train --offload optimizer, priced with plait plan
--offload-optimizer). A memory table sets the plan's per-rank bytes (its worst
pipeline rank: activations, parameters, gradients, optimizer state) beside the
run's report (the largest over the ranks: activations measured from live storages
through weak references, model state from live tensors).

The split is compared per step under this mapping (plait train's StepTimes / plan's
time_breakdown_s):

    compute  = compute
    comm     = tp_comm + dp_comm       (trainer: tp collectives, dp gradient averaging,
                                        grad-norm and loss all-reduces)
    bubble   = pp_comm + pp_bubble     (trainer: pipeline waits incl. activations and
                                        gradients in flight)
    other    = optimizer               (trainer: optimizer step, data, bookkeeping)

The measured split comes from report.json's time totals (summed over the 4 ranks and
over every step, warm-up included), so it is taken as fractions and scaled to the
median step time above: a per-step, mean-over-ranks split. A last table sets the
time plait.comm recorded inside its collectives (calls and ms per step, mean over
ranks, all steps) beside the trainer's comm and the plan's: the trainer's comm also
holds each collective's argument check (PLAIT_COMM_CHECK, on by default), gradient
flattening and waiting for the slowest peer.

How to read it: ratios are measured / predicted on this machine, with the plan's
own measurements of this machine (its matmul rate with 4 processes on these cores,
and the `plait calibrate` link profile if one is saved, else a placeholder link).
The rank columns and the Spearman correlation say whether the plan orders the
layouts right, which is what a planner needs; the geometric-mean ratio says how far
its absolute times are off. Measured steps include Python, autograd and optimizer
overheads and OS scheduling noise (4 processes time-sharing the cores) that the
plan does not model, so a ratio > 1 everywhere is expected; a ratio that differs
by layout is a modelling error. Other jobs on the machine disturb the timings (on a
2-core machine, repeated invocations differed by up to 1.3x per layout): the load
average before each run (which still counts the previous run) is in the JSON, and
layouts whose measured times are within that noise may swap ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
RECOMPUTE_MODES = ("none", "selective", "full")
NPROCS = 4
GLOBAL_BATCH, MICRO_BATCH = 16, 4
SPLIT = ("compute", "comm", "bubble", "other")
PLAN_PARTS = {"compute": ("compute",), "comm": ("tp_comm", "dp_comm"), "bubble": ("pp_comm", "pp_bubble"),
              "other": ("optimizer",)}


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


def tail(text: str, chars: int = 2000) -> str:
    return text[-chars:].rstrip()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc): torchrun's workers run in sessions
    of their own, so killing the launcher's process group does not reach them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def run_command(command: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``command`` in its own session. Past ``timeout_s``: SIGTERM to its process group
    (torchrun then stops its workers, up to 20 s), then SIGKILL, by pid, to every process
    it had started that is still alive (the same command line); then RuntimeError with
    the output's tail."""
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            started = {pid: _cmdline(pid) for pid in descendants(process.pid)}
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            for pid, cmdline in started.items():
                if cmdline is not None and _cmdline(pid) == cmdline:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if process.poll() is None:
                process.kill()
            stdout, stderr = process.communicate()
            raise RuntimeError(f"{' '.join(command[1:4])} timed out after {timeout_s:.0f} s:\n"
                               f"{tail(stderr or stdout)}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def predict(dp: int, tp: int, pp: int, env: dict, timeout_s: float, recompute: str = "none", zero: int = 0,
            offload: bool = False) -> dict:
    """One `plait plan --json` for this fixed layout: its first (only) plan."""
    command = [sys.executable, "-m", "plait", "plan", "--cluster", "local", "--nprocs", str(NPROCS),
               "--global-batch", str(GLOBAL_BATCH), "--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
               "--micro-batch", str(MICRO_BATCH), "--schedule", "none" if pp == 1 else "1f1b",
               "--recompute", recompute, "--zero-stage", str(zero), "--no-sequence-parallel", "--untied-head", "--top", "1",
               "--json"] + (["--offload-optimizer"] if offload else [])
    started_s = time.perf_counter()
    result = run_command(command, env, timeout_s)
    if result.returncode:
        raise RuntimeError(f"plait plan exited {result.returncode}:\n{tail(result.stderr or result.stdout)}")
    plans = json.loads(result.stdout)
    if not plans:
        raise RuntimeError(f"plait plan found no feasible plan:\n{tail(result.stderr)}")
    plan = plans[0]
    parts = plan["time_breakdown_s"]
    return {"command": " ".join(command[1:]), "seconds": time.perf_counter() - started_s,
            "notes": result.stderr.strip().splitlines(), "step_s": plan["step_time_s"], "breakdown_s": parts,
            "split_s": {name: sum(parts.get(key, 0.0) for key in keys) for name, keys in PLAN_PARTS.items()},
            "memory_bytes": plan["memory_breakdown_bytes"],  # the worst pipeline rank's
            "layout": {key: plan.get(key) for key in ("dp", "tp", "pp", "micro_batch", "num_microbatches",
                                                       "schedule", "stage_layers", "algorithms")}}


def measure(dp: int, tp: int, pp: int, steps: int, warmup: int, run_dir: Path, env: dict,
            timeout_s: float, recompute: str = "none", zero: int = 0, offload: bool = False) -> dict:
    """One `plait train` run of this layout: median step time after warm-up, and the split."""
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "plait", "train", "--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
               "--steps", str(steps), "--eval-interval", "0", "--checkpoint-interval", "0",
               "--sample-chars", "0", "--recompute", recompute, "--zero-stage", str(zero), "--out", str(run_dir)] \
        + (["--offload", "optimizer"] if offload else [])
    load_before = os.getloadavg()
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
    totals = report["time_totals"]
    median_s = statistics.median(steady_s)
    quartiles = statistics.quantiles(steady_s, n=4) if len(steady_s) >= 2 else [median_s] * 3
    split_total_s = sum(totals[f"{name}_s"] for name in SPLIT)
    rank_steps = totals["ranks"] * len(step_times_s)
    per_rank = report.get("collectives", {}).get("per_rank", {})
    calls = [sum(entry["calls"] for entry in stats.values()) for stats in per_rank.values()]
    collective_s = [sum(entry["time_s"] for entry in stats.values()) for stats in per_rank.values()]
    return {"command": " ".join(command[1:]), "command_s": command_s, "load_average_before": load_before,
            "step_s": median_s, "step_p25_s": quartiles[0], "step_p75_s": quartiles[2],
            "mean_step_s": statistics.fmean(steady_s), "steps_measured": len(steady_s),
            "warmup_steps_excluded": len(step_times_s) - len(steady_s), "step_times_s": step_times_s,
            # fractions of all ranks' time over all steps, scaled to the median steady step
            "split_fraction": {name: totals[f"{name}_s"] / split_total_s for name in SPLIT},
            "split_s": {name: median_s * totals[f"{name}_s"] / split_total_s for name in SPLIT},
            "split_mean_per_rank_step_s": {name: totals[f"{name}_s"] / rank_steps for name in SPLIT},
            # what plait.comm recorded inside its collectives (the trainer's comm adds argument
            # checks, flattening, the grad-norm and waiting for the slowest peer)
            "collective_calls_per_step": max(calls) / len(step_times_s) if calls else 0.0,
            "collective_mean_per_rank_step_s": sum(collective_s) / rank_steps if calls else 0.0,
            "collective_per_call_s": sum(collective_s) / sum(calls) if calls and sum(calls) else None,
            "slowest_rank": report.get("slowest_rank"), "ranks": report.get("ranks"),
            "mfu_steady": report.get("mfu", {}).get("steady_value"),
            "time_to_first_step_s": report.get("time_to_first_step_s"),
            "memory_bytes": measured_memory(report.get("memory") or [])}


def measured_memory(rows: list[dict]) -> dict:
    """The largest figure over the ranks (the plan prices the worst pipeline rank):
    activations measured from live storages, parameters, gradients, optimizer state."""
    keys = {"activations": "saved_activations_peak_bytes", "parameters": "params_bytes",
            "gradients": "grads_bytes", "optimizer": "optimizer_bytes", "optimizer_in_files": "offloaded_bytes"}
    return {name: max((row.get(key) or 0) for row in rows) if rows else None for name, key in keys.items()}


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
    """Pearson correlation of the ranks (exact with ties)."""
    if len(xs) < 2:
        return None
    rx, ry = ranks_of(xs), ranks_of(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else None


def name_of(dp: int, tp: int, pp: int) -> str:
    return f"dp{dp} tp{tp} pp{pp}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="plait train steps per layout (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the median (default 5)")
    parser.add_argument("--layouts", default=None, help="subset, e.g. 4x1x1,1x1x4 (dp x tp x pp; default all six)")
    parser.add_argument("--out", default="bench-results/plan-vs-train/summary.json",
                        help="summary JSON; the runs go next to it (default bench-results/plan-vs-train/...)")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per plait command (default 1200)")
    parser.add_argument("--zero-stages", default="0",
                        help="comma list of ZeRO stages (0-3) to run each layout with dp > 1 with (3: layouts with "
                             "pp = 1 only; default 0)")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help="run each ZeRO stage > 0 once more with its optimizer state offloaded to files")
    parser.add_argument("--recompute", default="none",
                        help="comma list of recompute modes to run each layout with (none, selective, full; "
                             "default none)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps({args.steps}) must exceed --warmup({args.warmup})")
    layouts = parse_layouts(args.layouts)
    modes = [mode.strip() for mode in args.recompute.split(",") if mode.strip()]
    if not modes or any(mode not in RECOMPUTE_MODES for mode in modes):
        parser.error(f"--recompute {args.recompute!r}: give modes out of {', '.join(RECOMPUTE_MODES)}")
    try:
        stages = [int(stage) for stage in args.zero_stages.split(",") if stage.strip()]
    except ValueError:
        stages = []
    if not stages or any(stage not in (0, 1, 2, 3) for stage in stages):
        parser.error(f"--zero-stages {args.zero_stages!r}: give stages out of 0, 1, 2, 3")
    out = Path(args.out)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    combos = [(layout, mode, zero, offload) for layout in layouts for mode in modes for zero in stages
              for offload in ((False, True) if args.offload_optimizer and zero else (False,))
              if (zero == 0 or layout[0] > 1) and (zero < 3 or layout[2] == 1)]
    for (dp, tp, pp), mode, zero, offload in combos:
        name = name_of(dp, tp, pp) + ("" if modes == ["none"] else f" {mode}") + (f" zero{zero}" if zero else "") \
            + (" offload" if offload else "")
        row = {"layout": name, "dp": dp, "tp": tp, "pp": pp, "recompute": mode, "zero_stage": zero,
               "offload_optimizer": offload}
        run_dir = out.parent / (f"dp{dp}-tp{tp}-pp{pp}" + ("" if mode == "none" else f"-{mode}")
                                + (f"-zero{zero}" if zero else "") + ("-offload" if offload else ""))
        for key, job in (("predicted", lambda: predict(dp, tp, pp, env, args.timeout_s, mode, zero, offload)),
                         ("measured", lambda: measure(dp, tp, pp, args.steps, args.warmup, run_dir, env,
                                                      args.timeout_s, mode, zero, offload))):
            try:
                row[key] = job()
            except (RuntimeError, OSError, ValueError, KeyError) as error:
                row[f"{key}_error"] = f"{type(error).__name__}: {error}"
                print(f"{row['layout']}: {key} failed: {error}", file=sys.stderr)
        predicted = row.get("predicted", {}).get("step_s")
        measured = row.get("measured", {}).get("step_s")
        print(f"{row['layout']}: predicted {predicted * 1e3 if predicted else float('nan'):.1f} ms, "
              f"measured {measured * 1e3 if measured else float('nan'):.1f} ms", file=sys.stderr, flush=True)
        rows.append(row)

    both = [row for row in rows if "predicted" in row and "measured" in row]
    predicted_ranks = ranks_of([row["predicted"]["step_s"] for row in both])
    measured_ranks = ranks_of([row["measured"]["step_s"] for row in both])
    for row, rp, rm in zip(both, predicted_ranks, measured_ranks):
        row["ratio"] = row["measured"]["step_s"] / row["predicted"]["step_s"]
        row["predicted_rank"], row["measured_rank"] = rp, rm
    rho = spearman([row["predicted"]["step_s"] for row in both], [row["measured"]["step_s"] for row in both])
    geomean = math.exp(statistics.fmean(math.log(row["ratio"]) for row in both)) if both else None

    def ms(value):
        return f"{value * 1e3:.1f}" if value is not None else "-"

    print(f"{'layout':<24}{'pred ms':>9}{'meas ms':>9}{'(p25-p75)':>14}{'meas/pred':>10}{'pred rank':>10}"
          f"{'meas rank':>10}")
    for row in rows:
        p, m = row.get("predicted"), row.get("measured")
        spread = f"({ms(m['step_p25_s'])}-{ms(m['step_p75_s'])})" if m else ""
        print(f"{row['layout']:<24}{ms(p and p['step_s']):>9}{ms(m and m['step_s']):>9}{spread:>14}"
              f"{(format(row['ratio'], '.2f') + 'x') if 'ratio' in row else '-':>10}"
              f"{format(row['predicted_rank'], 'g') if 'ratio' in row else '-':>10}"
              f"{format(row['measured_rank'], 'g') if 'ratio' in row else '-':>10}")
    print(f"Spearman rank correlation (predicted vs measured step time, {len(both)} layouts): "
          f"{'-' if rho is None else format(rho, '.3f')}")
    print(f"geometric-mean measured/predicted: {'-' if geomean is None else format(geomean, '.2f') + 'x'}")
    print(f"(measured: median of rank 0's step times, first {args.warmup} of {args.steps} steps excluded)")
    print()
    print("split per step, ms: predicted / measured (compute = compute; comm = tp_comm + dp_comm; "
          "bubble = pp_comm + pp_bubble; other = optimizer)")
    print(f"{'layout':<24}" + "".join(f"{name:>18}" for name in SPLIT))
    for row in both:
        cells = [f"{ms(row['predicted']['split_s'][name])} / {ms(row['measured']['split_s'][name])}"
                 for name in SPLIT]
        print(f"{row['layout']:<24}" + "".join(f"{cell:>18}" for cell in cells))
    print()
    print("collectives per step (plait.comm's own record, mean over ranks) vs the trainer's comm and the plan's:")
    print(f"{'layout':<24}{'calls':>7}{'ms/call':>9}{'recorded ms':>13}{'trainer comm ms':>17}{'plan comm ms':>14}")
    for row in both:
        m = row["measured"]
        per_call = m["collective_per_call_s"]
        print(f"{row['layout']:<24}{m['collective_calls_per_step']:>7.1f}{ms(per_call):>9}"
              f"{ms(m['collective_mean_per_rank_step_s']):>13}{ms(m['split_mean_per_rank_step_s']['comm']):>17}"
              f"{ms(row['predicted']['split_s']['comm']):>14}")
    print()
    print("memory per rank, MiB: predicted (the plan's worst pipeline rank) / measured (the largest over the "
          "ranks: activations from live storages, model state from live tensors); ratio = measured / predicted")
    print(f"{'layout':<24}{'activations':>20}{'ratio':>7}{'params':>16}{'grads':>16}{'optimizer':>16}")
    for row in both:
        p, m = row["predicted"]["memory_bytes"], row["measured"]["memory_bytes"]

        def cell(key):
            return f"{p[key] / 2 ** 20:.2f} / {m[key] / 2 ** 20:.2f}" if m.get(key) is not None else "-"

        ratio = m["activations"] / p["activations"] if m.get("activations") and p["activations"] else None
        row["memory_ratio"] = ratio
        print(f"{row['layout']:<24}{cell('activations'):>20}{'-' if ratio is None else format(ratio, '.3f'):>7}"
              f"{cell('parameters'):>16}{cell('gradients'):>16}{cell('optimizer'):>16}")
    print("plan breakdown, ms: " + "; ".join(
        f"{row['layout']}: " + " ".join(f"{key} {value * 1e3:.1f}" for key, value in
                                        row["predicted"]["breakdown_s"].items()) for row in both))
    notes = next((row["predicted"]["notes"] for row in rows if "predicted" in row), [])
    for line in notes:
        print(f"plan: {line}")

    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"steps": args.steps, "warmup_steps_excluded": args.warmup, "nprocs": NPROCS,
               "plait_comm_check": os.environ.get("PLAIT_COMM_CHECK", "1"),
               "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH, "cpu_count": os.cpu_count(),
               "spearman": rho, "geomean_ratio": geomean, "plan_notes": notes, "split_mapping": PLAN_PARTS,
               "layouts": rows}
    out.write_text(json.dumps(summary, indent=1))
    print(f"summary: {out}")
    measured_any = any("measured" in row for row in rows)
    return 0 if measured_any else 1


if __name__ == "__main__":
    raise SystemExit(main())
