"""`plait bench zero`: ZeRO stages 1-3 against DataParallel, torch DDP and torch FSDP2
on the same GPT in one world of N gloo processes: step time, model state held per
rank (live storages), peak resident set, and per-round throughput ratios against the
peers (plait.bench.zero).

    plait bench zero                          # 4 processes, every variant, 3 rounds
    plait bench zero --variants zero3,fsdp2 --rounds 5
    plait bench zero --busy                   # with a process spinning at nice 19 beside the ranks
"""

from __future__ import annotations

import argparse
import os

from plait.bench.busy import busy_loop
from plait.bench.launch import in_torchrun, run_in_fresh_worlds
from plait.bench.report import mib, write_json_document
from plait.bench.zero import VARIANTS, ZeroBenchConfig, run_zero_bench, summarize
from plait.cli.local_ranks import add_oversubscribe_flag, check_spawn
from plait.cli.output_paths import output_file, prepare_output_paths


def add_parser(subparsers) -> argparse.ArgumentParser:
    # No help=: listed in plait bench --help (see plait.cli.bench_dp)
    parser = subparsers.add_parser("bench-zero", prog="plait bench zero", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ZeroBenchConfig()
    parser.add_argument("--variants", type=lambda text: tuple(p.strip() for p in text.split(",") if p.strip()),
                        default=d.variants, help=f"comma list of {','.join(VARIANTS)} (default all)")
    for name in ("nprocs", "layers", "hidden", "heads", "seq_len", "vocab", "batch", "rounds", "steps"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name),
                            help=f"(default {getattr(d, name)})")
    parser.add_argument("--busy", action="store_true",
                        help="run beside a process spinning at nice 19 (a busy host; default: off)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every row and the summary ('-': stdout)")
    add_oversubscribe_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args) -> int:
    if in_torchrun():
        raise ValueError("plait bench zero starts its own world: run it without torchrun")
    config = ZeroBenchConfig(variants=args.variants, nprocs=args.nprocs, layers=args.layers, hidden=args.hidden,
                             heads=args.heads, seq_len=args.seq_len, vocab=args.vocab, batch=args.batch,
                             rounds=args.rounds, steps=args.steps)
    problems = config.problems()
    if problems:
        raise ValueError("plait bench zero: " + "; ".join(problems))
    check_spawn(config.nprocs, allow_oversubscribe=args.allow_oversubscribe)
    prepare_output_paths(output_file("--json", args.json, stdout_allowed=True))
    print(f"# plait bench zero: GPT {config.layers} layers, h {config.hidden}, {config.heads} heads, s {config.seq_len}, "
          f"vocab {config.vocab}; {config.batch} sequences per rank; AdamW; {config.nprocs} gloo processes on "
          f"{os.cpu_count()} cores, 1 thread each; {config.rounds} rounds x {config.steps} steps (after 1 warm-up)"
          f"{'; a busy loop at nice 19 beside them' if args.busy else ''}")
    print(f"{'round':>5} {'variant':<14}{'step ms':>9}{'state MiB':>11}{'RSS after MiB':>15}{'peak RSS MiB':>14}")

    transports: dict[str, str] = {}

    def on_event(kind, row):
        if kind == "row" and row["variant"] not in transports:
            transports[row["variant"]] = row["transport"]
            print(f"# {row['variant']}: collectives over {row['transport']}")
        if kind == "row":
            print(f"{row['round']:>5} {row['variant']:<14}{row['step_s'] * 1e3:>9.1f}{mib(row['state_bytes']):>11}"
                  f"{mib(row['resident_after_bytes']):>15}{mib(row['resident_peak_bytes']):>14}", flush=True)

    with busy_loop(args.busy):
        rows = run_in_fresh_worlds(run_zero_bench, config, [config.nprocs], on_event, "plait bench zero")
    if rows is None:
        return 1
    result = summarize(rows, config.variants)
    print("# medians over rounds [min-max]; state and RSS: the largest rank")
    print(f"{'variant':<14}{'step ms':>24}{'state MiB':>11}{'RSS after MiB':>15}{'peak RSS MiB':>14}")
    for row in result["variants"]:
        print(f"{row['variant']:<14}{row['step_s'] * 1e3:>10.1f} [{row['step_s_min'] * 1e3:.1f}-"
              f"{row['step_s_max'] * 1e3:.1f}]{mib(row['state_bytes']):>11}{mib(row['resident_after_bytes']):>15}"
              f"{mib(row['resident_peak_bytes']):>14}")
    for pair in result["pairs"]:
        print(f"throughput {pair['plait']} / {pair['peer']}: median {pair['median']:.3f} (per round "
              f"{', '.join(f'{r:.3f}' for r in pair['throughput_ratios'])})")
    if args.json:
        write_json_document({"config": {**config.__dict__}, "rows": rows, **result}, args.json)
    return 0
