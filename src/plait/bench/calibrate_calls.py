"""Calibration's "call" samples: real plait calls, to fit each call kind's software cost.

The ring shift (``plait.bench.calibrate``) runs a schedule on the executor directly,
so its per-call cost c is the bare executor's. A user's collective pays more: the
argument check (in-band header), the hand-off to the group's comm thread and back,
the output's copy, and a p2p exchange its own two messages' bookkeeping. Those are
software, not bytes, so they are measured where bytes cost nothing: one real call of
each kind on sizes below any benchmarked one (default 64 B and 256 B), through a
communicator configured as users run it (CommConfig's defaults: in-band check), on
the transport being calibrated. Each sample records the terms (rounds, beta bytes,
gamma bytes) the predictions price the call's messages with, the shared-host terms of
its schedule on CPU (``plait.cost.alpha_beta.shared_host_terms``) or the one-port
ones on a GPU, so ``plait.cost.calibration.fit_call_costs`` can take them off:

    call_s[K] = weighted mean over K's samples of (t - terms . (alpha, beta(n), gamma)).

Kinds: all_reduce, all_gather, reduce_scatter, broadcast (algorithm "direct": one
round at these sizes, every p), and "p2p": every rank isends n bytes to rank+1 and
irecvs n from rank-1 through the group's communicator, then waits both (a pipeline's
steady state), priced as its bytes n beta(n) (p messages over p sharing ranks on CPU)
plus its own fixed cost call_s[p2p], latency included (no executor step, so no alpha).
"""

from __future__ import annotations

from typing import Callable

import torch

import plait.comm as comm
from plait.comm.algorithms import build_schedule
from plait.comm.communicator import Communicator
from plait.cost.alpha_beta import pipeline_segments, schedule_terms, shared_host_terms
from plait.cost.transport_model import P2P_KIND

__all__ = ["CALL_KINDS", "CALL_ALGORITHM", "call_terms", "make_call"]

CALL_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", P2P_KIND)
CALL_ALGORITHM = "direct"
_CHUNKED = ("all_gather", "reduce_scatter")
_P2P_TAG = 11
ELEMENT_SIZE = 4  # float32


def call_numel(kind: str, nbytes: int, world_size: int) -> int:
    """Elements of the call's tensor (as plait bench sizes it: the p-chunk buffer of the
    chunked collectives, whole chunks), at least one element (chunk)."""
    if kind in _CHUNKED:
        return max(1, nbytes // (ELEMENT_SIZE * world_size)) * world_size
    return max(1, nbytes // ELEMENT_SIZE)


def call_terms(kind: str, numel: int, world_size: int, shared_host: bool) -> tuple[float, float, float]:
    """(rounds, beta bytes, gamma bytes) the predictions price one such call's messages
    with: its schedule's shared-host terms (CPU, ranks sharing the host) or one-port
    terms; p2p: the tensor's bytes and no alpha (alpha is the executor's per-step
    latency, which a p2p exchange does not run: its fixed cost is all call_s[p2p])."""
    nbytes = numel * ELEMENT_SIZE
    if kind == P2P_KIND:  # no executor step: its whole fixed cost is the fitted call_s[p2p]
        return 0.0, float(nbytes), 0.0
    root = 0 if kind == "broadcast" else None
    schedule = build_schedule(kind, CALL_ALGORITHM, world_size, numel, root, pipeline_segments(nbytes))
    terms = (shared_host_terms(schedule, ELEMENT_SIZE, world_size) if shared_host
             else schedule_terms(schedule, ELEMENT_SIZE))
    return terms.rounds, terms.beta_bytes, terms.gamma_bytes


def make_call(kind: str, numel: int, communicator: Communicator, device: torch.device) -> Callable[[], None]:
    """A no-argument closure making one real call of ``kind`` on ``numel`` elements."""
    size, rank = communicator.size, communicator.rank
    tensor = torch.zeros(numel, dtype=torch.float32, device=device)  # zeros: sums never overflow
    if kind == "all_reduce":
        return lambda: comm.all_reduce(tensor, group=communicator, algorithm=CALL_ALGORITHM)
    if kind == "broadcast":
        return lambda: comm.broadcast(tensor, group=communicator, group_src=0, algorithm=CALL_ALGORITHM)
    if kind == "all_gather":
        chunk = torch.zeros(numel // size, dtype=torch.float32, device=device)
        return lambda: comm.all_gather_single(tensor, chunk, group=communicator, algorithm=CALL_ALGORITHM)
    if kind == "reduce_scatter":
        chunk = torch.zeros(numel // size, dtype=torch.float32, device=device)
        return lambda: comm.reduce_scatter_single(chunk, tensor, group=communicator, algorithm=CALL_ALGORITHM)
    if kind == P2P_KIND:
        received = torch.zeros(numel, dtype=torch.float32, device=device)
        after, before = (rank + 1) % size, (rank - 1) % size

        def exchange() -> None:
            outgoing = comm.isend(tensor, group=communicator, group_dst=after, tag=_P2P_TAG, label="calibrate p2p")
            incoming = comm.irecv(received, group=communicator, group_src=before, tag=_P2P_TAG,
                                  label="calibrate p2p")
            incoming.wait()
            outgoing.wait()

        return exchange
    raise ValueError(f"unknown call kind {kind!r}; valid: {', '.join(CALL_KINDS)}")
