"""The fitted model of one transport (shared memory or gloo) on one host: copy bandwidth
that depends on the message size, and the software cost of each kind of call.

A step of ``n`` bytes costs

    alpha + n * beta(n) + r * n * gamma,
    beta(n) = beta_cache + (beta_dram - beta_cache) * n / (L + n),

so a message well inside the caches (n << L) moves at the cache's copy bandwidth
1/beta_cache and one far beyond them (n >> L) at memory's 1/beta_dram, with L (the
bytes where the two mix half and half, ``cache_bytes``) fitted: the per-rank share of
the last-level cache the transport's copies run through. The mixture n / (L + n) is
the fraction of a message's bytes that miss a cache of L bytes when the message is
touched once in a stream (for n = L half of it fits).

A call of kind K (all_reduce, all_gather, reduce_scatter, broadcast, ..., or ``p2p``:
one isend/irecv exchange of a pipeline) costs its own software time on top of its
messages:

    T_K(n) = call_s[K] + work(schedule of K, priced with the link at beta(n)),

``call_s[K]`` being the Python of plait's call path (argument check, the comm
thread's hand-off, the in-band header, the output copy) measured on real calls at
sizes below any benchmarked one (``plait.cost.calibration.fit_call_costs``).
``base_call_s`` is the bare executor's per-call cost the ring-shift samples show. A
p2p exchange runs no executor step, so it pays no alpha: T_p2p(n) = call_s[p2p] +
n beta(n), its fixed cost (latency and software) measured on real exchanges.
Pure python: priced anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from plait.cost.link import LinkModel

__all__ = ["TransportModel", "P2P_KIND"]

# the per-call cost key of one point-to-point exchange (isend + irecv + waits)
P2P_KIND = "p2p"


def _finite_nonnegative(value) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and value >= 0)


@dataclass(frozen=True, kw_only=True)
class TransportModel:
    """alpha, beta(n) with a cache knee, gamma, and the per-call cost of each call kind."""

    alpha_s: float
    beta_cache_s_per_byte: float
    beta_dram_s_per_byte: float
    cache_bytes: float
    gamma_s_per_byte: float
    base_call_s: float
    call_s: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "call_s", {str(k): float(v) if _finite_nonnegative(v) else v
                                            for k, v in dict(self.call_s).items()})
        problems = [f"{name}={getattr(self, name)!r} must be a finite number >= 0"
                    for name in ("alpha_s", "beta_cache_s_per_byte", "beta_dram_s_per_byte", "gamma_s_per_byte",
                                 "base_call_s")
                    if not _finite_nonnegative(getattr(self, name))]
        if not _finite_nonnegative(self.cache_bytes) or self.cache_bytes <= 0:
            problems.append(f"cache_bytes={self.cache_bytes!r} must be a finite number > 0")
        if not problems and self.beta_cache_s_per_byte + self.beta_dram_s_per_byte <= 0:
            problems.append("beta_cache_s_per_byte and beta_dram_s_per_byte are both 0 (no cost per byte)")
        problems += [f"call_s[{k!r}]={v!r} must be a finite number >= 0" for k, v in self.call_s.items()
                     if not _finite_nonnegative(v)]
        if problems:
            raise ValueError("invalid transport model: " + "; ".join(problems) + " (re-run plait calibrate)")

    def beta_s_per_byte(self, nbytes: float) -> float:
        """beta(n) = beta_cache + (beta_dram - beta_cache) n / (L + n)."""
        n = max(0.0, float(nbytes))
        return self.beta_cache_s_per_byte + (self.beta_dram_s_per_byte - self.beta_cache_s_per_byte) \
            * n / (self.cache_bytes + n)

    def link_at(self, nbytes: float) -> LinkModel:
        """The alpha-beta-gamma link of a call on ``nbytes`` (beta at that size), to price
        its schedule with the closed forms or the shared-host model."""
        return LinkModel(self.alpha_s, max(self.beta_s_per_byte(nbytes), 1e-30), self.gamma_s_per_byte)

    def step_time_s(self, nbytes: float, reduce: bool = False) -> float:
        """alpha + n beta(n) + r n gamma: one ring-shift step of ``nbytes``."""
        return self.alpha_s + nbytes * self.beta_s_per_byte(nbytes) + float(reduce) * nbytes * self.gamma_s_per_byte

    def call_overhead_s(self, kind: str) -> float:
        """call_s[kind]; a kind never measured gets the mean of the collectives measured
        (without p2p), or the bare executor's base_call_s when none was."""
        if kind in self.call_s:
            return self.call_s[kind]
        collectives = [v for k, v in self.call_s.items() if k != P2P_KIND]
        return sum(collectives) / len(collectives) if collectives else self.base_call_s

    def mean_collective_call_s(self) -> float:
        """The mean per-call cost over the collective kinds measured (base_call_s without)."""
        return self.call_overhead_s("")

    def p2p_time_s(self, nbytes: float) -> float:
        """One pipeline exchange: call_s[p2p] + n beta(n). Its fixed cost (latency and
        software) is all in call_s[p2p], measured on real exchanges: alpha is the
        executor's per-step cost, which a p2p message does not pay."""
        return self.call_overhead_s(P2P_KIND) + nbytes * self.beta_s_per_byte(nbytes)

    def as_dict(self) -> dict:
        return {"alpha_s": self.alpha_s, "beta_cache_s_per_byte": self.beta_cache_s_per_byte,
                "beta_dram_s_per_byte": self.beta_dram_s_per_byte, "cache_bytes": self.cache_bytes,
                "gamma_s_per_byte": self.gamma_s_per_byte, "base_call_s": self.base_call_s,
                "call_s": dict(self.call_s)}

    @classmethod
    def from_dict(cls, node: dict) -> "TransportModel":
        """The inverse of as_dict; ValueError naming a missing or bad field."""
        if not isinstance(node, dict):
            raise ValueError(f"transport_model must be a JSON object, got {type(node).__name__}")
        names = ("alpha_s", "beta_cache_s_per_byte", "beta_dram_s_per_byte", "cache_bytes", "gamma_s_per_byte",
                 "base_call_s")
        missing = [name for name in names + ("call_s",) if name not in node]
        if missing:
            raise ValueError(f"transport_model lacks {', '.join(missing)}")
        if not isinstance(node["call_s"], dict):
            raise ValueError(f"transport_model.call_s must be an object of seconds per call kind, got {node['call_s']!r}")
        return cls(**{name: node[name] for name in names}, call_s=node["call_s"])

    def describe(self) -> str:
        calls = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in sorted(self.call_s.items()))
        return (f"alpha {self.alpha_s * 1e6:.1f} us, copy {_gbps(self.beta_cache_s_per_byte)} GB/s in cache -> "
                f"{_gbps(self.beta_dram_s_per_byte)} GB/s beyond L = {self.cache_bytes / 1024:.0f} KiB, reduce "
                f"{_gbps(self.gamma_s_per_byte)} GB/s; per call (us): {calls or f'{self.base_call_s * 1e6:.0f}'}")


def _gbps(s_per_byte: float) -> str:
    return "inf" if s_per_byte <= 0 else f"{1e-9 / s_per_byte:.3g}"
