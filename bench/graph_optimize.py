"""`plait optimize --bench` on every example model (plait.graph.examples), one table.

    .venv/bin/python bench/graph_optimize.py                       # batches 1 and 32, ~2 min on 2 cores
    .venv/bin/python bench/graph_optimize.py --batches 8 --repeats 7 --out bench-results/graph

Each run is the real command (plait.cli.main.main), its output and report (report.md,
report.json, graph-before.png, graph-after.png) kept under --out/MODEL-bBATCH/. Per model
and batch: the rules that fired, plait's predicted saving per forward (FLOPs; bytes read +
written that disappear), the measured latency before (the eager module) and after (the
rewritten GraphModule), median and min-max over the alternating samples, plait's speedup
(the median over the repeats of eager / plait within a repeat, and in brackets the ratio
of minima: on a shared machine the minimum is the sample least disturbed by others),
the speedup of the traced graph with no rules (what tracing alone does), and the peers'
speedups with their correctness (torch.fx.experimental.optimization.fuse,
torch.ao.quantization.fuse_modules; "-" where they do not apply).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch

from plait.cli.main import main
from plait.graph.examples import EXAMPLES

LEAVES = {"gpt_eval": "plait.graph.examples:GPT_LEAF_MODULES"}


def run_one(name: str, batch: int, repeats: int, out: Path) -> dict:
    """`plait optimize plait.graph.examples:NAME --bench ...`; its report.json."""
    directory = out / f"{name}-b{batch}"
    argv = ["optimize", f"plait.graph.examples:{name}", "--bench", "--batch", str(batch), "--repeats", str(repeats),
            "--report", str(directory)]
    if name in LEAVES:
        argv += ["--leaf", LEAVES[name]]
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        status = main(argv)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "stdout.txt").write_text(captured.getvalue())
    if status != 0:
        raise SystemExit(f"plait {' '.join(argv)} exited {status}:\n{captured.getvalue()}")
    return json.loads((directory / "report.json").read_text())


def _peer(rows: dict, name: str) -> str:
    row = rows.get(name)
    if row is None or row["skipped"]:
        return "-"
    return f"{row['speedup']:.2f}x" + ("" if row["correct"] else " WRONG")


def _ms(row: dict) -> str:
    timing = row["timing"]
    return f"{timing['median_s'] * 1e3:.3f} ({timing['min_s'] * 1e3:.3f}-{timing['max_s'] * 1e3:.3f})"


def table_line(name: str, batch: int, result: dict) -> str:
    rows = {row["name"]: row for row in result["bench"]["rows"]}
    report = result["report"]
    plait, eager = rows["plait optimize"], rows["eager (before)"]
    best = eager["timing"]["min_s"] / plait["timing"]["min_s"]
    return (f"| {name} | {batch} | {result['rules_fired']} | {report['predicted_flops_saved']:,.0f} | "
            f"{report['predicted_bytes_saved']:,.0f} | {_ms(eager)} | {_ms(plait)} | "
            f"{plait['speedup']:.2f}x{'' if plait['correct'] else ' WRONG'} ({best:.2f}x) | "
            f"{_peer(rows, 'traced, no rules')} | "
            f"{_peer(rows, 'torch.fx fuse')} | {_peer(rows, 'fuse_modules')} |")


def main_bench(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32", help="comma list of batch sizes (default 1,32)")
    parser.add_argument("--repeats", type=int, default=15, help="timing samples per variant (default 15)")
    parser.add_argument("--models", default=",".join(EXAMPLES), help=f"comma list (default {','.join(EXAMPLES)})")
    parser.add_argument("--out", default="bench-results/graph_optimize", help="reports go here")
    args = parser.parse_args(argv)
    batches = [int(batch) for batch in args.batches.split(",")]
    models = [name for name in args.models.split(",") if name]
    unknown = [name for name in models if name not in EXAMPLES]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(EXAMPLES)}")
    print(f"# plait optimize --bench on plait.graph.examples; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, float32, {args.repeats} alternating samples per variant; "
          f"latency ms per call: median (min-max); speedup = median over the repeats of eager / variant "
          f"(plait's in brackets: eager min / plait min, the least disturbed samples)")
    print("| model | batch | rules fired | predicted FLOPs saved | predicted bytes saved | eager ms | plait ms | "
          "plait speedup | traced, no rules | torch.fx fuse | fuse_modules |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    results = {}
    load_before = os.getloadavg()[0]
    for batch in batches:
        for name in models:
            result = run_one(name, batch, args.repeats, Path(args.out))
            results[f"{name}-b{batch}"] = result
            print(table_line(name, batch, result), flush=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"reports: {args.out}/MODEL-bBATCH/report.md; 1-minute load average {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after (this run itself adds about its {torch.get_num_threads()} threads; "
          f"more means other processes shared the CPU, and the samples' max shows it)")
    return 0


if __name__ == "__main__":
    sys.exit(main_bench())
