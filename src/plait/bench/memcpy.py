"""The host's copy bandwidth, the ceiling a transport through shared memory runs
against: ``plait bench`` prints each algorithm's best busbw as a fraction of it."""

from __future__ import annotations

import time

import torch


def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """This process's copy bandwidth (GB/s, bytes copied per second): the median of
    ``repeats`` one-thread copies of ``nbytes`` between two host buffers, the limit a
    transport through shared memory copies at (each message is copied in and out)."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target.copy_(source)  # first touch of the target's pages
        times_s = []
        for _ in range(repeats):
            start_s = time.perf_counter()
            target.copy_(source)
            times_s.append(time.perf_counter() - start_s)
    finally:
        torch.set_num_threads(threads)
    return nbytes / sorted(times_s)[len(times_s) // 2] / 1e9
