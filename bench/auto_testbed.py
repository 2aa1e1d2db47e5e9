"""plait bench auto on the testbed's 2x2-slow cluster (2 hosts x 2 ranks, 100 Mbit
between them): the auto plan against data parallelism, the best single-strategy plan
and the knob search's, each predicted on the probed topology and then run on the
testbed's 4 ranks (needs root: network namespaces; everything is removed on every
exit path).

    .venv/bin/python bench/auto_testbed.py [--models wide_mlp,moe,mixer] [--size default]
        [--rounds 3] [--steps 3] [--profile PATH] [--out bench-results/auto-testbed]

Prediction: plait.bench.auto.plan_world on Cluster("local") grouped into the probed
hosts (plait.plan.cluster.topology_cluster: the calibrated link within a host, the
probed 100 Mbit link between). Measurement: ``plait testbed run`` starts this script
on every rank (torchrun's environment), which runs plait.bench.auto.run_auto_bench
on the planned sides (pickled to --out by the parent) and rank 0 writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from pathlib import Path

from plait.bench.auto import AutoBenchConfig, plan_world, run_auto_bench, summarize
from plait.bench.launch import in_torchrun, Job, run_in_current_world
from plait.cli.bench_auto import _link, table_lines, verdict_lines
from plait.testbed import netns
from plait.testbed.probe import probe, profiled_topology
from plait.testbed.run import run_on_testbed
from plait.testbed.spec import PRESETS

PREFIX = "plait-tb-auto"
NPROCS = 4


def rank_main(job_path: str, rows_path: str) -> int:
    """One rank of the testbed's world: run the pickled sides, rank 0 writes the rows."""
    with open(job_path, "rb") as handle:
        job = pickle.load(handle)
    rows = run_in_current_world(Job(run_auto_bench, job), "gloo", lambda kind, row: print(row, flush=True))
    if int(os.environ["RANK"]) == 0:
        Path(rows_path).write_text(json.dumps(rows))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="wide_mlp,moe,mixer")
    parser.add_argument("--size", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--profile", default=None, help="calibration profile for the link within a host")
    parser.add_argument("--out", default="bench-results/auto-testbed")
    args = parser.parse_args()
    netns.check_privileges()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = AutoBenchConfig(models=tuple(args.models.split(",")), nprocs=(NPROCS,), size=args.size,
                             rounds=args.rounds, steps=args.steps, warmup=args.warmup, timeout_s=900.0)
    problems = config.problems()
    if problems:
        raise SystemExit("; ".join(problems))
    link, overhead_s, source = _link(args.profile)
    testbed = netns.Testbed(PRESETS["2x2-slow"], prefix=PREFIX)
    testbed.up()
    try:
        topology = profiled_topology(testbed, probe(testbed))
        job = plan_world(config, NPROCS, link, call_overhead_s=overhead_s, link_source=f"{source}; 2x2-slow probed",
                         topology=topology)
        job_path, rows_path = out / "job.pickle", out / "rows.json"
        job_path.write_bytes(pickle.dumps(job))
        rows_path.unlink(missing_ok=True)
        with open(out / "ranks.log", "w") as log:
            status = run_on_testbed(testbed, [str(Path(__file__).resolve()), str(job_path), str(rows_path)],
                                    timeout_s=1800, output=log)
        if status:
            print(f"the testbed run exited {status}; see {out / 'ranks.log'}", file=sys.stderr)
            return 1
    finally:
        netns.down(PREFIX)
    table = summarize(job, json.loads(rows_path.read_text()), busy=False)
    (out / "table.json").write_text(json.dumps(table, indent=1, default=str))
    print(f"# testbed 2x2-slow (2 hosts x 2 ranks, 100 Mbit between); link within a host: {source}")
    for line in table_lines(table) + verdict_lines(table):
        print(line)
    return 0


if __name__ == "__main__":
    if in_torchrun():
        sys.exit(rank_main(sys.argv[1], sys.argv[2]))
    sys.exit(main())
