"""How a rank waiting on shared memory should wait: poll for ``shm_spin_us``, then
block on its doorbell. Measures, for each spin budget, the one-way latency of a
small message (ping-pong between group ranks 0 and 1, the others idle) and the
time of small and medium all-reduces with every rank busy, at 2 and 4 processes
on this machine's cores (4 ranks on 2 cores: a spinning rank takes a core its
peer needs).

    .venv/bin/python bench/shm_wait.py [--spins 0,20,50,200,1000] [--nprocs 2,4] [--rounds 5]

Each round runs every spin budget once, in an order that alternates between
rounds; the table has the median over rounds and the min..max. Where the ranks
outnumber the cores the transport does not poll whatever the budget (see
plait.comm.shm_setup.connect), so those rows differ by noise only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import plait.comm as comm
from plait.testing import run_fresh_world

SIZES_BYTES = (1024, 64 << 10, 1 << 20)


def _time_s(call, iters: int) -> float:
    for _ in range(max(3, iters // 10)):
        call()
    dist.barrier()
    start_s = time.perf_counter()
    for _ in range(iters):
        call()
    elapsed = torch.tensor([time.perf_counter() - start_s], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() / iters


def measure(rank: int, world_size: int, spins_us, rounds: int) -> dict:
    communicators = {}
    for spin_us in spins_us:
        group = dist.new_group(list(range(world_size)))
        communicators[spin_us] = comm.init_communicator(group, comm.CommConfig(transport="shm", shm_spin_us=spin_us))
    results: dict = {}
    message = torch.zeros(64, dtype=torch.uint8)
    for round_index in range(rounds):
        order = spins_us if round_index % 2 == 0 else list(reversed(spins_us))
        for spin_us in order:
            communicator = communicators[spin_us]
            transport = communicator.transport

            def ping_pong():
                if rank == 0:
                    transport.send(message, 1, 1).wait()
                    transport.recv(message, 1, 2).wait()
                elif rank == 1:
                    transport.recv(message, 0, 1).wait()
                    transport.send(message, 0, 2).wait()

            results.setdefault((spin_us, "latency"), []).append(_time_s(ping_pong, 300) / 2)
            for nbytes in SIZES_BYTES:
                tensor = torch.zeros(nbytes // 4)
                iters = 200 if nbytes <= 65536 else 40
                results.setdefault((spin_us, nbytes), []).append(
                    _time_s(lambda: comm.all_reduce(tensor, group=communicator), iters))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spins", default="0,20,50,200,1000", help="spin budgets in microseconds")
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    spins_us = [float(text) for text in args.spins.split(",")]
    print("# one-way latency of a 64-byte message (ranks 0-1) and all_reduce time (every rank), microseconds:")
    print("# median over rounds [min..max]")
    for nprocs in (int(text) for text in args.nprocs.split(",")):
        results = run_fresh_world(measure, nprocs, spins_us, args.rounds, timeout_s=600.0)[0]
        header = f"{'p':>2} {'spin us':>8} {'latency':>20}" + "".join(f"{f'all_reduce {n} B':>26}"
                                                                      for n in SIZES_BYTES)
        print(header)
        for spin_us in spins_us:
            cells = []
            for key in ["latency", *SIZES_BYTES]:
                times_us = [t * 1e6 for t in results[(spin_us, key)]]
                cells.append(f"{statistics.median(times_us):8.1f} [{min(times_us):.0f}..{max(times_us):.0f}]")
            print(f"{nprocs:>2} {spin_us:>8g} {cells[0]:>20}" + "".join(f"{cell:>26}" for cell in cells[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
