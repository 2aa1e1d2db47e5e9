"""The parameter server's configuration, its sharding rule and its records (what a
shard holds, what a push did, what a rank did); torch-free. The messages they exchange
are ``plait.parallel.ps.protocol``'s; ``plait.parallel.ps.worker`` runs them."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

MODES = ("sync", "async")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class ParameterServerConfig:
    """How the parameter server runs (see the module docstring for the modes).

    num_servers: ranks acting as servers (the last ones of the group), 1..p-1.
    mode: "sync" (data-parallel equivalent) or "async" (stale synchronous parallel).
    max_staleness: async only: steps a worker may run ahead of the slowest (0 =
        lock-step rounds with per-push updates).
    order: async only: "arrival", or an int seed for a reproducible serving order.
    """

    num_servers: int = 1
    mode: str = "sync"
    max_staleness: int = 0
    order: str | int = "arrival"

    def __post_init__(self):
        problems = []
        if not _is_int(self.num_servers) or self.num_servers < 1:
            problems.append(f"num_servers must be an int >= 1, got {self.num_servers!r}")
        if self.mode not in MODES:
            problems.append(f"mode must be one of {MODES}, got {self.mode!r}")
        if not _is_int(self.max_staleness) or self.max_staleness < 0:
            problems.append(f"max_staleness must be an int >= 0 (steps a worker may run ahead of the "
                            f"slowest), got {self.max_staleness!r}")
        elif self.mode == "sync" and self.max_staleness:
            problems.append(f"max_staleness={self.max_staleness} only applies to mode='async' (sync mode has "
                            f"no staleness); pass mode='async' or max_staleness=0")
        if not (self.order == "arrival" or _is_int(self.order)):
            problems.append(f"order must be 'arrival' or an int seed, got {self.order!r}")
        elif self.mode == "sync" and self.order != "arrival":
            problems.append(f"order={self.order!r} only applies to mode='async' (sync mode always averages in "
                            f"worker-rank order); leave order='arrival'")
        if problems:
            raise ValueError("invalid parameter server config: " + "; ".join(problems))

    def check_world_size(self, world_size: int) -> None:
        """At least one worker must remain: num_servers in 1..world_size-1."""
        if world_size < 2:
            raise ValueError(f"a parameter server needs >= 2 ranks (servers and workers), got world_size={world_size}; "
                             f"launch at least 2 processes")
        if self.num_servers >= world_size:
            raise ValueError(f"num_servers={self.num_servers} >= world_size={world_size} leaves no workers; "
                             f"use 1..{world_size - 1}")


def shard_by_size(nbytes: Sequence[int], num_servers: int) -> tuple[tuple[int, ...], ...]:
    """Assign tensors (by index) whole to servers: largest first to the least loaded
    (LPT; the busiest server holds at most 4/3 - 1/(3k) of the optimum, Graham 1969).
    Ties go to the lower index. Returns each server's indices in ascending order.
    Cost O(n log n + n·k)."""
    loads_nbytes = [0] * num_servers
    owned: list[list[int]] = [[] for _ in range(num_servers)]
    for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        server = min(range(num_servers), key=lambda s: (loads_nbytes[s], s))
        loads_nbytes[server] += nbytes[index]
        owned[server].append(index)
    return tuple(tuple(sorted(indices)) for indices in owned)


@dataclass(frozen=True)
class Shard:
    """The parameters one server owns: names in registration order, their size."""

    server: int  # group rank
    names: tuple[str, ...]
    numel: int
    nbytes: int


@dataclass(frozen=True)
class PushRecord:
    """One push as a server applied it. ``version``: server updates applied before it;
    ``update_staleness``: updates applied since the worker pulled the parameters it
    used; ``steps_ahead``: how far ahead of the slowest the worker was when it started
    the step."""

    worker: int
    step: int
    version: int
    update_staleness: int
    steps_ahead: int


@dataclass(frozen=True)
class ParameterServerStats:
    """What one rank did. Servers: ``updates`` optimiser steps, ``pushes`` applied,
    ``push_log`` in order. Workers: ``pushes`` = steps, staleness as their servers
    reported it. Bytes include headers; ``wait_time_s`` is time blocked on peers."""

    role: str
    rank: int
    mode: str
    pushes: int
    updates: int
    bytes_sent: int
    bytes_received: int
    wait_time_s: float
    max_steps_ahead: int
    max_update_staleness: int
    push_log: tuple[PushRecord, ...] = ()
