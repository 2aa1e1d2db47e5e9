"""The commands that spawn local workers (plait bench, its training benchmarks, plait
calibrate) check them against this machine before any starts: memory from
plait.train.budget.available_memory_bytes (MemAvailable, or the cgroup's remaining
limit), cores from the CPU affinity mask, the rule from plait.bench.limits."""

from __future__ import annotations

import argparse
import os

from plait.bench.limits import check_local_ranks, MAX_RANKS_PER_CORE
from plait.train.budget import available_memory_bytes

OVERSUBSCRIBE_FLAG = "--allow-oversubscribe"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def add_oversubscribe_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(OVERSUBSCRIBE_FLAG, action="store_true",
                        help=f"run more than {MAX_RANKS_PER_CORE} local processes per core (refused by default: "
                             "the timings would measure the scheduler); memory is checked regardless")


def check_spawn(nprocs: int, *, allow_oversubscribe: bool = False, per_rank_bytes: int = 0, what: str = "",
                fix: str = "", flag: str = "--nprocs") -> None:
    """Raise ValueError (one line, with the numbers) if ``nprocs`` local workers do not
    fit this machine's memory or cores (plait.bench.limits.check_local_ranks). A count
    below 1 is left to the command's own config, which names its flag."""
    if nprocs < 1:
        return
    check_local_ranks(nprocs, available_bytes=available_memory_bytes(), cores=usable_cores(),
                      per_rank_bytes=per_rank_bytes, allow_oversubscribe=allow_oversubscribe, what=what, fix=fix,
                      flag=flag)
