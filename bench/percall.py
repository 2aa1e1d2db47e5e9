"""The per-call cost of a warm collective: plait's all_reduce against torch's gloo, and
rank 0's Python profile of plait's calls.

    OMP_NUM_THREADS=1 .venv/bin/python bench/percall.py --nprocs 2 --bytes 1024 --iters 300 \\
        [--busy 2] [--profile] [--spin-max-us 500]

In a fresh world of ``--nprocs`` local processes (``plait.testing.run_fresh_world``,
gloo, plait's shared-memory transport between them), each side (plait's
``algorithm="auto"``, then ``torch.distributed.all_reduce``) makes 20 untimed calls, then
5 rounds of ``--iters`` back-to-back calls of a ``--bytes`` float32 tensor after a
barrier. Each rank reports the median of its rounds in microseconds per call.
``--busy N`` runs N ``nice -n 19`` busy loops beside the ranks for the whole run. With
``--profile``, rank 0 profiles ``--iters`` more plait calls with cProfile and prints the
top functions by their own time; its calls per all_reduce are the profile's function
calls divided by ``--iters``. ``--spin-max-us`` sets ``CommConfig.shm_spin_max_us``
for the world's communicator.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

import plait.comm as comm
from plait.bench.busy import busy_loops
from plait.testing import run_fresh_world

WARMUP_CALLS = 20
ROUNDS = 5


def _call(side: str, tensor: torch.Tensor) -> None:
    if side == "torch":
        dist.all_reduce(tensor)
    else:
        comm.all_reduce(tensor, algorithm=side)


def measure(rank: int, world_size: int, nbytes: int, iters: int, profile: bool,
            spin_max_us: float | None) -> tuple[dict[str, float], str | None]:
    """This rank's median microseconds per call of each side, and rank 0's profile text."""
    if spin_max_us is not None:
        comm.init_communicator(None, comm.CommConfig(shm_spin_max_us=spin_max_us))
    tensor = torch.ones(max(nbytes // 4, 1))
    per_call_us = {}
    for side in ("auto", "torch"):
        for _ in range(WARMUP_CALLS):
            _call(side, tensor)
        rounds_us = []
        for _ in range(ROUNDS):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                _call(side, tensor)
            rounds_us.append((time.perf_counter() - start) / iters * 1e6)
        per_call_us[side] = statistics.median(rounds_us)
    text = None
    if profile:
        profiler = cProfile.Profile() if rank == 0 else None
        if profiler is not None:
            profiler.enable()
        for _ in range(iters):
            _call("auto", tensor)
        if profiler is not None:
            profiler.disable()
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(30)
            text = stream.getvalue()
    return per_call_us, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--busy", type=int, default=0, help="nice 19 busy loops beside the ranks")
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0's plait calls")
    parser.add_argument("--spin-max-us", type=float, default=None, help="CommConfig.shm_spin_max_us")
    args = parser.parse_args()
    with busy_loops(args.busy):
        results = run_fresh_world(measure, args.nprocs, args.bytes, args.iters, args.profile, args.spin_max_us,
                                  timeout_s=600)
    for rank, (per_call_us, _) in enumerate(results):
        print(f"rank {rank}: " + "  ".join(f"{side} {us:.1f} us/call" for side, us in per_call_us.items()))
    auto_us = max(per_call_us["auto"] for per_call_us, _ in results)
    torch_us = max(per_call_us["torch"] for per_call_us, _ in results)
    print(f"slowest rank: plait auto {auto_us:.1f} us, torch gloo {torch_us:.1f} us, torch/plait {torch_us / auto_us:.2f}x")
    if results[0][1]:
        print(results[0][1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
