"""plait's memory techniques against their torch peers on one process: step time and
peak resident memory of one GPT, at a sequence length where activations dominate.

    python -m plait.bench.memory_peers [--seq-len 512] [--rounds 3] [--steps 4] [--json PATH]

(`plait bench memory` runs it in a child process: see below why.) Each variant is one
training step of the same GPT on the same tokens: --microbatches micro-batches of
--batch sequences, every forward and then the backwards from the last (GPipe's order
on one stage, where activation memory peaks), then an AdamW step:

  none               plait's GPT, fp32, nothing saved differently
  plait-full         plait's recomputation of every block (GPT.set_recompute("full"))
  torch-full         torch.utils.checkpoint(use_reentrant=False) around every block
  plait-selective    plait's recomputation of the attention core only
  plait-offload      plait's ActivationOffloader as the saved-tensor hooks (files on CPU),
                     each tensor read back when the backward needs it
  torch-save-on-cpu  torch.autograd.graph.save_on_cpu (on a CPU it copies each saved
                     tensor to another CPU tensor: no memory drops, only time is added)
  plait-bf16         plait.memory.precision.autocast(bfloat16), the loss in fp32
  plait-fp16         the same in float16 with plait's LossScaler (GradScaler's rule)
  torch-fp16         torch.autocast(float16) + torch.amp.GradScaler

Per round every variant runs once, in an order rotated each round; per variant the
step time is the median of --steps steps after one warm-up, and the memory is the
process's peak resident set during a step minus its resident set before it (VmHWM
reset through /proc/self/clear_refs: measured by the kernel, not by any hook). The
module re-executes itself with MALLOC_MMAP_THRESHOLD_=65536 so that glibc maps every
tensor of 64 KiB or more on its own and returns it at free: the resident set then
follows the live tensors instead of keeping freed memory.
Reported: medians over rounds with [min-max], and per peer pair the plait / torch
step-time ratio of each round (plait and its peer run back to back in every round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from plait.models import GPT, GPTConfig
from plait.memory.loss_scale import LossScaler
from plait.memory.offload import ActivationOffloader
from plait.memory.precision import autocast
from plait.train.memory import read_peak_resident_bytes, reset_peak_resident

VARIANTS = ("none", "plait-full", "torch-full", "plait-selective", "plait-offload", "torch-save-on-cpu",
            "plait-bf16", "plait-fp16", "torch-fp16")
PAIRS = (("plait-full", "torch-full"), ("plait-offload", "torch-save-on-cpu"), ("plait-fp16", "torch-fp16"))
MMAP_THRESHOLD = "65536"
_CPU = torch.device("cpu")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Step:
    """One variant's training step on ``model`` (its own optimizer and scaler)."""

    def __init__(self, model: GPT, variant: str, offload_dir: str):
        self.model, self.variant = model, variant
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.plait_scaler = LossScaler() if variant == "plait-fp16" else None
        self.torch_scaler = torch.amp.GradScaler("cpu") if variant == "torch-fp16" else None
        self.offloader = None
        if variant == "plait-offload":
            self.offloader = ActivationOffloader(offload_dir)
            self.offloader.keep_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model, variant = self.model, self.variant
        if variant == "torch-full":
            x = model.embed(inputs)
            for block in model.blocks:
                x = torch_checkpoint.checkpoint(block, x, inputs.shape[1], use_reentrant=False)
            logits = model.logits(x)
        else:
            dtype = {"plait-bf16": torch.bfloat16, "plait-fp16": torch.float16}.get(variant)
            if variant == "torch-fp16":
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(inputs)
            else:
                with autocast(_CPU, dtype):
                    logits = model(inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def _forward(self, index: int, tokens: torch.Tensor, last: bool) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if self.offloader is not None:
            self.offloader.begin(index, enabled=not last)  # the last forward's backward comes next: kept
            with torch.autograd.graph.saved_tensors_hooks(self.offloader.pack, self.offloader.unpack):
                loss = self._loss(inputs, targets)
            self.offloader.end()
            return loss
        if self.variant == "torch-save-on-cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                return self._loss(inputs, targets)
        return self._loss(inputs, targets)

    def __call__(self, micro_batches: list[torch.Tensor]) -> None:
        """GPipe's order on one stage: every micro-batch's forward, then the backwards
        last to first (what a pipeline's first stage holds at its peak)."""
        self.optimizer.zero_grad(set_to_none=False)
        count = len(micro_batches)
        losses = [self._forward(i, tokens, i == count - 1) / count for i, tokens in enumerate(micro_batches)]
        for index in reversed(range(count)):
            if self.offloader is not None and index > 0:
                self.offloader.prefetch(index - 1)  # the next backward's tensors, read while this one runs
            loss = losses.pop()
            if self.plait_scaler is not None:
                loss = self.plait_scaler.scale_loss(loss)
            elif self.torch_scaler is not None:
                loss = self.torch_scaler.scale(loss)
            loss.backward()
            del loss
        if self.plait_scaler is not None:
            self.plait_scaler.unscale(self.model.parameters())
            self.plait_scaler.step(self.optimizer)
            self.plait_scaler.update()
        elif self.torch_scaler is not None:
            self.torch_scaler.step(self.optimizer)
            self.torch_scaler.update()
        else:
            self.optimizer.step()

    def close(self) -> None:
        if self.offloader is not None:
            self.offloader.close()


def measure(model: GPT, tokens: list[torch.Tensor], variant: str, steps: int, offload_dir: str) -> tuple[float, int]:
    """(median step seconds, median peak resident bytes added by a step)."""
    model.set_recompute({"plait-full": "full", "plait-selective": "selective"}.get(variant, "none"))
    step = _Step(model, variant, offload_dir)
    try:
        step(tokens)  # warm-up: gradients and optimizer state allocated, so they do not count below
        times, peaks = [], []
        for _ in range(steps):
            before = _resident_bytes()
            reset_peak_resident()
            start_s = time.perf_counter()
            step(tokens)
            times.append(time.perf_counter() - start_s)
            peaks.append((read_peak_resident_bytes() or 0) - before)
    finally:
        step.close()
    return statistics.median(times), int(statistics.median(peaks))


def run_peers(*, seq_len: int, layers: int, hidden: int, heads: int, batch: int, microbatches: int, vocab: int,
              rounds: int, steps: int, variants=VARIANTS) -> dict:
    """Every variant, ``rounds`` times in rotated order; see the module docstring."""
    torch.set_num_threads(1)
    config = GPTConfig(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab)
    model = GPT(config, seed=0)
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (batch, seq_len + 1), generator=generator) for _ in range(microbatches)]
    results: dict[str, list[tuple[float, int]]] = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory(prefix="plait-peers-offload-") as offload_dir:
        for round_index in range(rounds):
            shift = round_index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                results[variant].append(measure(model, tokens, variant, steps, offload_dir))
    rows = []
    for variant, runs in results.items():
        times = [t for t, _ in runs]
        peaks = [p for _, p in runs]
        rows.append({"variant": variant, "step_s": statistics.median(times), "step_s_min": min(times),
                     "step_s_max": max(times), "peak_added_bytes": int(statistics.median(peaks)),
                     "peak_added_bytes_min": min(peaks), "peak_added_bytes_max": max(peaks)})
    pairs = []
    for mine, peer in PAIRS:
        if mine in results and peer in results:
            ratios = [a[0] / b[0] for a, b in zip(results[mine], results[peer])]
            pairs.append({"plait": mine, "peer": peer, "ratios": ratios, "median": statistics.median(ratios)})
    return {"config": {"seq_len": seq_len, "layers": layers, "hidden": hidden, "heads": heads, "batch": batch,
                       "microbatches": microbatches, "vocab": vocab, "rounds": rounds, "steps": steps, "threads": 1},
            "rows": rows, "pairs": pairs}


def render(result: dict) -> list[str]:
    c = result["config"]
    lines = [f"# one process: GPT {c['layers']} layers, h {c['hidden']}, {c['heads']} heads, s {c['seq_len']}, "
             f"{c['microbatches']} micro-batches of {c['batch']} (all forwards, then the backwards: GPipe's order) + "
             f"AdamW; {c['rounds']} rounds x {c['steps']} steps, 1 thread; "
             "medians [min-max] over rounds",
             f"{'variant':<19}{'step ms':>24}{'peak RSS added MiB':>30}"]
    for row in result["rows"]:
        lines.append(f"{row['variant']:<19}{row['step_s'] * 1e3:>10.1f} [{row['step_s_min'] * 1e3:.1f}-"
                     f"{row['step_s_max'] * 1e3:.1f}]{row['peak_added_bytes'] / 2 ** 20:>14.1f} "
                     f"[{row['peak_added_bytes_min'] / 2 ** 20:.1f}-{row['peak_added_bytes_max'] / 2 ** 20:.1f}]")
    for pair in result["pairs"]:
        lines.append(f"{pair['plait']} / {pair['peer']} step time: median {pair['median']:.3f} (per round "
                     f"{', '.join(f'{r:.3f}' for r in pair['ratios'])})")
    return lines


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:  # see the module docstring
        os.execve(sys.executable, [sys.executable, "-m", "plait.bench.memory_peers", *(argv or sys.argv[1:])],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})
    parser = argparse.ArgumentParser(prog="python -m plait.bench.memory_peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("seq-len", 512), ("layers", 4), ("hidden", 128), ("heads", 4), ("batch", 1),
                          ("microbatches", 4),
                          ("vocab", 67), ("rounds", 3), ("steps", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ",".join(VARIANTS))
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    variants = tuple(name.strip() for name in args.variants.split(",") if name.strip())
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants: unknown {', '.join(map(repr, unknown)) or '(none given)'}; valid: "
                     f"{', '.join(VARIANTS)}")
    result = run_peers(seq_len=args.seq_len, layers=args.layers, hidden=args.hidden, heads=args.heads,
                       batch=args.batch, microbatches=args.microbatches, vocab=args.vocab, rounds=args.rounds, steps=args.steps, variants=variants)
    print("\n".join(render(result)), flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
