"""CPU seconds per training step of `plait train`'s loop and of the plain DDP loop of
bench/train_vs_ddp.py, in one torchrun world, alternately: a figure that load from
outside the run hardly moves (tokens/s on a shared 2-core machine swings by +-30%).

    flock /work/bench.lock .venv/bin/python -m torch.distributed.run --standalone \\
        --nproc-per-node 4 bench/train_vs_ddp_cpu.py [--steps 60] [--rounds 3] [--out DIR]

Each round builds plait's ``Trainer`` (dp = world size, one micro-batch per rank, no
evaluation) and runs its ``train()``, then the plain loop (``plain_loop`` of
bench/train_vs_ddp.py: the same GPT, data, AdamW, lr and clipping), in alternating
order. Around each, every rank reads ``time.process_time()`` (CPU time of all its
threads: the comm threads and gloo's included); the figure is the sum over ranks
divided by the steps. The report and the final checkpoint, which run after plait's
last step and which the plain loop does not have, are left out (replaced by no-ops
here). With 4 processes on 2 cores the run is CPU-bound, so tokens/s follows the
inverse of this figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _plain_loop():
    spec = importlib.util.spec_from_file_location("train_vs_ddp", Path(__file__).with_name("train_vs_ddp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.plain_loop


def _cpu_s_per_step(run, steps: int) -> float:
    """CPU seconds of ``run()`` over every rank of the world, per step (collective)."""
    dist.barrier()
    start_s = time.process_time()
    run()
    used = torch.tensor([time.process_time() - start_s], dtype=torch.float64)
    dist.all_reduce(used)
    return float(used) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench-results/train-vs-ddp-cpu")
    args = parser.parse_args()
    from plait.train.config import TrainConfig
    from plait.train.loop import Trainer

    dist.init_process_group("gloo")
    world_size, plain_loop = dist.get_world_size(), _plain_loop()
    cpu_s = {"plait": [], "plain": []}
    for index in range(args.rounds):
        config = TrainConfig(dp=world_size, tp=1, pp=1, steps=args.steps, eval_interval=0, checkpoint_interval=0,
                             micro_batch=TrainConfig().global_batch // world_size, out=f"{args.out}/round{index}")
        trainer = Trainer(config, resume="never", force_fresh=True, log=lambda *_: None)
        trainer._report = lambda *_args, **_kwargs: None  # after the last step: not per-step work
        trainer.save = lambda step: None
        sides = [("plait", trainer.train), ("plain", lambda: plain_loop(config))]
        for name, run in (sides if index % 2 == 0 else sides[::-1]):
            cpu_s[name].append(_cpu_s_per_step(run, args.steps))
    if dist.get_rank() == 0:
        medians = {name: statistics.median(values) for name, values in cpu_s.items()}
        for name, values in cpu_s.items():
            print(f"{name}: {1e3 * medians[name]:.1f} CPU ms per step ({world_size} ranks summed), rounds "
                  + ", ".join(f"{1e3 * value:.1f}" for value in values))
        print(f"plain / plait CPU per step: {medians['plain'] / medians['plait']:.3f} "
              "(> 1: plait's loop costs less CPU per step)")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu.json").write_text(json.dumps({"cpu_s_per_step": cpu_s, "medians": medians}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
