"""The `plait` command: one argparse subcommand per module of plait.cli.

Each subcommand module has `add_parser(subparsers)`, which registers its parser and
sets `run=<its run(args) -> int>` as a default, and `run(args)`. Adding `schedule`,
`calibrate`, `simulate`, `plan` or `train` is one module plus one name in SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from plait import __version__

SUBCOMMANDS = ("train", "bench", "bench_dp", "bench_tp", "bench_pp", "schedule", "cost", "tune", "calibrate",
               "simulate", "checkpoint", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait",
        description="plait: distributed training on torch.distributed, with collectives "
                    "built on send/recv, a cost model and parallelism strategies.")
    parser.add_argument("--version", action="version", version=f"plait {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"plait.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `plait ARGV...`; returns the exit status (argparse errors give 2)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "dp"]:  # `plait bench dp` has its own flags (plait.cli.bench_dp)
        argv = ["bench-dp"] + argv[2:]
    elif argv[:2] in (["bench", "tp"], ["bench", "pp"]):  # so do `bench tp` and `bench pp`
        argv = [f"bench-{argv[1]}"] + argv[2:]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # --help, --version or a usage error
        return exit_request.code if isinstance(exit_request.code, int) else 1
    try:
        return int(args.run(args) or 0)
    except ValueError as error:
        # User errors: say what is wrong and how to fix it, no traceback.
        print(f"plait {args.command.replace('-', ' ')}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"plait {args.command.replace('-', ' ')}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
