"""Which axis should cross the slow link? plait plan's answer against plait train's
tokens/s on the 2x2-slow testbed (2 hosts x 2 ranks, 100 Mbit between them).

    .venv/bin/python bench/testbed_train.py [--steps 25] [--warmup 5] [--repeats 2]
        [--profile PATH] [--out bench-results/testbed-train]

plait train's default GPT at dp=2 x pp=2 in two mesh orders (needs root):

- ``tp,dp,pp`` (plait train's default): each dp pair on one host, the pipeline's
  stage boundary across the link (activations and their gradients cross it);
- ``tp,pp,dp``: each pipeline on one host, the dp pairs across the link (the gradient
  all-reduce crosses it).

Prediction: ``plait plan --cluster local --nprocs 4 --topology <probed topology>
--profile PATH`` for each order, the layout plait train runs (micro-batch 4, 1f1b, no
recompute, untied head). Measurement: ``plait testbed run -- plait train --mesh-order
ORDER --steps N ...``, the median step time of rank 0's metrics.jsonl after --warmup
steps, the orders alternated --repeats times. The plan ranks the orders right when
the faster predicted is the faster measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from plait.cost.topology_io import save_topology
from plait.testbed import netns
from plait.testbed.probe import probe, profiled_topology
from plait.testbed.run import run_on_testbed
from plait.testbed.spec import PRESETS

PREFIX = "plait-tb-train"
ORDERS = ("tp,dp,pp", "tp,pp,dp")
LAYOUT = ["--dp", "2", "--pp", "2", "--tp", "1"]


def plait_executable() -> str:
    return str(Path(sys.executable).with_name("plait"))


def predicted_step_s(topology_path: Path, profile: str | None, order: str) -> dict:
    command = [plait_executable(), "plan", "--cluster", "local", "--nprocs", "4", "--topology", str(topology_path),
               "--global-batch", "16", *LAYOUT, "--micro-batch", "4", "--schedule", "1f1b", "--recompute", "none",
               "--zero-stage", "0", "--untied-head", "--no-sequence-parallel", "--mesh-order", order, "--top", "1",
               "--json"]
    if profile:
        command += ["--profile", profile]
    best = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)[0]
    return {"step_time_s": best["step_time_s"], "time_breakdown_s": best["time_breakdown_s"]}


def measured_step_s(testbed, order: str, steps: int, warmup: int, out: Path) -> float:
    run_dir = out / f"train-{order.replace(',', '-')}"
    command = [plait_executable(), "train", *LAYOUT, "--mesh-order", order, "--steps", str(steps),
               "--eval-interval", "0", "--checkpoint-interval", "0", "--sample-chars", "0", "--out", str(run_dir),
               "--resume", "never", "--force-fresh"]
    with open(out / f"train-{order.replace(',', '-')}.log", "a") as log:
        status = run_on_testbed(testbed, command, timeout_s=900, output=log)
    if status:
        raise RuntimeError(f"plait train --mesh-order {order} exited {status}; see {log.name}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(row["step_s"] for row in rows if "step_s" in row and row["step"] > warmup)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", default=None, help="calibration profile for the plan's local link")
    parser.add_argument("--out", default="bench-results/testbed-train")
    args = parser.parse_args()
    netns.check_privileges()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    testbed = netns.Testbed(PRESETS["2x2-slow"], prefix=PREFIX)
    testbed.up()
    measured: dict[str, list[float]] = {order: [] for order in ORDERS}
    try:
        topology_path = save_topology(profiled_topology(testbed, probe(testbed)), out / "topology.json")
        predicted = {order: predicted_step_s(topology_path, args.profile, order) for order in ORDERS}
        for repeat in range(args.repeats):
            for order in ORDERS if repeat % 2 == 0 else reversed(ORDERS):
                measured[order].append(measured_step_s(testbed, order, args.steps, args.warmup, out))
    finally:
        netns.down(PREFIX)
    summary = {order: {"predicted_step_s": predicted[order]["step_time_s"],
                       "predicted_breakdown_s": predicted[order]["time_breakdown_s"],
                       "measured_step_s": statistics.median(measured[order]), "measured_runs_s": measured[order]}
               for order in ORDERS}
    faster_predicted = min(ORDERS, key=lambda order: summary[order]["predicted_step_s"])
    faster_measured = min(ORDERS, key=lambda order: summary[order]["measured_step_s"])
    summary["ranking_agrees"] = faster_predicted == faster_measured
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("| mesh order | crosses the 100 Mbit link | predicted step | measured step (median, runs) |")
    print("|---|---|---|---|")
    for order in ORDERS:
        entry = summary[order]
        runs = ", ".join(f"{value:.3f}" for value in entry["measured_runs_s"])
        crossing = "pipeline boundary" if order == "tp,dp,pp" else "dp all-reduce"
        print(f"| {order} | {crossing} | {entry['predicted_step_s']:.3f} s | {entry['measured_step_s']:.3f} s "
              f"({runs}) |")
    print(f"plan's faster: {faster_predicted}; measured faster: {faster_measured}; "
          f"ranking {'agrees' if summary['ranking_agrees'] else 'DISAGREES'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
