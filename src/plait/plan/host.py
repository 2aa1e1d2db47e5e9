"""The host the ranks run on, as the planner prices it: how many ranks share how many
cores, and what that sharing adds to every synchronising call.

With more ranks than cores (``plait train``'s 4 processes on this machine's 2 cores)
the operating system time-slices the ranks: they drift apart, so a collective (or a
pipeline receive) waits for the slowest rank of its group besides moving its bytes.
The model of that wait, per call on a group of ``size`` > 1 ranks after ``segment_s``
seconds of compute since the group's previous synchronisation, is

    wait(size, segment) = sync_wait_s + sync_wait_per_compute · segment

with both terms fitted from a measurement on the machine (see ``fit_sync_wait``),
never assumed. ``spare_cores`` (cores − ranks·threads per rank, at least 0) says
whether a rank's background communication (plait's comm thread) can run beside its
compute: with none spare it takes its CPU time from the ranks' compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["HostModel"]


@dataclass(frozen=True, kw_only=True)
class HostModel:
    """``ranks`` processes of ``threads_per_rank`` threads on ``cores`` cores, and the
    fitted wait for the slowest rank of a group per synchronising call (seconds, and
    seconds per second of compute since the group's previous synchronisation)."""

    ranks: int
    cores: int
    threads_per_rank: int = 1
    sync_wait_s: float = 0.0
    sync_wait_per_compute: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        problems = []
        for key in ("ranks", "cores", "threads_per_rank"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{key}={value!r} must be a whole number >= 1")
        for key in ("sync_wait_s", "sync_wait_per_compute"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                problems.append(f"{key}={value!r} must be a finite number >= 0")
        if problems:
            raise ValueError("HostModel: " + "; ".join(problems))

    @property
    def oversubscribed(self) -> bool:
        """More runnable threads than cores: the ranks are time-sliced."""
        return self.ranks * self.threads_per_rank > self.cores

    @property
    def spare_cores(self) -> int:
        return max(self.cores - self.ranks * self.threads_per_rank, 0)

    def wait_s(self, size: int, segment_s: float) -> float:
        """The wait for the slowest of ``size`` ranks at one synchronising call, after
        ``segment_s`` seconds of compute since the group last synchronised."""
        if size <= 1:
            return 0.0
        return self.sync_wait_s + self.sync_wait_per_compute * max(segment_s, 0.0)
