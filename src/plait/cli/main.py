"""The `plait` command: one argparse subcommand per module of plait.cli.

Each subcommand module has `add_parser(subparsers)`, which registers its parser and
sets `run=<its run(args) -> int>` as a default, and `run(args)`. Adding `schedule`,
`calibrate`, `simulate`, `plan` or `train` is one module plus one name in SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys

from plait import __version__
from plait.errors import PlaitError

# A reader that stops early (plait ... | head -1) ends plait quietly with this status: 128 + 13
# (SIGPIPE), what a shell reports for a process that SIGPIPE killed, as it would kill a C tool.
EXIT_BROKEN_PIPE = 141

SUBCOMMANDS = ("train", "bench", "bench_dp", "bench_tp", "bench_pp", "bench_memory", "bench_zero", "bench_fold",
               "bench_hf", "bench_auto", "schedule", "cost", "tune", "calibrate", "simulate", "checkpoint", "plan",
               "testbed", "optimize")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``command`` alone when it names one: a
    subcommand's module is imported only to run it (``plait train`` skips the
    benchmarks' torch.distributed.pipelining and the plotting, about 2 s a start)."""
    parser = argparse.ArgumentParser(
        prog="plait",
        description="plait: distributed training on torch.distributed, with collectives "
                    "built on send/recv, a cost model and parallelism strategies.")
    parser.add_argument("--version", action="version", version=f"plait {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    module = None if command is None or "_" in command else command.replace("-", "_")  # names use "-"
    for name in (module,) if module in SUBCOMMANDS else SUBCOMMANDS:
        importlib.import_module(f"plait.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `plait ARGV...`; returns the exit status (argparse errors give 2; a reader that
    closed the pipe early, as `plait ... | head -1` does, gives EXIT_BROKEN_PIPE)."""
    try:
        status = _run_command(argv)
        # Flush inside the try: a closed pipe must surface here, not as "Exception
        # ignored ... BrokenPipeError" when the interpreter flushes stdout at exit.
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        if not (_reader_gone(sys.stdout) or _reader_gone(sys.stderr)):
            raise  # some other pipe (a worker's, say): a real error
        _discard_output()
        return EXIT_BROKEN_PIPE


def _run_command(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "dp"]:  # `plait bench dp` has its own flags (plait.cli.bench_dp)
        argv = ["bench-dp"] + argv[2:]
    elif argv[:2] in (["bench", "tp"], ["bench", "pp"], ["bench", "memory"], ["bench", "zero"],
                      ["bench", "fold"], ["bench", "hf"], ["bench", "auto"]):  # and these
        argv = [f"bench-{argv[1]}"] + argv[2:]
    environment_error = _comm_environment_error()
    if environment_error is not None:  # before anything else, --help included: nothing runs on bad settings
        command = argv[0] if argv and argv[0] in {name.replace("_", "-") for name in SUBCOMMANDS} else None
        prog = "plait" if command is None else f"plait {command.replace('-', ' ')}"
        print(f"{prog}: error: {environment_error}", file=sys.stderr)
        return 2
    parser = build_parser(argv[0] if argv else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # --help, --version or a usage error
        return exit_request.code if isinstance(exit_request.code, int) else 1
    try:
        return int(args.run(args) or 0)
    except (ValueError, PlaitError) as error:
        # User errors (plait.errors lists plait's): say what is wrong and how to fix it, no traceback.
        print(f"plait {args.command.replace('-', ' ')}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"plait {args.command.replace('-', ' ')}: interrupted", file=sys.stderr)
        return 130


def _comm_environment_error() -> str | None:
    """The error of an unknown PLAIT_* variable (a misspelt one would be ignored: see
    plait.cli.environment), or of a bad PLAIT_COMM_TIMEOUT_S, PLAIT_COMM_CHECK,
    PLAIT_COMM_SEGMENT_BYTES, PLAIT_HIERARCHY or PLAIT_ALGORITHMS, or None. The CLI
    reads them (the library never does) and passes the CommConfig they make down to the
    runs that train or measure."""
    unknown = importlib.import_module("plait.cli.environment").unknown_variables_error()
    if unknown is not None:
        return unknown
    try:
        importlib.import_module("plait.cli.comm_config").config_from_environment()
    except ValueError as error:
        return str(error)
    return None


def _reader_gone(stream) -> bool:
    """Whether ``stream`` is a pipe or socket whose reading end was closed (poll reports
    an error or hang-up on it), i.e. where a BrokenPipeError can have come from."""
    try:
        fd = stream.fileno()
        poller = select.poll()
    except (AttributeError, OSError, ValueError):  # no file descriptor (e.g. captured), or no poll()
        return False
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _discard_output() -> None:
    """Point stdout and stderr at /dev/null where their reader is gone, so the interpreter's
    last flush of what is still buffered succeeds silently."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            if _reader_gone(stream):
                os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


if __name__ == "__main__":
    raise SystemExit(main())
