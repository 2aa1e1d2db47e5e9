"""`plait bench fold`: FoldedCNN (Kosaian et al., ICML 2021) against the unfolded CNN on a
generated specialised task: throughput (images/s) per batch size 1…1024, arithmetic
intensity (FLOPs per byte, analytic) beside the machine's measured balance, held-out
accuracy of each model, a PNG of throughput vs batch size (plait.bench.fold).

    plait bench fold                       # f = 2, 3, 4; ~10 min on 2 cores (training included)
    plait bench fold --quick               # seconds: f = 2, 3 batch sizes, tiny training
    plait bench fold --factors 4 --batches 64,256,1024 --json -
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from plait.cli.output_paths import output_directory, output_file, prepare_output_paths


def _integers(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {flag} {text!r}: give integers separated by commas, "
                                             f"e.g. 2,3,4") from None
        if not values:
            raise argparse.ArgumentTypeError(f"invalid {flag} {text!r}: give at least one integer")
        return values
    return parse


def add_parser(subparsers) -> argparse.ArgumentParser:
    # No help=: listed in plait bench --help (see plait.cli.bench_dp)
    parser = subparsers.add_parser("bench-fold", prog="plait bench fold", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run in seconds (f=2, batches 1,8,64, tiny training); other flags override it")
    parser.add_argument("--factors", type=_integers("--factors"), default=None, help="fold factors (default 2,3,4)")
    parser.add_argument("--batches", type=_integers("--batches"), default=None,
                        help="batch sizes in images (default 1,2,4,...,1024)")
    for name, kind, default in (("rounds", int, 7), ("min_time_s", float, 0.08), ("train_images", int, 4800),
                                ("test_images", int, 2000), ("epochs", int, 3), ("distill_epochs", int, 6),
                                ("seed", int, 0)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"(default {default})")
    parser.add_argument("--out", default=None, help="summary.json, report.txt and throughput.png go here "
                                                    "(default bench-results/fold)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summary here ('-': stdout)")
    parser.set_defaults(run=run)
    return parser


def run(args) -> int:
    # torch, matplotlib and the benchmark load only when it runs (plait --help stays light)
    from plait.bench.fold import QUICK, FoldBenchConfig, plot, render, run_bench
    from plait.bench.report import write_json_document

    chosen = dict(QUICK) if args.quick else {}
    for field in dataclasses.fields(FoldBenchConfig):
        if getattr(args, field.name, None) is not None:
            chosen[field.name] = getattr(args, field.name)
    config = FoldBenchConfig(**chosen)
    problems = config.problems()
    if problems:
        raise ValueError("; ".join(problems))
    out = Path(config.out)
    prepare_output_paths(output_directory("--out", str(out)), output_file("--json", args.json, stdout_allowed=True))
    print(f"# plait bench fold: factors {','.join(map(str, config.factors))}; batches "
          f"{','.join(map(str, config.batches))}; {config.train_images} training / {config.test_images} held-out "
          f"images (seed {config.seed}); {config.epochs} epochs unfolded, {config.distill_epochs} distilling",
          flush=True)
    result = run_bench(config, log=lambda line: print(line, flush=True))
    lines = render(result)
    print("\n".join(lines))
    png = out / "throughput.png"
    plot(result, str(png))
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    write_json_document(result, str(out / "summary.json"))
    print(f"plot: {png}\nsummary: {out / 'summary.json'}")
    if args.json:
        write_json_document(result, args.json)
    return 0
