"""The alpha-beta-gamma link model: the price of one message and of one reduction.

A message of ``nbytes`` between two ranks costs ``alpha_s + nbytes * beta_s_per_byte``
(latency plus transfer); combining ``nbytes`` that arrived with what a rank holds
costs ``nbytes * gamma_s_per_byte``. Every closed form in ``plait.cost.alpha_beta``
and every schedule-derived cost is a sum of these three terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LinkModel", "CostTerms"]


def _check_number(name: str, value: float, *, positive: bool) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}={value!r} is not a number"
    if not math.isfinite(value):
        return f"{name}={value!r} is not finite"
    if positive and value <= 0:
        return f"{name}={value!r} must be > 0"
    if value < 0:
        return f"{name}={value!r} must be >= 0"
    return None


@dataclass(frozen=True, kw_only=False)
class LinkModel:
    """alpha (s per message), beta (s per byte sent), gamma (s per byte reduced).

    beta must be > 0 (a link with zero bandwidth never delivers); alpha and gamma
    may be 0.
    """

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        problems = [
            _check_number("alpha_s", self.alpha_s, positive=False),
            _check_number("beta_s_per_byte", self.beta_s_per_byte, positive=True),
            _check_number("gamma_s_per_byte", self.gamma_s_per_byte, positive=False),
        ]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError(
                "invalid link model: " + "; ".join(problems)
                + " (alpha is a latency in seconds, beta = 1 / bandwidth in s/byte, "
                "gamma = 1 / reduction throughput in s/byte)"
            )

    @classmethod
    def from_bandwidth(
        cls,
        latency_s: float,
        bandwidth_bytes_per_s: float,
        reduce_bytes_per_s: float | None = None,
    ) -> "LinkModel":
        """A link from its latency and bandwidth (bytes/s); no reduction cost when
        ``reduce_bytes_per_s`` is None."""
        for name, value in (("bandwidth_bytes_per_s", bandwidth_bytes_per_s),
                            ("reduce_bytes_per_s", reduce_bytes_per_s)):
            if value is None:
                continue
            problem = _check_number(name, value, positive=True)
            if problem:
                raise ValueError(f"invalid link: {problem}; give a positive bandwidth in bytes/s")
        gamma = 0.0 if reduce_bytes_per_s is None else 1.0 / reduce_bytes_per_s
        return cls(latency_s, 1.0 / bandwidth_bytes_per_s, gamma)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte

    def message_time_s(self, nbytes: float) -> float:
        """alpha + nbytes * beta."""
        return self.alpha_s + nbytes * self.beta_s_per_byte

    def as_dict(self) -> dict:
        return {"alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte,
                "gamma_s_per_byte": self.gamma_s_per_byte}


@dataclass(frozen=True)
class CostTerms:
    """A cost as its three counts: T = rounds * alpha + beta_bytes * beta + gamma_bytes * gamma.

    ``rounds`` are sequential message rounds on the critical path, ``beta_bytes`` the
    bytes the busiest port moves along it, ``gamma_bytes`` the bytes the busiest rank
    reduces along it.
    """

    rounds: float
    beta_bytes: float
    gamma_bytes: float

    def time_s(self, link: LinkModel) -> float:
        return (self.rounds * link.alpha_s + self.beta_bytes * link.beta_s_per_byte
                + self.gamma_bytes * link.gamma_s_per_byte)

    def __add__(self, other: "CostTerms") -> "CostTerms":
        return CostTerms(self.rounds + other.rounds, self.beta_bytes + other.beta_bytes,
                         self.gamma_bytes + other.gamma_bytes)

    def scaled(self, factor: float) -> "CostTerms":
        return CostTerms(self.rounds * factor, self.beta_bytes * factor, self.gamma_bytes * factor)
