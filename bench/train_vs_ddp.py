"""Tokens/s of `plait train` against a plain PyTorch DDP loop on the same GPT, data,
global batch, optimizer and learning rate, at dp=4 (4 local processes, gloo on CPU).

    flock /work/bench.lock .venv/bin/python bench/train_vs_ddp.py [--rounds 7] [--steps 100] \\
        [--warmup 10] [--dp 4] [--transport auto|shm|gloo] [--busy] [--before SRC] \\
        [--out bench-results/train-vs-ddp] [-- more plait train flags]

``--transport``: how plait's collectives travel (``plait train --transport``; the plain
loop is DDP over gloo whatever it says): gloo compares the two over the same wire, shm
with plait on its shared-memory transport. ``--busy``: a process spinning at nice 19
beside the ranks throughout (plait.bench.busy). ``--before SRC``: a third side, the
same ``plait train`` run from another source tree (``PYTHONPATH=SRC``, e.g. the code
before a change), in the same rounds, so before, after and the plain loop meet the
same spells of a shared machine; its ratio to the plain loop and after/before per
round are reported too.

Each round runs both (all three with ``--before``), one after the other, in fresh
worlds of dp processes; the order rotates between rounds, so a slow spell of a shared
machine hits every side:

- plait: `plait train --dp N --tp 1 --pp 1 --micro-batch global/N` (one micro-batch
  per rank: the same work per step as the plain loop), no evaluation and no
  checkpoint before the end (a plain loop has neither);
- plain: `torchrun --nproc-per-node N bench/train_vs_ddp.py --worker`: what a PyTorch
  user writes. ``torch.nn.parallel.DistributedDataParallel`` over plait's GPT built
  unsharded with the same seed (so the same initial weights), plait's batch function
  per step (the same tokens), plait's AdamW parameter groups, lr set from the same
  schedule each step, ``torch.nn.utils.clip_grad_norm_`` with the same max norm, the
  loss read with ``loss.item()`` each step.

Timing, identical on both sides: rank 0 takes ``time.perf_counter()`` at the end of
every step (plait: the ``elapsed_s`` of each metrics.jsonl record, taken right after
the optimizer step; plain: after ``loss.item()``). Throughput = tokens of steps
warmup..steps-1 / (stamp[steps-1] - stamp[warmup-1]): every timed interval is one
whole iteration of each loop, with process start-up, data loading into memory,
model construction, the first ``warmup`` steps and the final checkpoint and report
outside it.

Reported: the median tokens/s of each side, the ratio of the medians, and the ratio
of each round (plait / plain of the same round) with its min-max over rounds. On a
machine shared with other work, bursts of outside load land in some runs and not
others, so a second figure is robust to them: each run's timed steps cut into blocks
of ``--block`` steps (10, plait's default --log-interval: with warm-up a multiple of
it, each block holds exactly one of plait's metrics flushes, so no plait cost is
left out), tokens/s over the median block, and the same per-round ratios. The
loss curves (plait's metrics; the plain loop's per-rank ``loss.item()`` averaged
over ranks after the clock stops) are compared step by step. They cannot be
bit-equal: DDP averages the gradient with gloo's all-reduce in DDP's bucket order,
plait with its own all-reduce (another summation order), and torch's clipping takes
the norm in float32 where plait takes it in float64, so the two differ in the last
float32 bits from step 0 and Adam's normalised updates carry that on. The tolerance
(``LOSS_TOLERANCE``) is well above that drift and far below any real difference
in the training (a wrong lr, batch or clip moves the loss by > 0.01 within a few
steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from plait.bench.busy import busy_loop

LOSS_TOLERANCE = 2e-3  # max |plait - plain| over the steps, absolute, on a loss of ~2.5-4.5
SIDES = ("plait", "plain")
BEFORE = "before"  # --before's side: plait train from another source tree


# ----- the plain loop (one process of the torchrun world) ----------------------------------
def plain_loop(config) -> dict | None:
    """The DDP training loop on this rank; rank 0 returns {"losses", "stamps_s"}.
    ``config``: plait's TrainConfig (dp = world size, tp = pp = 1)."""
    import torch
    import torch.distributed as dist

    from plait.parallel.tensor import LOCAL
    from plait.train.build import batch, build_model, load_data, make_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = load_data(config)
    model, _, loss_fn = build_model(config, data, LOCAL)  # the unsharded GPT and plait's cross-entropy
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = make_optimizer(model.named_parameters(), config)
    losses, stamps_s = [], []
    dist.barrier()
    for step in range(config.steps):
        inputs, targets = batch(config, data, step, rank, world_size)
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(inputs), targets)
        loss.backward()
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        stamps_s.append(time.perf_counter())
    mean = torch.tensor(losses, dtype=torch.float64)  # after the clock: the curve of the mean over ranks
    dist.all_reduce(mean)
    mean /= world_size
    del ddp  # its reducer holds the process group: gone before the group is destroyed
    dist.barrier()
    return {"losses": mean.tolist(), "stamps_s": stamps_s} if rank == 0 else None


def _worker(args, extra) -> int:
    import torch.distributed as dist

    config = _config(args, extra)
    dist.init_process_group("gloo")
    try:
        result = plain_loop(config)
        if result is not None:
            Path(args.result).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


# ----- one run of each side ----------------------------------------------------------------
def _config(args, extra):
    """plait's TrainConfig from the same flags `plait train` gets."""
    from plait.train.config import TrainConfig, add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = parser.parse_args(_train_flags(args, extra))
    global_batch = getattr(flags, "global_batch", TrainConfig.__dataclass_fields__["global_batch"].default)
    flags.micro_batch = max(global_batch // args.dp, 1)  # one micro-batch per rank: a plain loop's step
    return config_from_args(flags, None)


def _train_flags(args, extra) -> list[str]:
    return ["--dp", str(args.dp), "--tp", "1", "--pp", "1", "--steps", str(args.steps), "--eval-interval", "0",
            "--checkpoint-interval", "0", "--transport", getattr(args, "transport", "auto"), *extra]


def _environment(source: str | None = None) -> dict:
    """The children's environment; ``source``: a source tree put first on PYTHONPATH."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if source is not None:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))
    return environment


def _run(command: list[str], what: str, source: str | None = None) -> None:
    result = subprocess.run(command, env=_environment(source), capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{what} failed (exit {result.returncode}): {' '.join(command)}\n"
                           f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def run_plait(args, extra, out: Path, source: str | None = None) -> dict:
    """``plait train`` (from the source tree ``source`` when given) into ``out``."""
    config = _config(args, extra)
    _run([sys.executable, "-m", "plait", "train", *_train_flags(args, extra), "--micro-batch", str(config.micro_batch),
          "--sample-chars", "0", "--out", str(out), "--resume", "never", "--force-fresh"], "plait train", source)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [record["loss"] for record in records], "stamps_s": [record["elapsed_s"] for record in records]}


def run_plain(args, extra, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    result = out / "plain.json"
    result.unlink(missing_ok=True)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.dp),
          "--monitor-interval", "1", str(Path(__file__).resolve()), "--worker", "--result", str(result),
          "--dp", str(args.dp), "--steps", str(args.steps), "--", *extra],
         "the plain DDP loop")
    return json.loads(result.read_text())


# ----- the comparison ----------------------------------------------------------------------
def tokens_per_s(stamps_s: list[float], warmup: int, tokens_per_step: int) -> float:
    """Tokens of steps warmup.. over the time from the end of step warmup-1 to the end of the last."""
    if not 1 <= warmup < len(stamps_s):
        raise ValueError(f"warmup={warmup} must be in [1, steps={len(stamps_s)}): one stamp before the timed steps")
    return tokens_per_step * (len(stamps_s) - warmup) / (stamps_s[-1] - stamps_s[warmup - 1])


def block_tokens_per_s(stamps_s: list[float], warmup: int, tokens_per_step: int, block: int) -> float:
    """Tokens of one block of ``block`` steps over the median block time, blocks laid
    end to end from step ``warmup`` on (a partial last block is left out). With
    ``block`` = plait's log_interval and ``warmup`` a multiple of it, every block holds
    exactly one metrics flush, so the median leaves out bursts of load from outside,
    not plait's own periodic work."""
    if block < 1 or len(stamps_s) - warmup < block:
        raise ValueError(f"block={block} must be >= 1 and fit in the {len(stamps_s) - warmup} timed steps")
    ends = range(warmup - 1, len(stamps_s), block)
    durations = [stamps_s[later] - stamps_s[earlier] for earlier, later in zip(ends, list(ends)[1:])]
    return tokens_per_step * block / statistics.median(durations)


def compare(rounds: list[dict], *, warmup: int, tokens_per_step: int, tolerance: float = LOSS_TOLERANCE,
            block: int = 10) -> dict:
    """``rounds``: [{"plait": run, "plain": run}, ...]; each run {"losses", "stamps_s"}."""
    speeds = {side: [tokens_per_s(entry[side]["stamps_s"], warmup, tokens_per_step) for entry in rounds]
              for side in SIDES}
    ratios = [p / q for p, q in zip(speeds["plait"], speeds["plain"])]
    blocks = {side: [block_tokens_per_s(entry[side]["stamps_s"], warmup, tokens_per_step, block)
                     for entry in rounds] for side in SIDES}
    block_ratios = [p / q for p, q in zip(blocks["plait"], blocks["plain"])]
    differences = []
    for entry in rounds:
        plait, plain = entry["plait"]["losses"], entry["plain"]["losses"]
        if len(plait) != len(plain):
            raise ValueError(f"the loss curves have {len(plait)} and {len(plain)} steps")
        differences.append(max(abs(a - b) for a, b in zip(plait, plain)))
    medians = {side: statistics.median(values) for side, values in speeds.items()}
    return {"tokens_per_s": speeds, "median_tokens_per_s": medians,
            "ratio_of_medians": medians["plait"] / medians["plain"],
            "round_ratios": ratios, "median_round_ratio": statistics.median(ratios),
            "round_ratio_min": min(ratios), "round_ratio_max": max(ratios),
            "block_steps": block, "block_tokens_per_s": blocks, "block_round_ratios": block_ratios,
            "median_block_round_ratio": statistics.median(block_ratios),
            "block_round_ratio_min": min(block_ratios), "block_round_ratio_max": max(block_ratios),
            "max_loss_difference": max(differences), "loss_tolerance": tolerance,
            "losses_agree": max(differences) <= tolerance}


def render(summary: dict, args) -> str:
    lines = [f"plait train (--transport {args.transport}) vs plain DDP (gloo), dp={args.dp}, {args.steps} steps "
             f"({args.warmup} warm-up), {len(summary['round_ratios'])} rounds, "
             f"{'busy host (a nice -n 19 busy loop)' if args.busy else 'quiet host'}",
             f"{'round':<7}{'plait tok/s':>13}{'plain tok/s':>13}{'ratio':>8}"]
    for index, (p, q) in enumerate(zip(summary["tokens_per_s"]["plait"], summary["tokens_per_s"]["plain"])):
        lines.append(f"{index:<7}{p:>13.0f}{q:>13.0f}{p / q:>8.3f}")
    medians = summary["median_tokens_per_s"]
    lines += [f"median: plait {medians['plait']:.0f} tokens/s, plain {medians['plain']:.0f} tokens/s, "
              f"ratio {summary['ratio_of_medians']:.3f}",
              f"per-round ratio: median {summary['median_round_ratio']:.3f}, min {summary['round_ratio_min']:.3f}, "
              f"max {summary['round_ratio_max']:.3f}",
              f"median {summary['block_steps']}-step block (robust to load from outside): per-round ratio median "
              f"{summary['median_block_round_ratio']:.3f}, min {summary['block_round_ratio_min']:.3f}, "
              f"max {summary['block_round_ratio_max']:.3f}",
              f"loss curves: max |plait - plain| = {summary['max_loss_difference']:.2e} "
              f"({'within' if summary['losses_agree'] else 'OUTSIDE'} tolerance {summary['loss_tolerance']:.0e})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the clock starts (>= 1)")
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--block", type=int, default=10,
                        help="steps per block of the robust figure (plait's --log-interval, default 10)")
    parser.add_argument("--transport", default="auto", choices=("auto", "shm", "gloo"),
                        help="plait train --transport (the plain loop is DDP over gloo)")
    parser.add_argument("--busy", action="store_true", help="a nice -n 19 busy loop beside the ranks throughout")
    parser.add_argument("--before", metavar="SRC", help="also run plait train from this source tree, each round")
    parser.add_argument("--out", default="bench-results/train-vs-ddp")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank of the plain loop
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="more plait train flags (after --), given to both sides")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args, args.extra)
    if args.rounds < 1 or not 1 <= args.warmup < args.steps or not 1 <= args.block <= args.steps - args.warmup:
        raise SystemExit(f"need --rounds >= 1, 1 <= --warmup < --steps and 1 <= --block <= steps - warmup, got "
                         f"{args.rounds}, {args.warmup}, {args.steps}, {args.block}")
    config = _config(args, args.extra)
    if config.model != "gpt":
        raise SystemExit("this comparison trains the GPT (--model gpt)")
    from plait.train.build import load_data

    load_data(config)  # tokenised and cached once here: neither side's ranks race to write the cache
    out = Path(args.out)
    sides = [*SIDES, *([BEFORE] if args.before else [])]
    rounds = []
    with busy_loop(args.busy):
        for index in range(args.rounds):
            entry = {}
            for side in sides[index % len(sides):] + sides[:index % len(sides)]:  # rotated each round
                where = out / f"round{index}-{side}"
                entry[side] = run_plain(args, args.extra, where) if side == "plain" else \
                    run_plait(args, args.extra, where, args.before if side == BEFORE else None)
                print(f"round {index} {side}: {tokens_per_s(entry[side]['stamps_s'], args.warmup, _tokens(config)):.0f}"
                      " tokens/s", file=sys.stderr, flush=True)
            rounds.append(entry)
    summary = compare(rounds, warmup=args.warmup, tokens_per_step=_tokens(config), block=args.block)
    text = render(summary, args)
    if args.before:
        before = compare([{"plait": entry[BEFORE], "plain": entry["plain"]} for entry in rounds], warmup=args.warmup,
                         tokens_per_step=_tokens(config), block=args.block)
        after_before = [p / q for p, q in zip(summary["tokens_per_s"]["plait"], before["tokens_per_s"]["plait"])]
        summary["before"] = {**before, "after_over_before": after_before}
        text += (f"\nbefore ({args.before}) / plain: per-round ratio median {before['median_round_ratio']:.3f}, "
                 f"min {before['round_ratio_min']:.3f}, max {before['round_ratio_max']:.3f}; block median "
                 f"{before['median_block_round_ratio']:.3f}\nafter / before per round: median "
                 f"{statistics.median(after_before):.3f}, min {min(after_before):.3f}, max {max(after_before):.3f}")
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"args": vars(args), **summary, "rounds": rounds}, indent=1))
    (out / "summary.txt").write_text(text + "\n")
    return 0 if summary["losses_agree"] else 1


def _tokens(config) -> int:
    return config.global_batch * config.seq_len


if __name__ == "__main__":
    raise SystemExit(main())
