"""Errors raised by plait's communication layer."""

from __future__ import annotations


class CommError(RuntimeError):
    """A collective failed on this rank: names the rank, collective, algorithm,
    step and peer involved, and the transport's own message."""

    def __init__(self, *, rank: int, collective: str, algorithm: str, step, peer, reason: str):
        self.rank = rank
        self.collective = collective
        self.algorithm = algorithm
        self.step = step
        self.peer = peer
        self.reason = reason
        super().__init__(self._message())

    def _message(self) -> str:
        return (
            f"rank {self.rank}: {self.collective} (algorithm={self.algorithm}) failed at step {self.step} "
            f"with peer {self.peer}: {self.reason}"
        )


class CommTimeoutError(CommError, TimeoutError):
    """A peer did not send or receive in time (it died, hung, or never called the
    collective)."""

    def __init__(self, *, timeout_s: float, **kwargs):
        self.timeout_s = timeout_s
        super().__init__(**kwargs)

    def _message(self) -> str:
        return (
            f"rank {self.rank}: {self.collective} (algorithm={self.algorithm}) timed out after "
            f"{self.timeout_s:g}s at step {self.step} waiting for peer {self.peer} ({self.reason}); "
            "check that every rank calls the same collectives in the same order and that no rank "
            "has died; raise the limit with the group's CommConfig(timeout_s=...) "
            "(plait.comm.init_communicator) or, from the plait CLI, plait train --timeout-s or "
            "PLAIT_COMM_TIMEOUT_S for the other commands"
        )


class MismatchError(ValueError):
    """Ranks called a collective with different sizes, dtypes, ops, roots or
    algorithms, or issued their calls on a group in different orders.
    ``before_any_message``: raised by every rank before sending (the "deep" check),
    so the group is still usable."""

    def __init__(self, message: str, *, before_any_message: bool = False):
        self.before_any_message = before_any_message
        super().__init__(message)
