"""`plait bench tp`: Megatron tensor parallelism on a small GPT, at several tp.

    plait bench tp
    plait bench tp --tp 1,2 --sequence-parallel --algorithm ring --json tp.json

For each --tp value it starts a fresh world of exactly tp local gloo processes
(CPU, one thread each) and times forward+backward steps of the same GPT (same
seed, same tokens), splitting each step into communication (plait.comm's own
timers; collectives run synchronously inside forward and backward) and compute.
One transformer layer's traffic is measured on its own and compared with the
formula: 2 all-reduces of b·s·h elements forward and 2 backward, each priced by
the schedule of the algorithm that ran (plait.bench.tp).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from plait.bench.launch import in_torchrun, run_in_fresh_worlds
from plait.bench.report import write_json_document
from plait.bench.tp import COUNTED, PHASES, TpBenchConfig, run_tp_bench
from plait.cli.local_ranks import add_oversubscribe_flag, check_spawn
from plait.cli.output_paths import output_file, prepare_output_paths

_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}


def _degrees(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid --tp {text!r}: use comma-separated ints, e.g. 1,2,4") from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    # No help=: listed in plait bench --help (see plait.cli.bench_dp)
    parser = subparsers.add_parser("bench-tp", prog="plait bench tp", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TpBenchConfig()
    parser.add_argument("--tp", type=_degrees, default=defaults.tp, metavar="P,P,...",
                        help="tensor-parallel degrees, each a fresh world of P processes (default 1,2,4)")
    parser.add_argument("--layers", type=int, default=defaults.layers, help="transformer layers (default 4)")
    parser.add_argument("--hidden", type=int, default=defaults.hidden, help="hidden size h (default 256)")
    parser.add_argument("--heads", type=int, default=defaults.heads, help="attention heads (default 8)")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="sequence length s (default 128)")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="sequences per step b (default 8)")
    parser.add_argument("--vocab", type=int, default=defaults.vocab,
                        help="vocabulary V (default 1001: not a multiple of tp, so it is padded)")
    parser.add_argument("--dtype", default=defaults.dtype, help="float32 (default), float64, bfloat16, float16")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps first (default 2)")
    parser.add_argument("--algorithm", default=defaults.algorithm,
                        help="plait.comm algorithm of every tensor-parallel collective (default auto)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="shard LayerNorm/dropout along the sequence: all-reduce -> reduce-scatter + all-gather")
    parser.add_argument("--check-args", action="store_true",
                        help="keep the comm layer's per-call agreement check (a small all-gather per collective; "
                             "default off)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s, metavar="SECONDS",
                        help="per-collective timeout (default 300)")
    parser.add_argument("--json", metavar="FILE", default=None, help="write all rows as JSON ('-': stdout)")
    add_oversubscribe_flag(parser)
    parser.set_defaults(run=run)
    return parser


def config_from_args(args: argparse.Namespace) -> TpBenchConfig:
    return TpBenchConfig(
        tp=args.tp, layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len,
        batch=args.batch, vocab=args.vocab, dtype=args.dtype, steps=args.steps, warmup=args.warmup,
        algorithm=args.algorithm, sequence_parallel=args.sequence_parallel, check_args=args.check_args,
        seed=args.seed, timeout_s=args.timeout)


def _calls(counts: dict[str, float]) -> str:
    """{"all_gather": 2, "reduce_scatter": 2} -> "2AG+2RS"."""
    text = "+".join(f"{counts[name]:g}{_SHORT.get(name, name)}" for name in COUNTED if counts.get(name))
    return text or "-"


def _header_lines(config: TpBenchConfig) -> list[str]:
    model = config.gpt_config()
    cores = os.cpu_count() or 1
    busiest = max(config.tp)
    oversubscribed = f"; tp={busiest} runs {busiest} processes on {cores} cores" if busiest > cores else ""
    payload = 4 * config.layer_numel * config.itemsize
    sp = ", sequence parallel" if config.sequence_parallel else ""
    check = ("on (one small all-gather before every collective; plait.comm does not time it, so it counts as "
             "compute)" if config.check_args
             else "off (TensorParallel(check_args=False))")
    return [
        f"# plait bench tp: GPT {config.layers} layers, h {config.hidden}, {config.heads} heads, ffn {model.ffn}, "
        f"s {config.seq_len}, b {config.batch}, V {config.vocab}, {config.dtype}: "
        f"{model.num_parameters() / 1e6:.2f} M parameters",
        f"# each tp: a fresh world of tp gloo processes on CPU, 1 thread each; this machine: {cores} CPU cores, "
        f"torch {torch.__version__}{oversubscribed}",
        f"# {config.steps} timed forward+backward steps after {config.warmup} warm-up (no optimizer), each after a "
        f"barrier; medians over steps, means over ranks; algorithm {config.algorithm}{sp}; comm argument check "
        f"{check}",
        f"# per layer (blocks[0] alone): n = b·s·h = {config.layer_numel} elements; formula 2 all-reduces of n "
        f"forward + 2 backward{' (as reduce-scatter + all-gather pairs, + 1 all-reduce of 6h backward)' if sp else ''},"
        f" bytes read off the schedule of the algorithm that ran; payload 4·n·e = {payload / 1024:.1f} KiB",
    ]


_COLUMNS = (f"{'tp':>3} {'step ms':>9} {'compute ms':>10} {'comm ms':>9} {'comm %':>6} {'speed-up':>8} "
            f"{'loss':>8} {'per layer fwd | bwd':>22} {'KiB/layer':>10} {'formula':>10} {'ratio':>7}")


def _row_line(row: dict, baseline: dict | None) -> str:
    speedup = f"{baseline['step_ms'] / row['step_ms']:7.2f}x" if baseline else f"{'-':>8}"
    calls = f"{_calls(row['calls_per_layer']['forward'])} | {_calls(row['calls_per_layer']['backward'])}"
    ratio = f"{row['bytes_ratio']:7.4f}" if row["bytes_ratio"] is not None else f"{'-':>7}"
    return (f"{row['tp']:>3} {row['step_ms']:9.1f} {row['compute_ms']:10.1f} {row['comm_ms']:9.1f} "
            f"{row['comm_fraction']:6.1%} {speedup} {row['loss']:8.4f} {calls:>22} "
            f"{row['bytes_per_layer'] / 1024:10.1f} {row['bytes_per_layer_formula'] / 1024:10.1f} {ratio}")


def _detail_line(row: dict) -> str:
    """Which algorithm each collective ran and the calls per step (rank 0's counters)."""
    algorithms = {}
    for phase in PHASES:
        for name, entry in row["layer"][phase].items():
            for algorithm in entry["algorithms"]:
                algorithms.setdefault(name, set()).add(algorithm)
    ran = ", ".join(f"{name} by {'/'.join(sorted(names))}" for name, names in algorithms.items()) or "none"
    per_step = ", ".join(f"{calls} {name} ({row['bytes_per_step'].get(name, 0) / 2**20:.2f} MiB)"
                         for name, calls in row["calls_per_step"].items()) or "none"
    return f"#   tp={row['tp']}: {ran}; per step: {per_step} sent per rank"


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if in_torchrun():
        raise ValueError("plait bench tp starts its own world of tp processes for each --tp value: "
                         "run it directly, not under torchrun")
    check_spawn(max(config.tp), allow_oversubscribe=args.allow_oversubscribe, flag="--tp")
    prepare_output_paths(output_file("--json", args.json, stdout_allowed=True))
    stream = sys.stderr if args.json == "-" else sys.stdout

    def write(line: str) -> None:
        print(line, file=stream, flush=True)

    for line in _header_lines(config):
        write(line)
    write(_COLUMNS)
    state = {"baseline": None}

    def on_event(kind: str, row) -> None:
        if kind != "row":
            return
        if row["tp"] == 1:
            state["baseline"] = row
        baseline = state["baseline"]
        row["speedup"] = baseline["step_ms"] / row["step_ms"] if baseline else None
        write(_row_line(row, baseline))
        write(_detail_line(row))

    # tp = 1 first: the baseline of the speed-ups
    rows = run_in_fresh_worlds(run_tp_bench, config, sorted(config.tp), on_event, "plait bench tp")
    if rows is None:
        return 1
    if args.json:
        write_json_document({"config": config.__dict__, "rows": rows}, args.json)
    return 0
