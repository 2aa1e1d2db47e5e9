"""`plait bench hf`: tokens/s of training a Llama-style Hugging Face model (built from a
config in code) with plait against torch DDP, FSDP2 and parallelize_module, same model,
data, world size, global batch and sequence length, sides alternated per round
(plait.bench.hf).

    plait bench hf                                  # 2 processes, every layout, 3 rounds, then again
                                                    # with a `nice -n 19` busy loop on a core
    plait bench hf --variants plait-dp,torch-ddp --rounds 7 --busy-loop off

--busy-loop also (the default) runs the whole measurement twice: on the machine as it
is, then with a second process of this Python spinning at nice 19 (it takes a core's
idle time: the OS gives it what the ranks leave), started before the world and ended
(by its pid) after it; only, the second alone; off, the first alone.
"""

from __future__ import annotations

import argparse
import os

from plait.bench.busy import busy_loop
from plait.bench.hf import VARIANTS, HfBenchConfig, run_hf_bench, summarize
from plait.bench.launch import in_torchrun, run_in_fresh_worlds
from plait.bench.report import write_json_document
from plait.cli.local_ranks import add_oversubscribe_flag, check_spawn
from plait.cli.output_paths import output_file, prepare_output_paths

BUSY_LOOP_MODES = ("also", "only", "off")
_INT_FLAGS = ("nprocs", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "seq_len", "global_batch",
              "rounds", "warmup", "steps", "seed")


def add_parser(subparsers) -> argparse.ArgumentParser:
    # No help=: listed in plait bench --help (see plait.cli.bench_dp)
    parser = subparsers.add_parser("bench-hf", prog="plait bench hf", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    d = HfBenchConfig()
    parser.add_argument("--variants", type=lambda text: tuple(p.strip() for p in text.split(",") if p.strip()),
                        default=d.variants, help=f"comma list of {','.join(VARIANTS)} (default all)")
    for name in _INT_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name),
                            help=f"(default {getattr(d, name)})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"AdamW's learning rate (default {d.lr})")
    parser.add_argument("--busy-loop", choices=BUSY_LOOP_MODES, default="also",
                        help="also (default): measure quiet, then with a nice -n 19 busy loop; only; off")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every row and the summary ('-': stdout)")
    add_oversubscribe_flag(parser)
    parser.set_defaults(run=run)
    return parser


def config_from_args(args) -> HfBenchConfig:
    return HfBenchConfig(variants=args.variants, lr=args.lr, **{name: getattr(args, name) for name in _INT_FLAGS})


def header(config: HfBenchConfig) -> str:
    return (f"# plait bench hf: LlamaForCausalLM {config.layers} layers, hidden {config.hidden}, {config.heads} heads "
            f"({config.kv_heads} kv), MLP {config.intermediate}, vocab {config.vocab}, float32; global batch "
            f"{config.global_batch} x seq {config.seq_len} = {config.tokens_per_step} tokens/step; AdamW lr "
            f"{config.lr:g}; {config.nprocs} gloo processes on {os.cpu_count()} cores, 1 thread each; "
            f"{config.rounds} rounds x {config.steps} timed steps (after {config.warmup} warm-up), order rotated "
            f"per round; load average {_load_average()}")


def _load_average() -> str:
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


def table_lines(result: dict) -> list[str]:
    """The summary: per side tokens/s median [min-max], per layout the per-round ratios."""
    lines = ["# tokens/s: median over rounds [min-max]; tokens counted from the batches trained on",
             f"{'layout':<7}{'side':<13}{'tokens/s':>10}{'[min-max]':>18}{'tokens/window':>15}"
             f"{'loss step 1':>13}{'loss last':>11}"]
    for row in result["variants"]:
        spread = f"[{row['tokens_per_s_min']:.0f}-{row['tokens_per_s_max']:.0f}]"
        lines.append(f"{row['layout']:<7}{row['variant']:<13}{row['tokens_per_s']:>10.0f}{spread:>18}"
                     f"{row['tokens_per_window']:>15.0f}{row['loss_step1']:>13.6f}{row['loss_last']:>11.4f}")
    for pair in result["pairs"]:
        lines.append(f"{pair['layout']}: {pair['plait']} / {pair['peer']} tokens/s = median {pair['median']:.3f} "
                     f"[{pair['min']:.3f}-{pair['max']:.3f}] over {len(pair['ratios'])} rounds (per round "
                     f"{', '.join(f'{r:.3f}' for r in pair['ratios'])}; > 1: plait faster); loss curves differ by "
                     f"at most {pair['max_loss_difference']:.1e}")
    lines.append(f"# step-1 losses (same weights, same batch) agree within {result['step1_loss_spread']:.1e} "
                 f"(tolerance {result['step1_loss_tolerance']:.0e}): "
                 f"{'yes' if result['step1_losses_agree'] else 'NO'}; every side trained (loss moved): "
                 f"{'yes' if result['all_trained'] else 'NO'}")
    return lines


def run(args) -> int:
    if in_torchrun():
        raise ValueError("plait bench hf starts its own world: run it without torchrun")
    config = config_from_args(args)
    problems = config.problems()
    if problems:
        raise ValueError("; ".join(problems))
    check_spawn(config.nprocs, allow_oversubscribe=args.allow_oversubscribe)
    prepare_output_paths(output_file("--json", args.json, stdout_allowed=True))
    conditions = {"also": (False, True), "only": (True,), "off": (False,)}[args.busy_loop]
    document, status = {"config": {**config.__dict__}, "measurements": []}, 0
    for busy in conditions:
        with busy_loop(busy) as spinner_pid:
            load = f"with a nice -n 19 busy loop (pid {spinner_pid})" if busy else "no load added"
            result, rows = measure_and_print(config, load)
        if result is None:
            return 1
        document["measurements"].append({"busy_loop": busy, "rows": rows, **result})
        status = status or (0 if result["step1_losses_agree"] and result["all_trained"] else 1)
    if args.json:
        write_json_document(document, args.json)
    return status


def measure_and_print(config: HfBenchConfig, load: str):
    """One measurement in a fresh world, its rows printed as they come and its table;
    (summary, rows), or (None, None) after a worker's failure (printed)."""
    print(header(config) + f"; {load}", flush=True)
    print(f"{'round':>5} {'side':<13}{'window s':>10}{'tokens':>9}{'tokens/s':>10}{'loss step 1':>13}"
          f"{'loss last':>11}", flush=True)

    def on_event(kind, row):
        if kind == "row":
            print(f"{row['round']:>5} {row['variant']:<13}{row['window_s']:>10.3f}{row['tokens']:>9.0f}"
                  f"{row['tokens_per_s']:>10.0f}{row['losses'][0]:>13.6f}{row['losses'][-1]:>11.4f}", flush=True)

    rows = run_in_fresh_worlds(run_hf_bench, config, [config.nprocs], on_event, "plait bench hf")
    if rows is None:
        return None, None
    result = summarize(rows, config)
    for line in table_lines(result):
        print(line)
    print(f"# load average after: {_load_average()} ({load})", flush=True)
    return result, rows
