"""`plait bench memory`: recomputation x precision x activation offload, each run for
real with `plait train` on 4 processes, its measured activation memory against plait's
formula and Korthikanti et al.'s, its step time, the memory-time frontier as a PNG,
and plait's techniques against their torch peers on one process (plait.bench.memory).

    plait bench memory                                  # the whole sweep, ~15 min on 2 cores
    plait bench memory --meshes 2x1x2 --precisions fp32 --no-peers
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from plait.bench.launch import in_torchrun
from plait.bench.memory import (MemoryBenchConfig, plot_frontier, run_peer_bench, run_sweep, summary)
from plait.bench.memory_peers import render as render_peers
from plait.bench.report import mib, write_json_document
from plait.cli.environment import cache_dir
from plait.cli.output_paths import output_file, prepare_output_paths
from plait.names.transports import AUTO, BACKENDS
from plait.train.config import TrainConfig
from plait.train.corpus import load_corpus


def _meshes(text: str) -> tuple[tuple[int, int, int], ...]:
    meshes = []
    for item in text.split(","):
        try:
            dp, tp, pp = (int(part) for part in item.strip().lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid mesh {item!r}: use DPxTPxPP, e.g. 2x1x2,1x2x2") from None
        meshes.append((dp, tp, pp))
    return tuple(meshes)


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _offload(text: str) -> tuple[bool, ...]:
    choices = {"off": (False,), "on": (True,), "both": (False, True)}
    if text not in choices:
        raise argparse.ArgumentTypeError(f"invalid --offload {text!r}: use off, on or both")
    return choices[text]


def add_parser(subparsers) -> argparse.ArgumentParser:
    # No help=: listed in plait bench --help (see plait.cli.bench_dp)
    parser = subparsers.add_parser("bench-memory", prog="plait bench memory", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    d = MemoryBenchConfig()
    parser.add_argument("--meshes", type=_meshes, default=d.meshes, metavar="DPxTPxPP,...",
                        help="layouts, each dp*tp*pp processes (default 2x1x2,1x2x2)")
    parser.add_argument("--recompute", type=_names, default=d.recompute, help="comma list (default none,selective,full)")
    parser.add_argument("--precisions", type=_names, default=d.precisions,
                        help="comma list (default fp32,bf16-mixed,fp16-mixed)")
    parser.add_argument("--offload", type=_offload, default=d.offload, help="off, on or both (default both)")
    for name in ("seq_len", "layers", "hidden", "heads", "global_batch", "micro_batch", "steps", "peer_rounds",
                 "peer_steps"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name),
                            help=f"(default {getattr(d, name)})")
    parser.add_argument("--schedule", default=d.schedule, help=f"pipeline schedule of every run (default {d.schedule})")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="skip the one-process peer comparison")
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s, help="per run (default 900)")
    parser.add_argument("--out", default=d.out, help=f"runs, frontier.png and summary.json go here (default {d.out})")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summary here ('-': stdout)")
    parser.add_argument("--backend", choices=BACKENDS, default=AUTO,
                        help="plait train's --backend (gloo: the 4 processes may share one GPU)")
    parser.set_defaults(run=run)
    return parser


def run(args) -> int:
    if in_torchrun():
        raise ValueError("plait bench memory starts its own plait train runs: run it without torchrun")
    config = MemoryBenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MemoryBenchConfig)
                                  if hasattr(args, f.name)})
    if args.backend != "auto":
        config = dataclasses.replace(config, extra=("--backend", args.backend))
    problems = config.problems()
    if problems:
        raise ValueError("plait bench memory: " + "; ".join(problems))
    prepare_output_paths(output_file("--json", args.json, stdout_allowed=True))
    train = TrainConfig()
    vocab = load_corpus(train.data, max_bytes=train.data_max_bytes, val_fraction=train.val_fraction,
                        cache_dir=cache_dir()).vocab_size
    print(f"# plait bench memory: GPT {config.layers} layers, h {config.hidden}, {config.heads} heads, "
          f"s {config.seq_len}, vocab {vocab}; global batch {config.global_batch} in micro-batches of "
          f"{config.micro_batch}, {config.schedule}; {config.steps} steps per run (the first excluded from the time)")
    print("# activations MiB: measured (peak of live storages saved for backward, largest rank) | plait's formula "
          "(plait plan, largest rank) | Korthikanti's as published; state = params+grads+optimizer, measured / plait")
    print(f"{'mesh':<12}{'recompute':<10}{'precision':<11}{'offload':<8}{'step s':>7}{'measured':>10}{'plait':>9}"
          f"{'ratio':>7}{'paper':>9}{'RSS MiB':>9}{'state MiB':>13}")

    def on_row(row):
        m, p = row["measured"], row["predicted"]
        print(f"{'dp%d tp%d pp%d' % (row['dp'], row['tp'], row['pp']):<12}{row['recompute']:<10}"
              f"{row['precision']:<11}{'on' if row['offload'] else 'off':<8}{m['step_s']:>7.2f}"
              f"{mib(m['activations_bytes']):>10}{mib(p['activations_bytes']):>9}{row['ratio']:>7.3f}"
              f"{mib(row['paper_bytes']):>9}{mib(m['resident_peak_bytes']):>9}"
              f"{mib(m['model_state_bytes']) + ' / ' + mib(p['model_state_bytes']):>13}", flush=True)

    rows = run_sweep(config, vocab, on_row)
    png = Path(config.out) / "frontier.png"
    plot_frontier(rows, png)
    result = summary(config, rows, None)
    print(f"# plait's formula within 10% of the measurement: {result['within_10_percent']} of {result['runs']} runs")
    print(f"frontier: {png}")
    if config.peers:
        result["peers"] = run_peer_bench(config, vocab)
        print("\n".join(render_peers(result["peers"])))
    write_json_document(result, str(Path(config.out) / "summary.json"))
    if args.json:
        write_json_document(result, args.json)
    return 0
