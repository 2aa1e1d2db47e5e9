"""Collectives on the testbed's shaped links: every algorithm measured, every plait
algorithm predicted by the simulator on the probed topology, per preset.

    .venv/bin/python bench/testbed_collectives.py [--presets 2x2-slow,partial-3+5,ring-one-slow]
        [--collectives all_reduce,all_gather,broadcast] [--min-bytes 1M] [--max-bytes 16M]
        [--rounds 3] [--out bench-results/testbed]

Per preset (needs root: network namespaces):

1. ``plait testbed up --preset P`` (torn down on every exit path);
2. ``plait testbed probe``: every host pair's TCP rate and latency, written as a
   topology (OUT/P/topology.json);
3. per collective, ``plait testbed run -- plait bench C --topology OUT/P/topology.json
   --predict --rounds R --json ...`` with ring, hierarchical (all-reduce), blink,
   synth (all-reduce, all-gather), torch and auto; ``plait bench`` alternates the
   algorithms inside every round (sizes outer) and reports each row's median round.

Summary per (preset, collective, size): the best topology-aware algorithm (blink,
synth, hierarchical) over the best of ring and torch; the prediction's MAPE per
algorithm over sizes >= 1 MiB; auto's regret (its time over the best measured plait
algorithm). Written to OUT/summary.json and printed as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from plait.cost.topology_io import save_topology
from plait.testbed import netns
from plait.testbed.probe import probe, profiled_topology
from plait.testbed.run import run_on_testbed
from plait.testbed.spec import PRESETS

PREFIX = "plait-tb-bench"
AWARE = ("hierarchical", "blink", "synth")
BASELINES = ("ring", "torch")
ALGORITHMS = {"all_reduce": ("ring", "hierarchical", "blink", "synth", "torch", "auto"),
              "all_gather": ("ring", "blink", "synth", "torch", "auto"),
              "broadcast": ("ring", "tree", "blink", "torch", "auto")}
LARGE_NBYTES = 1 << 20


def plait_executable() -> str:
    return str(Path(sys.executable).with_name("plait"))


def measure_preset(preset: str, collectives: list[str], args, out: Path) -> dict:
    testbed = netns.Testbed(PRESETS[preset], prefix=PREFIX)
    testbed.up()
    results = {}
    try:
        topology_path = save_topology(profiled_topology(testbed, probe(testbed)), out / "topology.json")
        for collective in collectives:
            json_path = out / f"{collective}.json"
            log_path = out / f"{collective}.txt"
            command = [plait_executable(), "bench", collective, "--algorithms", ",".join(ALGORITHMS[collective]),
                       "--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--factor", "4",
                       "--rounds", str(args.rounds), "--topology", str(topology_path), "--predict",
                       "--json", str(json_path), "--timeout", "600"]
            with open(log_path, "w") as log:
                status = run_on_testbed(testbed, command, timeout_s=3000, output=log)
            if status:
                raise RuntimeError(f"{preset} {collective}: plait bench exited {status}; see {log_path}")
            results[collective] = json.loads(json_path.read_text())
    finally:
        netns.down(PREFIX)
    return results


def summarize(preset: str, collective: str, rows: list[dict]) -> dict:
    by_size: dict[int, dict[str, dict]] = {}
    for row in rows:
        if row.get("error") is None and row.get("time_us"):
            by_size.setdefault(row["size_bytes"], {})[row["algorithm"]] = row
    sizes = []
    for size, algorithms in sorted(by_size.items()):
        aware = {name: row["time_us"] for name, row in algorithms.items() if name in AWARE}
        base = {name: row["time_us"] for name, row in algorithms.items() if name in BASELINES}
        plait_best = min(row["time_us"] for name, row in algorithms.items() if name not in ("torch", "auto"))
        entry = {"size_bytes": size, "times_us": {name: row["time_us"] for name, row in algorithms.items()}}
        if aware and base:
            best_aware, best_base = min(aware, key=aware.get), min(base, key=base.get)
            entry.update(best_aware=best_aware, best_baseline=best_base,
                         speedup=base[best_base] / aware[best_aware])
        if "auto" in algorithms:
            entry.update(auto_choice=algorithms["auto"].get("auto_choice"),
                         auto_regret=algorithms["auto"]["time_us"] / plait_best - 1)
        sizes.append(entry)
    errors: dict[str, list[float]] = {}
    for row in rows:
        if "error_pct" in row and row["size_bytes"] >= LARGE_NBYTES and row["algorithm"] != "auto":
            errors.setdefault(row["algorithm"], []).append(abs(row["error_pct"]))
    mape = {name: statistics.mean(values) for name, values in errors.items()}
    every = [value for values in errors.values() for value in values]
    return {"preset": preset, "collective": collective, "sizes": sizes, "mape_pct": mape,
            "mape_all_pct": statistics.mean(every) if every else None}


def markdown(summaries: list[dict]) -> list[str]:
    lines = ["| preset | collective | size | best aware / best of ring, torch | speedup | auto picks (regret) |",
             "|---|---|---|---|---|---|"]
    for summary in summaries:
        for entry in summary["sizes"]:
            if "speedup" not in entry:
                continue
            auto = (f"{entry['auto_choice']} ({100 * entry['auto_regret']:+.1f}%)"
                    if entry.get("auto_choice") else "-")
            lines.append(f"| {summary['preset']} | {summary['collective']} | {entry['size_bytes'] / 2**20:.2g} MiB | "
                         f"{entry['best_aware']} / {entry['best_baseline']} | {entry['speedup']:.2f}x | {auto} |")
    lines += ["", "| preset | collective | MAPE >= 1 MiB, per algorithm | all |", "|---|---|---|---|"]
    for summary in summaries:
        per = ", ".join(f"{name} {value:.1f}%" for name, value in summary["mape_pct"].items())
        overall = "-" if summary["mape_all_pct"] is None else f"{summary['mape_all_pct']:.1f}%"
        lines.append(f"| {summary['preset']} | {summary['collective']} | {per} | {overall} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="2x2-slow,partial-3+5,ring-one-slow")
    parser.add_argument("--collectives", default="all_reduce,all_gather,broadcast")
    parser.add_argument("--min-bytes", default="1M")
    parser.add_argument("--max-bytes", default="16M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench-results/testbed")
    args = parser.parse_args()
    presets = [name for name in args.presets.split(",") if name]
    collectives = [name for name in args.collectives.split(",") if name]
    unknown = [name for name in presets if name not in PRESETS] + [c for c in collectives if c not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown preset(s) or collective(s): {', '.join(unknown)}; presets: {', '.join(PRESETS)}; "
                     f"collectives: {', '.join(ALGORITHMS)}")
    netns.check_privileges()
    summaries = []
    for preset in presets:
        out = Path(args.out) / preset
        out.mkdir(parents=True, exist_ok=True)
        for collective, rows in measure_preset(preset, collectives, args, out).items():
            summaries.append(summarize(preset, collective, rows))
    Path(args.out, "summary.json").write_text(json.dumps(summaries, indent=1))
    print("\n".join(markdown(summaries)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
