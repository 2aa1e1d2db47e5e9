"""plait's recomputation against torch.utils.checkpoint on one process: step time and
peak resident memory of a GPT at a sequence length where activations dominate.

    .venv/bin/python bench/memory_peers.py [--seq-len 512] [--rounds 3] [--steps 6]

Variants, each one forward + backward of the same GPT on the same tokens:
  none            plait, no recomputation
  plait-full      plait's recompute of every block (GPT.set_recompute("full"))
  torch-full      torch.utils.checkpoint(use_reentrant=False) around every block
  plait-selective plait's recompute of the attention core only
  plait-bf16      plait's GPT under torch.autocast(bfloat16) (what --precision bf16-mixed runs)

Per round every variant runs once, in an order rotated each round; per variant the
step time is the median of --steps steps after one warm-up, and the memory is the
process's peak resident set during a step minus its resident set before it (VmHWM
reset through /proc/self/clear_refs: measured by the kernel, not by any hook). The
script re-executes itself with MALLOC_MMAP_THRESHOLD_=65536 so that glibc maps every
tensor of 64 KiB or more on its own and returns it at free: the resident set then
follows the live tensors instead of keeping freed memory.
Printed: medians over rounds with [min-max], and plait-full / torch-full.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.utils.checkpoint as torch_checkpoint

from plait.models import GPT, GPTConfig
from plait.train.memory import read_peak_resident_bytes, reset_peak_resident

VARIANTS = ("none", "plait-full", "torch-full", "plait-selective", "plait-bf16")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * 4096


def _step(model: GPT, tokens: torch.Tensor, variant: str) -> None:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if variant == "torch-full":
        x = model.embed(inputs)
        for block in model.blocks:
            x = torch_checkpoint.checkpoint(block, x, inputs.shape[1], use_reentrant=False)
        logits = model.logits(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    elif variant == "plait-bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    else:
        loss = model.loss(inputs, targets)
    loss.backward()


def measure(model: GPT, tokens: torch.Tensor, variant: str, steps: int) -> tuple[float, int]:
    mode = {"plait-full": "full", "plait-selective": "selective"}.get(variant, "none")
    model.set_recompute(mode)
    model.zero_grad(set_to_none=True)
    _step(model, tokens, variant)  # warm-up (and gradients allocated, so they do not count below)
    times, peaks = [], []
    for _ in range(steps):
        before = _resident_bytes()
        reset_peak_resident()
        start_s = time.perf_counter()
        _step(model, tokens, variant)
        times.append(time.perf_counter() - start_s)
        peaks.append((read_peak_resident_bytes() or 0) - before)
    return statistics.median(times), int(statistics.median(peaks))


def main() -> int:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # see the module docstring
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len, vocab=67)
    model = GPT(config, seed=0)
    tokens = torch.randint(0, config.vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    results: dict[str, list[tuple[float, int]]] = {variant: [] for variant in VARIANTS}
    for round_index in range(args.rounds):
        order = VARIANTS[round_index % len(VARIANTS):] + VARIANTS[:round_index % len(VARIANTS)]
        for variant in order:
            results[variant].append(measure(model, tokens, variant, args.steps))
    print(f"# GPT {args.layers} layers, h {args.hidden}, {args.heads} heads, s {args.seq_len}, b {args.batch}, fp32 "
          f"(bf16 under autocast); 1 thread; {args.rounds} rounds x {args.steps} steps; medians [min-max] over rounds")
    print(f"{'variant':<16}{'step ms':>22}{'peak RSS added MiB':>28}")
    for variant, rows in results.items():
        times = [t * 1e3 for t, _ in rows]
        peaks = [p / 2 ** 20 for _, p in rows]
        print(f"{variant:<16}{statistics.median(times):>10.1f} [{min(times):.1f}-{max(times):.1f}]"
              f"{statistics.median(peaks):>14.1f} [{min(peaks):.1f}-{max(peaks):.1f}]")
    ratios = [p[0] / t[0] for p, t in zip(results["plait-full"], results["torch-full"])]
    print(f"plait-full / torch-full step time, per round: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
