"""What plait's argument check costs per call: all_reduce latency with the check on
and off, on local gloo processes.

    .venv/bin/python bench/check_cost.py NPROCS MODES ALGORITHM    (e.g. 4 inband,off,deep auto)
    NUMEL=32768 .venv/bin/python bench/check_cost.py 4 inband,off star    (float32 elements; default 256 = 1 KB)

Per mode, 5 rounds, the modes alternating within each round; a round is 20 warm-up
calls, a barrier, then 200 timed back-to-back calls; its time is the max over ranks of
the mean per call. Prints the median and [min-max] over the rounds per mode.

MODES are CommConfig's check modes (inband, deep, off), set with
``init_communicator(None, CommConfig(check=mode))``. Run against a tree from before
the Communicator (PYTHONPATH=that/src), the modes are on/off, set with that tree's
``comm.configure(check_args=...)``: the old agreement all-gather.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import plait.comm as comm  # the tree on PYTHONPATH decides which API (see _set_mode)

ROUNDS, WARMUP, CALLS = 5, 20, 200


def _set_mode(mode: str) -> None:
    if hasattr(comm, "init_communicator"):
        comm.init_communicator(None, comm.CommConfig(check=mode))
    else:  # a tree from before the Communicator
        comm.configure(check_args=mode == "on")


def worker(rank: int, p: int, port: int, modes: list[str], algorithm: str, numel: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p, timeout=datetime.timedelta(seconds=120))
    x = torch.ones(numel)
    results: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(ROUNDS):
        for mode in modes:
            _set_mode(mode)
            for _ in range(WARMUP):
                comm.all_reduce(x, algorithm=algorithm)
            dist.barrier()
            start_s = time.perf_counter()
            for _ in range(CALLS):
                comm.all_reduce(x, algorithm=algorithm)
            per_call = torch.tensor([(time.perf_counter() - start_s) / CALLS])
            dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
            results[mode].append(per_call.item() * 1e6)
    if rank == 0:
        out.put(results)
    dist.barrier()
    os._exit(0)  # skip interpreter teardown: every rank is done


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    p, modes, algorithm = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
    numel = int(os.environ.get("NUMEL", "256"))
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = 29000 + os.getpid() % 1000
    processes = [context.Process(target=worker, args=(rank, p, port, modes, algorithm, numel, queue))
                 for rank in range(p)]
    for process in processes:
        process.start()
    results = queue.get(timeout=600)
    for process in processes:
        process.join()
    for mode, values in results.items():
        print(f"p={p} {numel * 4} B algorithm={algorithm} check={mode}: median {statistics.median(values):.0f} us "
              f"[{min(values):.0f}-{max(values):.0f}] over {len(values)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
