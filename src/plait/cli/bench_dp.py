"""`plait bench dp`: data-parallel training, plait's DataParallel vs torch DDP.

    plait bench dp --nprocs 2
    plait bench dp --nprocs 4 --compression all --plot loss.png

Trains the same model with the same seeds both ways on --nprocs local gloo
processes (or the torchrun world) and prints samples/s for each, their ratio, and
plait's communication time and the fraction of it hidden behind backward. With
--compression it also trains the small model with each compressor and prints the
bytes per step relative to uncompressed and the final loss (plait.bench.dp).
"""

from __future__ import annotations

import argparse
import os
import sys

from plait.bench.dp import DpBenchConfig, median_by_mode, run_dp_bench, summary_numbers
from plait.bench.launch import Job, WorkerError, choose_backend, in_torchrun, run_in_current_world, spawn_and_run
from plait.bench.report import write_json_document
from plait.cli.local_ranks import add_oversubscribe_flag, check_spawn
from plait.cli.output_paths import output_file, prepare_output_paths
from plait.models.mlp import MODELS
from plait.names.transports import AUTO, BACKENDS

ALL_COMPRESSIONS = ("none", "fp16", "topk:0.01+ef", "randomk:0.01+ef", "sign+ef", "qsgd:4", "powersgd:2")


def add_parser(subparsers) -> argparse.ArgumentParser:
    # No help=: `plait bench dp` is reached through plait bench (plait.cli.main rewrites it to bench-dp),
    # so it is listed in plait bench --help, not as a command of its own.
    parser = subparsers.add_parser("bench-dp", prog="plait bench dp", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", "-n", type=int, default=None,
                        help="spawn this many local processes (default: the torchrun world, else 2)")
    parser.add_argument("--model", default="mlp-large", choices=sorted(MODELS),
                        help="model of the throughput runs (default mlp-large: 2.2 M parameters)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="plait/DDP runs each, order alternating; the median is reported (default 3)")
    parser.add_argument("--algorithm", default="auto", help="plait's all-reduce algorithm (default auto)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap in MiB, both (default 25)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")
    parser.add_argument("--compression", default=None,
                        help="comma-separated compressor specs to compare (e.g. none,topk:0.01+ef,sign+ef,"
                             f"qsgd:4,powersgd:2) or 'all' = {','.join(ALL_COMPRESSIONS)}")
    parser.add_argument("--compression-model", default="mlp", choices=sorted(MODELS),
                        help="model of the compression runs (default mlp)")
    parser.add_argument("--compression-steps", type=int, default=300,
                        help="training steps per compressor (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="per-collective timeout (default 300)")
    parser.add_argument("--backend", default=AUTO, choices=BACKENDS)
    parser.add_argument("--json", metavar="FILE", default=None, help="write all rows as JSON ('-': stdout)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="plot training loss against step, one line per compressor")
    add_oversubscribe_flag(parser)
    parser.set_defaults(run=run)
    return parser


def config_from_args(args: argparse.Namespace) -> DpBenchConfig:
    specs: tuple[str, ...] = ()
    if args.compression:
        text = args.compression.strip()
        specs = ALL_COMPRESSIONS if text.lower() == "all" else tuple(s.strip() for s in text.split(",") if s.strip())
        if "none" not in specs:
            specs = ("none",) + specs  # the baseline the ratios are taken against
    return DpBenchConfig(
        model=args.model, batch_size=args.batch_size, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
        algorithm=args.algorithm, bucket_mb=args.bucket_mb, lr=args.lr, compressions=specs,
        compression_model=args.compression_model, compression_steps=args.compression_steps, seed=args.seed,
        timeout_s=args.timeout)


def _throughput_line(row: dict) -> str:
    extra = ""
    if row["mode"] == "plait":
        extra = (f"{row['comm_ms']:9.1f} {row['exposed_ms']:11.1f} {row['hidden_fraction']:7.0%} "
                 f"{row['bytes_per_step'] / 2**20:9.2f}")
    return f"{row['round']:>5} {row['mode']:<6} {row['samples_per_s']:10.1f} {row['step_ms']:9.1f} {extra}"


def _compression_line(row: dict, baseline: dict | None) -> str:
    base_bytes = baseline["bytes_per_step"] if baseline else 0.0
    base_payload = baseline["payload_per_step"] if baseline else 0.0
    relative = row["bytes_per_step"] / base_bytes if base_bytes else float("nan")
    payload_relative = row["payload_per_step"] / base_payload if base_payload else float("nan")
    return (f"{row['describe']:<32} {row['bytes_per_step'] / 1024:10.1f} {relative:8.4f} {payload_relative:8.4f} "
            f"{row['final_loss']:10.4f} {row['test_loss']:9.4f} {row['test_accuracy']:8.1%} {row['step_ms']:8.1f}")


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    use_world = args.nprocs is None and in_torchrun()
    stream = sys.stderr if args.json == "-" else sys.stdout
    if use_world:
        nprocs, backend = int(os.environ["WORLD_SIZE"]), choose_backend(args.backend, spawned=False)
        is_reporter = int(os.environ.get("RANK", "0")) == 0
    else:
        nprocs, backend, is_reporter = args.nprocs or 2, choose_backend(args.backend, spawned=True), True
    if nprocs < 2:
        raise ValueError(f"--nprocs {nprocs}: data parallelism needs >= 2 processes")
    if not use_world:
        check_spawn(nprocs, allow_oversubscribe=args.allow_oversubscribe)
    if args.plot and not config.compressions:
        raise ValueError("--plot draws the loss curves of the compression runs: add --compression")
    prepare_output_paths(output_file("--json", args.json, stdout_allowed=True), output_file("--plot", args.plot))
    state = {"baseline": None, "throughput_header": False, "compression_header": False}

    def write(line: str) -> None:
        print(line, file=stream, flush=True)

    def on_event(kind: str, row) -> None:
        if kind != "row":
            return
        if row["kind"] == "throughput":
            if not state["throughput_header"]:
                write(f"{'round':>5} {'mode':<6} {'samples/s':>10} {'step ms':>9} {'comm ms':>9} {'exposed ms':>11} "
                      f"{'hidden':>7} {'MiB/step':>9}  (plait's comm; MiB sent per rank per step)")
                state["throughput_header"] = True
            write(_throughput_line(row))
        else:
            if not state["compression_header"]:
                write(f"\n# compression: model {config.compression_model}, {config.compression_steps} steps, "
                      f"SGD lr {config.lr} momentum 0.9; KiB/step = bytes sent per step, mean over ranks; payload = "
                      "compressed gradient / uncompressed; loss = mean of the last 10 steps over ranks")
                write(f"{'compressor':<32} {'KiB/step':>10} {'vs none':>8} {'payload':>8} {'final loss':>10} "
                      f"{'test loss':>9} {'test acc':>8} {'step ms':>8}")
                state["compression_header"] = True
            if row["compression"] == "none":
                state["baseline"] = row
            write(_compression_line(row, state["baseline"]))

    if is_reporter:
        parameters = sum(p.numel() for p in __import__("plait.models", fromlist=["build_model"])
                         .build_model(config.model).parameters())
        write(f"# plait bench dp: model {config.model} ({parameters / 1e6:.2f} M parameters), {nprocs} ranks "
              f"({backend}), batch {config.batch_size}/rank, {config.steps} timed steps after {config.warmup} "
              f"warm-up, {config.rounds} rounds, plait algorithm {config.algorithm}, buckets {config.bucket_mb:g} MiB")
    job = Job(run_dp_bench, config)
    try:
        if use_world:
            rows = run_in_current_world(job, backend, on_event)
        else:
            rows = spawn_and_run(job, nprocs, backend, on_event, label="plait bench dp")
    except WorkerError as error:
        print(str(error), file=sys.stderr)
        return 1
    if not is_reporter:
        return 0
    numbers = summary_numbers(rows)
    medians = median_by_mode(rows)
    if "ratio" in numbers:
        plait_row = medians["plait"]
        write(f"# median round: plait {numbers['plait']:.1f} samples/s, DDP {numbers['ddp']:.1f} samples/s, "
              f"ratio plait/DDP {numbers['ratio']:.3f} (median of per-round ratios {numbers['ratio_rounds']:.3f}); "
              f"plait comm {plait_row['comm_ms']:.1f} ms/step, {plait_row['hidden_fraction']:.0%} hidden "
              "behind backward")
    if args.plot:
        _plot([row for row in rows if row.get("kind") == "compression"], args.plot, config)
        write(f"# loss curves written to {args.plot}")
    if args.json:
        write_json_document({"config": config.__dict__, "rows": rows, "summary": numbers}, args.json)
    return 0


def _plot(rows: list[dict], path: str, config: DpBenchConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for row in rows:
        axis.plot(range(1, len(row["losses"]) + 1), row["losses"], label=row["describe"], linewidth=1)
    axis.set_yscale("log")
    axis.set_xlabel("step")
    axis.set_ylabel("training loss (mean over ranks)")
    axis.set_title(f"plait bench dp: {config.compression_model} on digits, SGD lr {config.lr}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
