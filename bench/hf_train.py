"""Tokens/s of `plait train --model hf:CONFIG` (a Llama-style config written here) against
the same training written with torch's own stack, on the same model, data, global
batch, sequence length, optimizer, lr schedule and clipping, in fresh worlds of 2 local
gloo processes (issue 34).

    .venv/bin/python bench/hf_train.py [--layouts dp,zero3,tp] [--rounds 3] [--steps 40] [--warmup 10] \\
        [--busy-loop also|only|off] [--out bench-results/hf-train] [-- more plait train flags]

Layouts (2 processes each):

- dp:    `plait train --dp 2` (plait's DataParallel engine) against torch
         ``DistributedDataParallel``;
- zero3: `plait train --dp 2 --zero-stage 3` (one unit per decoder block, and the
         embedding, final norm and head) against torch ``fully_shard`` (FSDP2) on the
         same units, then the root;
- tp:    `plait train --dp 1 --tp 2` (the Llama plan, plait.parallel.tensor.llama) against
         torch ``parallelize_module`` with HF's Llama tp plan in torch's styles plus the
         vocabulary-parallel embedding and column-parallel head plait's plan has
         (``plait.bench.hf.torch_tp_plan``).

The torch side (``--worker``, launched with torchrun) is what a PyTorch user writes: the
HF model built as plait train builds it (``plait.train.hf_model.build``: the same seed,
so the same initial weights), plait train's batch function per step (the same tokens:
its character corpus, this dp rank's rows; tp's ranks take the whole batch), plait's
AdamW parameter groups, the lr set from the same schedule each step,
``torch.nn.utils.clip_grad_norm_`` with the same max norm, ``loss.item()`` each step.
Its tokens are counted from the batches it trained on.

Timing, identical on both sides: rank 0 stamps ``time.perf_counter()`` at the end of
every step (plait: the ``elapsed_s`` of each metrics.jsonl record, right after the
optimizer step; torch: after ``loss.item()``). tokens/s = tokens of steps
warmup..steps-1 / (stamp[steps-1] - stamp[warmup-1]): equal step windows, with start-up,
data loading, model construction, the first ``warmup`` steps and plait's final
checkpoint and report outside. Each round runs both sides of a layout one after the
other, the order alternating per round. Reported (bench/train_vs_ddp.py's arithmetic):
median tokens/s per side, the per-round ratios plait / torch with their min-max, the
same over the median ``--block``-step block (robust to bursts of outside load), and the
largest step-by-step loss difference (within LOSS_TOLERANCE: not bit-equal, see
train_vs_ddp.py; step 1's losses, before any update, agree to float32 round-off).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from plait.bench.busy import busy_loop

HERE = Path(__file__).resolve().parent
LAYOUTS = {"dp": ("ddp", ["--dp", "2", "--tp", "1"]),
           "zero3": ("fsdp2", ["--dp", "2", "--tp", "1", "--zero-stage", "3"]),
           "tp": ("torch-tp", ["--dp", "1", "--tp", "2"])}
NPROCS = 2
STEP1_TOLERANCE = 1e-4  # step 1 (the same weights and batch): float32 sums in another order, ~1e-6 relative


def _train_vs_ddp():
    """bench/train_vs_ddp.py's arithmetic (tokens_per_s, block_tokens_per_s, compare)."""
    spec = importlib.util.spec_from_file_location("train_vs_ddp", HERE / "train_vs_ddp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----- the torch side (one process of the torchrun world) -------------------------------------
def torch_loop(config, peer: str) -> dict | None:
    """The torch training loop on this rank; rank 0 returns {"losses", "stamps_s", "tokens"}."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.bench.hf import torch_tp_plan
    from plait.train import hf_model
    from plait.train.build import batch, load_data, make_optimizer

    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = load_data(config)
    model = hf_model.build(config.hf_source, dtype=config.dtype, seed=config.seed)
    dp_rank, dp_size = (0, 1) if peer == "torch-tp" else (rank, world_size)
    if peer == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    elif peer == "fsdp2":
        mesh = init_device_mesh("cpu", (world_size,))
        for unit in hf_model.zero_units(model):  # plait's stage-3 units: each block, embedding, norm, head
            fully_shard(unit, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    else:
        wrapped = parallelize_module(model, init_device_mesh("cpu", (world_size,)), torch_tp_plan())
    optimizer = make_optimizer(model.named_parameters(), config)
    losses, stamps_s, tokens = [], [], 0
    dist.barrier()
    for step in range(config.steps):
        inputs, targets = batch(config, data, step, dp_rank, dp_size)
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss = hf_model.loss_fn(wrapped(input_ids=inputs, use_cache=False).logits, targets)
        loss.backward()
        if config.grad_clip and peer == "torch-tp":
            clip_mixed_grad_norm_(list(model.parameters()), config.grad_clip)
        elif config.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        stamps_s.append(time.perf_counter())
        tokens += targets.numel()
    mean = torch.tensor(losses, dtype=torch.float64)  # after the clock: the curve of the mean over ranks
    dist.all_reduce(mean)
    mean /= world_size
    counted = torch.tensor([tokens], dtype=torch.float64)
    dist.all_reduce(counted)
    counted /= world_size // dp_size  # tp's ranks trained on the same rows
    del wrapped
    dist.barrier()
    return {"losses": mean.tolist(), "stamps_s": stamps_s, "tokens": float(counted)} if rank == 0 else None


def clip_mixed_grad_norm_(parameters, max_norm: float):
    """torch's clip_grad_norm_ for a model parallelize_module left with DTensor (sharded)
    and plain (replicated: RMSNorm weights) gradients, which torch's own refuses
    ("aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor"): the norm of each
    kind (the DTensors' over the whole tensors: one scalar all-reduce), combined, and
    every gradient scaled by min(1, max_norm / (norm + 1e-6)) as torch does."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = [param.grad for param in parameters if param.grad is not None]
    sharded = [grad for grad in grads if isinstance(grad, DTensor)]
    plain = [grad for grad in grads if not isinstance(grad, DTensor)]
    norms = [torch.nn.utils.get_total_norm(kind) for kind in (sharded, plain) if kind]
    norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
    total = float(torch.linalg.vector_norm(torch.stack(norms)))
    scale = min(1.0, max_norm / (total + 1e-6))
    for grad in grads:
        grad.mul_(scale)
    return total


def _worker(args, extra) -> int:
    """One rank of the torch loop, or (--via trainer) of plait train's Trainer."""
    import torch.distributed as dist

    config = _config(args, extra, LAYOUTS[args.layout][1])
    dist.init_process_group("gloo")
    try:
        if args.via == "trainer":
            from plait.train.loop import Trainer

            Trainer(config, resume="never", log=lambda _: None).train()
            return 0
        result = torch_loop(config, LAYOUTS[args.layout][0])
        if result is not None:
            Path(args.result).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


# ----- one run of each side -------------------------------------------------------------------
def _train_flags(args, extra, layout_flags) -> list[str]:
    return ["--model", f"hf:{args.config_dir}", *layout_flags, "--pp", "1", "--steps", str(args.steps),
            "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch), "--eval-interval", "0",
            "--checkpoint-interval", "0", "--data-max-bytes", str(args.data_max_bytes), *extra]


def _config(args, extra, layout_flags):
    """plait's TrainConfig from the flags `plait train` gets (one micro-batch per dp rank)."""
    from plait.train.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = parser.parse_args(_train_flags(args, extra, layout_flags)
                              + (["--out", str(args.trainer_out)] if args.trainer_out else []))
    flags.micro_batch = args.global_batch // flags.dp
    return config_from_args(flags, None)


def _environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, env=_environment(), capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{what} failed (exit {result.returncode}): {' '.join(command)}\n"
                           f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def run_plait(args, extra, layout: str, out: Path) -> dict:
    """`plait train` (--via cli), or its Trainer on torchrun's ranks (--via trainer: what
    each rank of plait train runs, without the launcher's checks); its per-step records."""
    if args.via == "cli":
        flags = _train_flags(args, extra, LAYOUTS[layout][1])
        dp = 1 if layout == "tp" else NPROCS
        _run([sys.executable, "-m", "plait", "train", *flags, "--micro-batch", str(args.global_batch // dp),
              "--sample-chars", "0", "--out", str(out), "--resume", "never", "--force-fresh"],
             f"plait train ({layout})")
    else:
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROCS),
              "--monitor-interval", "1", str(Path(__file__).resolve()), "--worker", "--via", "trainer", "--layout",
              layout, "--trainer-out", str(out), *_passed_flags(args), "--", *extra], f"plait's Trainer ({layout})")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    report = out / "report.json"  # plait's own figure: the mean over every step but the first
    reported = (json.loads(report.read_text()).get("throughput", {}).get("mean_tokens_per_s")
                if report.exists() else None)
    return {"losses": [record["loss"] for record in records], "stamps_s": [record["elapsed_s"] for record in records],
            "report_tokens_per_s": reported}


def run_torch(args, extra, layout: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    result = out / "torch.json"
    result.unlink(missing_ok=True)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROCS),
          "--monitor-interval", "1", str(Path(__file__).resolve()), "--worker", "--layout", layout, "--result",
          str(result), *_passed_flags(args), "--", *extra], f"the torch loop ({layout})")
    return json.loads(result.read_text())


def _passed_flags(args) -> list[str]:
    return ["--config-dir", str(args.config_dir), "--steps", str(args.steps), "--seq-len", str(args.seq_len),
            "--global-batch", str(args.global_batch), "--data-max-bytes", str(args.data_max_bytes)]


# ----- the comparison -------------------------------------------------------------------------


def measure(args, extra, out: Path, arithmetic) -> dict:
    """Every layout, args.rounds rounds, sides alternated; the summary per layout."""
    tokens_per_step = args.global_batch * args.seq_len
    summaries = {}
    for layout in args.layouts:
        rounds = []
        for index in range(args.rounds):
            entry = {}
            for side in (("plait", "plain") if index % 2 == 0 else ("plain", "plait")):
                run = run_plait if side == "plait" else run_torch
                entry[side] = run(args, extra, layout, out / f"{layout}-round{index}-{side}")
                speed = arithmetic.tokens_per_s(entry[side]["stamps_s"], args.warmup, tokens_per_step)
                print(f"# {layout} round {index} {'plait train' if side == 'plait' else LAYOUTS[layout][0]}: "
                      f"{speed:.0f} tokens/s", file=sys.stderr, flush=True)
            rounds.append(entry)
        summary = arithmetic.compare(rounds, warmup=args.warmup, tokens_per_step=tokens_per_step, block=args.block)
        counted = {entry["plain"]["tokens"] for entry in rounds}
        step1 = max(abs(entry["plait"]["losses"][0] - entry["plain"]["losses"][0]) for entry in rounds)
        reported = [entry["plait"]["report_tokens_per_s"] for entry in rounds if entry["plait"]["report_tokens_per_s"]]
        summaries[layout] = {**summary, "rounds": rounds, "torch_tokens_counted": sorted(counted),
                             "plait_report_tokens_per_s": statistics.median(reported) if reported else None,
                             "tokens_expected": tokens_per_step * args.steps, "step1_loss_difference": step1,
                             "step1_losses_agree": step1 <= STEP1_TOLERANCE}
    return summaries


def render(summaries: dict, args, load: str) -> str:
    lines = [f"plait train --model hf:(Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads / "
             f"{args.kv_heads} kv, MLP {args.intermediate}, vocab {args.vocab}, float32) vs torch, "
             f"{NPROCS} gloo processes, global batch {args.global_batch} x seq {args.seq_len}, {args.steps} steps "
             f"({args.warmup} warm-up, outside the window), {args.rounds} rounds; {load}; load average "
             f"{' '.join(f'{value:.2f}' for value in os.getloadavg())}",
             f"{'layout':<7}{'torch side':<10}{'plait tok/s':>12}{'(report)':>10}{'torch tok/s':>12}"
             f"{'ratio median [min-max]':>26}{'block ratio [min-max]':>26}{'max |dloss|':>13}{'step-1 dloss':>14}"]
    for layout, summary in summaries.items():
        medians = summary["median_tokens_per_s"]
        ratio = (f"{summary['median_round_ratio']:.3f} [{summary['round_ratio_min']:.3f}-"
                 f"{summary['round_ratio_max']:.3f}]")
        block = (f"{summary['median_block_round_ratio']:.3f} [{summary['block_round_ratio_min']:.3f}-"
                 f"{summary['block_round_ratio_max']:.3f}]")
        reported = summary["plait_report_tokens_per_s"]
        reported = f"{reported:.0f}" if reported else "-"
        lines.append(f"{layout:<7}{LAYOUTS[layout][0]:<10}{medians['plait']:>12.0f}{reported:>10}"
                     f"{medians['plain']:>12.0f}"
                     f"{ratio:>26}{block:>26}{summary['max_loss_difference']:>13.1e}"
                     f"{summary['step1_loss_difference']:>14.1e}")
    lines.append("tok/s: tokens of the steps after the warm-up over their stamps' span, median over rounds; "
                 "(report): plait train's report.json mean (every step but the first), median over rounds")
    lines.append("ratio: plait train / torch tokens/s per round (> 1: plait faster); block: over the median "
                 f"{args.block}-step block; torch's tokens counted from its batches: "
                 + ", ".join(f"{layout} {summary['torch_tokens_counted']} (expected {summary['tokens_expected']})"
                             for layout, summary in summaries.items()))
    return "\n".join(lines)


def write_config(args) -> None:
    """The Llama config.json plait train reads (plait.bench.hf's model at these sizes)."""
    from plait.bench.hf import HfBenchConfig, llama_config

    sizes = HfBenchConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                          intermediate=args.intermediate, vocab=args.vocab, seq_len=args.seq_len)
    llama_config(sizes).save_pretrained(args.config_dir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", type=lambda text: [part for part in text.split(",") if part],
                        default=list(LAYOUTS), help="comma list of dp, zero3, tp (default all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the clock starts (>= 1)")
    parser.add_argument("--block", type=int, default=10, help="steps per block (plait's --log-interval, default 10)")
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 8), ("kv_heads", 4), ("intermediate", 512),
                          ("vocab", 2048), ("seq_len", 128), ("global_batch", 8), ("data_max_bytes", 1_000_000)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"(default {default})")
    parser.add_argument("--busy-loop", choices=("also", "only", "off"), default="also",
                        help="also (default): measure quiet, then with a nice -n 19 busy loop; only; off")
    parser.add_argument("--via", choices=("cli", "trainer"), default="cli",
                        help="plait's side: the plait train command (default), or its Trainer on torchrun's ranks")
    parser.add_argument("--out", default="bench-results/hf-train")
    parser.add_argument("--trainer-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank of the torch loop
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--config-dir", help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="more plait train flags (after --), given to both sides")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args, args.extra)
    unknown = [layout for layout in args.layouts if layout not in LAYOUTS]
    if unknown or not args.layouts or args.rounds < 1 or not 1 <= args.warmup < args.steps \
            or not 1 <= args.block <= args.steps - args.warmup or args.global_batch % NPROCS:
        raise SystemExit(f"need --layouts from {', '.join(LAYOUTS)} (got {unknown or 'none'}), --rounds >= 1, "
                         f"1 <= --warmup < --steps, 1 <= --block <= steps - warmup and --global-batch a multiple of "
                         f"{NPROCS}; got {args.rounds}, {args.warmup}, {args.steps}, {args.block}, {args.global_batch}")
    out = Path(args.out)
    args.config_dir = out / "config"
    write_config(args)
    arithmetic = _train_vs_ddp()
    conditions = {"also": (False, True), "only": (True,), "off": (False,)}[args.busy_loop]
    document, agree = {"args": {key: str(value) for key, value in vars(args).items()}}, True
    for busy in conditions:
        with busy_loop(busy) as spinner_pid:
            load = f"with a nice -n 19 busy loop (pid {spinner_pid})" if busy else "no load added"
            summaries = measure(args, args.extra, out / ("busy" if busy else "quiet"), arithmetic)
        text = render(summaries, args, load)
        print(text, flush=True)
        document["busy" if busy else "quiet"] = {"text": text, **summaries}
        agree = agree and all(s["losses_agree"] and s["step1_losses_agree"] for s in summaries.values())
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(document, indent=1, default=str))
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
