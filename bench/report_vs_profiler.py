"""The run report's step parts against an independent measurement, torch.profiler, on
one short plait train run (4 processes; default dp2 x pp2, transport gloo).

    .venv/bin/python bench/report_vs_profiler.py [--dp 2 --tp 1 --pp 2] [--steps 10] [--warmup 3]
        [--transport gloo] [--zero-stage 0] [--recompute none] [--keep-traces]
        [--out bench-results/report-vs-profiler/summary.json]

How: this script spawns 4 gloo workers (plait.bench.launch) and each builds plait
train's own Trainer (plait.train.loop) in-process: nothing is added to the library. A
worker trains --warmup steps unprofiled (``Trainer.train(until=W)``), then the run's
--steps steps (``Trainer.train()`` starts again from the run's start step) under
``torch.profiler.profile(activities=[CPU])``; the report's side is the Trainer's own
per-part totals (``trainer.times``, what report.json sums) taken before and after, so
both sides cover the same steps. Each rank attributes its own trace:

- window: from the profiler's start to the end of the last optimizer step (what
  follows, the final checkpoint and the report, is left out);
- optimizer: torch's own ``Optimizer.step#AdamW.step`` records (ZeRO's inner AdamW
  step; ZeRO's parameter all-gather runs outside it);
- compute: the time the training thread spends inside aten / autograd ops, outside the
  optimizer and outside c10d ops. Independent of plait's timers, but it also holds the
  small ops of plait's collectives (flattening, copies, the reductions of a p2p
  all-reduce) and of data batching, and it lacks the Python between the forward and
  backward ops that the report's compute (the engine's busy intervals) holds;
- communication: c10d ops on the training thread (posting sends and receives), plus
  the gaps in which no op runs while a gloo receive or collective is in flight (the
  rank is waiting for a peer), and gaps with only sends in flight. With --transport
  gloo every plait message is a gloo op the profiler records (gloo:send, gloo:recv,
  gloo:all_gather ...); with shm (plait's shared memory) the profiler sees none, and
  waiting shows as plain idle time;
- idle: gaps with nothing in flight: Python bookkeeping, data, between-step work.

What the profiler can NOT tell apart: a receive waiting for a peer still computing
(pp_bubble) from one waiting for bytes in flight (pp_comm), nor tp from dp
communication (gloo's records carry no group): the comparison sums tp_comm + pp_comm
+ pp_bubble + dp_comm (and the receive waits) against the profiler's communication.
Both sides add up to the same window: the report's rest is data + other + the time
between its steps (loop bookkeeping outside any step). The profiler's own overhead
(a few us per op) is inside both sides alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist
from torch.profiler import profile, ProfilerActivity

from plait.bench.launch import Job, spawn_and_run, WorkerError
from plait.train.config import TrainConfig
from plait.train.loop import Trainer

NPROCS = 4
OPTIMIZER_RECORD = "Optimizer.step#"
REPORT_GROUPS = {"compute": ("compute_s",), "optimizer": ("optimizer_s",),
                 "communication": ("tp_comm_s", "pp_comm_s", "receive_s", "pp_bubble_s", "dp_comm_s"),
                 "rest": ("data_s", "other_s")}
# an older report (StepTimes before the fine parts): compute / comm + bubble / other
COARSE_GROUPS = {"compute": ("compute_s",), "optimizer": (), "communication": ("comm_s", "bubble_s"),
                 "rest": ("other_s",)}


@dataclass(frozen=True)
class ProfileJob:
    dp: int
    tp: int
    pp: int
    steps: int
    warmup: int
    transport: str
    zero_stage: int
    recompute: str
    out: str
    keep_traces: bool
    timeout_s: float = 600.0


# ---- intervals (sorted, disjoint (start, end) lists) -------------------------------------

def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    """a minus b (both unions), in one pass over each."""
    out, first = [], 0
    for start, end in a:
        while first < len(b) and b[first][1] <= start:
            first += 1
        index = first
        while index < len(b) and b[index][0] < end and start < end:
            if b[index][0] > start:
                out.append((start, b[index][0]))
            start = max(start, b[index][1])
            index += 1
        if start < end:
            out.append((start, end))
    return out


def attribute(events: list[dict], main_tid: int) -> dict:
    """One rank's chrome-trace events -> seconds per profiler part over the window (module
    docstring); the parts add up to the window."""
    spans = [event for event in events if event.get("ph") == "X" and "dur" in event]

    def interval(event):
        return (event["ts"] * 1e-6, (event["ts"] + event["dur"]) * 1e-6)

    main = [event for event in spans if event.get("tid") == main_tid]
    optimizer = union(interval(e) for e in main if e.get("name", "").startswith(OPTIMIZER_RECORD))
    if not optimizer:
        raise ValueError(f"no {OPTIMIZER_RECORD}* record on the training thread (tid {main_tid})")
    trace = [e for e in spans if e.get("cat") == "Trace"]
    window = [(interval(trace[0])[0] if trace else min(interval(e)[0] for e in main), optimizer[-1][1])]
    ops = intersect(union(interval(e) for e in main if e.get("cat") == "cpu_op"), window)
    c10d = intersect(union(interval(e) for e in main if e.get("cat") == "cpu_op"
                           and e.get("name", "").startswith("c10d::")), window)
    gloo = [e for e in spans if e.get("name", "").startswith("gloo:")]
    waiting_on = union(interval(e) for e in gloo if e["name"] != "gloo:send")
    sending = union(interval(e) for e in gloo if e["name"] == "gloo:send")
    gaps = subtract(window, union(ops + optimizer))
    other_threads = intersect(union(interval(e) for e in spans if e.get("tid") != main_tid
                                    and e.get("cat") == "cpu_op"), window)
    counts: dict[str, int] = {}
    for event in gloo + [e for e in main if e.get("name", "").startswith("c10d::")]:
        if window[0][0] <= interval(event)[0] <= window[0][1]:
            counts[event["name"]] = counts.get(event["name"], 0) + 1
    return {"window_s": length(window), "optimizer_s": length(intersect(optimizer, window)),
            "compute_ops_s": length(subtract(subtract(ops, optimizer), c10d)),
            "c10d_s": length(subtract(c10d, optimizer)),
            "wait_receive_s": length(intersect(gaps, waiting_on)),
            "wait_send_only_s": length(intersect(subtract(gaps, waiting_on), sending)),
            "idle_s": length(subtract(subtract(gaps, waiting_on), sending)),
            "optimizer_steps": sum(1 for start, _ in optimizer if start >= window[0][0]),
            "other_threads_ops_s": length(other_threads), "comm_op_counts": counts}


def profiler_groups(parts: dict) -> dict:
    return {"compute": parts["compute_ops_s"], "optimizer": parts["optimizer_s"],
            "communication": parts["c10d_s"] + parts["wait_receive_s"] + parts["wait_send_only_s"],
            "rest": parts["idle_s"], "window": parts["window_s"]}


def report_groups(before: dict, after: dict, window_s: float) -> dict:
    """The report's parts over the profiled steps (after - before), grouped as the profiler's;
    rest also holds the window's time between steps (window - the steps' wall)."""
    diff = {key: after[key] - before.get(key, 0.0) for key in after if isinstance(after[key], (int, float))}
    groups = REPORT_GROUPS if "tp_comm_s" in diff else COARSE_GROUPS
    out = {name: sum(diff.get(key, 0.0) for key in keys) for name, keys in groups.items()}
    out["between_steps"] = window_s - diff["wall_s"]
    out["rest"] += out["between_steps"]
    out["window"] = window_s
    return {"groups": out, "parts_s": diff, "fine": groups is REPORT_GROUPS}


def _totals(trainer: Trainer) -> dict:
    """The Trainer's per-part totals so far (plait.train.step_breakdown.StepTotals.total, or
    the older dict of compute/comm/bubble/other)."""
    times = trainer.times
    return dict(times.total) if hasattr(times, "total") else dict(times)


def profile_rank(job: ProfileJob, *, device, emit) -> None:
    """Every worker: train the warm-up, then the profiled steps; attribute this rank's trace."""
    rank = dist.get_rank()
    # train(until=W) stops after W steps without moving the run's start step: the second train() trains
    # job.steps steps from the start again (counted below on both sides, not assumed)
    config = TrainConfig(dp=job.dp, tp=job.tp, pp=job.pp, steps=job.steps, eval_interval=0,
                         checkpoint_interval=0, log_interval=job.steps, transport=job.transport,
                         zero_stage=job.zero_stage, recompute=job.recompute, out=job.out, timeout_s=job.timeout_s)
    trainer = Trainer(config, log=print if rank == 0 else (lambda *_: None))
    trainer.train(until=job.warmup)
    before, steps_before = _totals(trainer), getattr(trainer.times, "steps", None)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        trainer.train()
    after = _totals(trainer)
    trace_path = Path(job.out) / f"trace-rank{rank}.json"
    profiler.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    if not job.keep_traces:
        trace_path.unlink()
    parts = attribute(events, threading.get_native_id())
    mine = {"rank": rank, "coords": dict(trainer.coords), "profiler": parts,
            "report": report_groups(before, after, parts["window_s"]),
            "steps_in_report": None if steps_before is None else trainer.times.steps - steps_before}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if emit is not None:
        emit("row", everyone)


def print_table(ranks: list[dict]) -> None:
    names = ("compute", "optimizer", "communication", "rest", "window")
    print("ms per profiled step: report (plait's timers) / profiler (torch.profiler), per rank")
    print(f"{'rank':<18}" + "".join(f"{name:>22}" for name in names) + f"{'steps':>10}")
    for row in ranks:
        steps = row["profiler"]["optimizer_steps"]
        report, prof = row["report"]["groups"], profiler_groups(row["profiler"])
        cells = [f"{1e3 * report[name] / steps:.1f} / {1e3 * prof[name] / steps:.1f}" for name in names]
        coords = row["coords"]
        print(f"{row['rank']} (dp{coords['dp']} tp{coords['tp']} pp{coords['pp']})".ljust(18)
              + "".join(f"{cell:>22}" for cell in cells) + f"{str(row['steps_in_report']) + ' / ' + str(steps):>10}")
    for row in ranks:
        p = row["profiler"]
        steps = p["optimizer_steps"]
        print(f"rank {row['rank']}: profiler communication = c10d ops {1e3 * p['c10d_s'] / steps:.1f} + waiting "
              f"with a receive/collective in flight {1e3 * p['wait_receive_s'] / steps:.1f} + with only sends "
              f"{1e3 * p['wait_send_only_s'] / steps:.1f} ms/step; report rest holds "
              f"{1e3 * row['report']['groups']['between_steps'] / steps:.1f} ms/step between its steps; "
              f"ops on other threads {1e3 * p['other_threads_ops_s'] / steps:.1f} ms/step; gloo/c10d ops: "
              + ", ".join(f"{name} {count}" for name, count in sorted(p["comm_op_counts"].items())))
    print("The profiler attributes independently: the optimizer step (torch's own record), the time inside "
          "aten/autograd ops (compute, plus the small ops of collectives and batching), c10d posting, and the "
          "waits while a gloo message is in flight. It cannot tell a pipeline bubble from a transfer (both are a "
          "pending receive), nor tp from dp traffic (no group on gloo's records), nor Python from a thread "
          "waiting for a core (both are a gap with no op): the report's communication minus the profiler's is "
          "plait.comm's Python between messages and the scheduling delay of 4 ranks on the cores.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="the run's steps, all profiled (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="steps trained first, unprofiled (default 3)")
    parser.add_argument("--transport", default="gloo", choices=("gloo", "shm", "auto"),
                        help="gloo (default): every message is a gloo op the profiler records")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    parser.add_argument("--keep-traces", action="store_true", help="keep each rank's chrome trace in the run directory")
    parser.add_argument("--out", default="bench-results/report-vs-profiler/summary.json")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.dp * args.tp * args.pp != NPROCS:
        parser.error(f"dp({args.dp}) * tp({args.tp}) * pp({args.pp}) = {args.dp * args.tp * args.pp} != {NPROCS}")
    if not 1 <= args.warmup <= args.steps:
        parser.error(f"--warmup({args.warmup}) must be in 1..--steps({args.steps})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=out.parent))
    job = ProfileJob(dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps, warmup=args.warmup,
                     transport=args.transport, zero_stage=args.zero_stage, recompute=args.recompute,
                     out=str(run_dir), keep_traces=args.keep_traces, timeout_s=args.timeout_s)
    load_before, started_s = os.getloadavg(), time.perf_counter()
    try:
        rows = spawn_and_run(Job(profile_rank, job), NPROCS, "gloo", lambda kind, payload: None,
                             label="report_vs_profiler")
    except WorkerError as error:
        print(str(error), file=sys.stderr)
        return 1
    finally:
        if not args.keep_traces:
            shutil.rmtree(run_dir, ignore_errors=True)
    ranks = sorted(rows[0], key=lambda row: row["rank"])
    print_table(ranks)
    summary = {"argv": sys.argv if argv is None else argv, "job": asdict(job), "cpu_count": os.cpu_count(),
               "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "elapsed_s": time.perf_counter() - started_s, "load_average_before": load_before,
               "load_average_after": os.getloadavg(), "ranks": ranks,
               "profiler_groups_s": {str(row["rank"]): profiler_groups(row["profiler"]) for row in ranks}}
    out.write_text(json.dumps(summary, indent=1))
    print(f"elapsed {summary['elapsed_s']:.0f} s; summary: {out}" + (f"; traces: {run_dir}" if args.keep_traces
                                                                       else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
