"""Pipeline schedules as data: for every rank, the ordered list of actions.

A schedule is built in two steps. A generator (``gpipe``, ``one_f_one_b``,
``interleaved_1f1b``, ``chimera``) gives each rank its compute order, forwards
``F`` and backwards ``B`` of micro-batch m on model chunk (stage) s; then
``_with_communication`` inserts the point-to-point traffic that order implies:
``RECV_ACT`` right before a forward whose input lives on another rank, ``SEND_ACT``
right after a forward whose output is needed elsewhere, and ``RECV_GRAD`` /
``SEND_GRAD`` likewise for backwards. Chimera ends with ``ALL_REDUCE`` (its two
weight replicas); every schedule ends with ``STEP`` (the optimiser, after the flush).

Semantics, shared by the unit-cost replay (``plait.parallel.pipeline.replay``)
and the real engine: sends never block (they are queued), a receive blocks until
the matching send has been posted, compute runs in list order.

Placement: a *pipeline* maps stage -> rank. GPipe and 1F1B have S = p stages,
stage s on rank s; interleaved 1F1B has S = v·p chunks, chunk s on rank s mod p;
Chimera has two pipelines over the same S = p stages, "down" (stage s on rank s)
and "up" (stage s on rank p-1-s), micro-batches split evenly between them, so each
rank holds two stages (replicas of stage s and p-1-s).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.names.schedules import CHIMERA, GPIPE, INTERLEAVED_1F1B, ONE_F_ONE_B, ZERO_BUBBLE
from plait.parallel.pipeline.actions import (
    ALL_REDUCE,
    BACKWARD,
    COMPUTE,
    FORWARD,
    MESSAGES,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    WEIGHT,
    Action,
    ActionKind,
    ScheduleError,
    compute_cost,
)


@dataclass(frozen=True)
class PipelineSchedule:
    """Per-rank action lists plus the placement they assume (see module docstring)."""

    name: str
    ranks: int
    microbatches: int
    stages: int  # model chunks S
    pipelines: tuple[tuple[int, ...], ...]  # pipeline k: stage -> rank
    microbatch_pipeline: tuple[int, ...]  # micro-batch -> pipeline k
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    split_backward: bool = False  # B computes input gradients only, W the weight gradients (zero bubble)

    def rank_of(self, microbatch: int, stage: int) -> int:
        return self.pipelines[self.microbatch_pipeline[microbatch]][stage]

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """(pipeline, stage) pairs this rank holds, in chunk order."""
        return [(k, s) for k, pipeline in enumerate(self.pipelines) for s, r in enumerate(pipeline) if r == rank]

    def chunk_of(self, rank: int, microbatch: int, stage: int) -> int:
        return self.stages_of(rank).index((self.microbatch_pipeline[microbatch], stage))

    def text(self) -> list[str]:
        """One line per rank: its actions in compact display form (``Action.label``;
        compute only with chunks)."""
        lines = []
        for rank, actions in enumerate(self.actions):
            many = len(self.stages_of(rank)) > 1
            words = [a.label(self.chunk_of(rank, a.microbatch, a.stage) if many and a.kind in COMPUTE else None)
                     for a in actions]
            lines.append(f"rank {rank}: " + " ".join(words))
        return lines

    def compute_order(self, rank: int) -> list[Action]:
        return [action for action in self.actions[rank] if action.kind in COMPUTE]


# ----- generators: per-rank compute orders -----------------------------------------------
def _check_sizes(name: str, ranks: int, microbatches: int) -> None:
    for what, value in (("ranks (pipeline stages p)", ranks), ("microbatches (m)", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {what} must be an int >= 1, got {value!r}")


def _single(name, ranks, microbatches, stages, orders, pipelines=None, microbatch_pipeline=None,
            all_reduce=False, split_backward=False) -> PipelineSchedule:
    pipelines = pipelines or (tuple(s % ranks for s in range(stages)),)
    microbatch_pipeline = microbatch_pipeline or (0,) * microbatches
    bare = PipelineSchedule(name=name, ranks=ranks, microbatches=microbatches, stages=stages,
                            pipelines=tuple(pipelines), microbatch_pipeline=tuple(microbatch_pipeline),
                            actions=tuple(tuple(order) for order in orders), split_backward=split_backward)
    return _with_communication(bare, all_reduce)


def gpipe(ranks: int, microbatches: int) -> PipelineSchedule:
    """GPipe: every forward, then every backward (flush). Bubble (p-1)/(m+p-1) of the
    step; all m micro-batches' activations are alive at once on every stage."""
    _check_sizes(GPIPE, ranks, microbatches)
    orders = [[Action(FORWARD, m, r) for m in range(microbatches)] + [Action(BACKWARD, m, r)
              for m in range(microbatches)] for r in range(ranks)]
    return _single(GPIPE, ranks, microbatches, ranks, orders)


def one_f_one_b(ranks: int, microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-Flush): stage r runs min(p-r-1, m) warm-up forwards, then
    alternates one forward and one backward, then drains. Same bubble as GPipe,
    (p-1)/(m+p-1), but at most p - r micro-batches in flight on stage r."""
    _check_sizes(ONE_F_ONE_B, ranks, microbatches)
    orders = []
    for r in range(ranks):
        warmup = min(ranks - r - 1, microbatches)
        order = [Action(FORWARD, m, r) for m in range(warmup)]
        for i in range(microbatches - warmup):
            order += [Action(FORWARD, warmup + i, r), Action(BACKWARD, i, r)]
        order += [Action(BACKWARD, m, r) for m in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return _single(ONE_F_ONE_B, ranks, microbatches, ranks, orders)


def interleaved_1f1b(ranks: int, microbatches: int, virtual: int) -> PipelineSchedule:
    """Megatron-LM's interleaved 1F1B: each rank holds v chunks (chunk c of rank r is
    stage c·p + r) and walks micro-batches in groups of p through its chunks. The
    bubble time shrinks v-fold, to (p-1)/v of a full (forward + backward) stage
    time, for ~(1 + (p-1)/(p·v)) times the in-flight activations. Needs m a multiple of p."""
    _check_sizes(INTERLEAVED_1F1B, ranks, microbatches)
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 2:
        raise ValueError(f"interleaved_1f1b: virtual stages per rank (v) must be an int >= 2, got {virtual!r} "
                         "(with one chunk per rank, use 1f1b)")
    if microbatches % ranks:
        raise ValueError(f"interleaved_1f1b needs microbatches (m={microbatches}) to be a multiple of the pipeline "
                         f"ranks (p={ranks}): use m = {ranks * max(1, round(microbatches / ranks))}")
    p, v, m = ranks, virtual, microbatches
    units = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:  # k-th unit -> (micro-batch, chunk)
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk

    orders = []
    for r in range(p):
        # Megatron: with m == p there is no steady phase; every forward goes first
        warmup = units if m == p else min(units, (p - r - 1) * 2 + (v - 1) * p)
        order = []
        for k in range(warmup):
            mb, chunk = unit(k, True)
            order.append(Action(FORWARD, mb, chunk * p + r))
        for i in range(units - warmup):
            mb, chunk = unit(warmup + i, True)
            order.append(Action(FORWARD, mb, chunk * p + r))
            mb, chunk = unit(i, False)
            order.append(Action(BACKWARD, mb, chunk * p + r))
        for k in range(units - warmup, units):
            mb, chunk = unit(k, False)
            order.append(Action(BACKWARD, mb, chunk * p + r))
        orders.append(order)
    return _single(INTERLEAVED_1F1B, p, m, p * v, orders)


def chimera(ranks: int, microbatches: int) -> PipelineSchedule:
    """Chimera (Li & Hoefler 2021): two pipelines in opposite directions over the same
    p stages ("down": stage s on rank s; "up": stage s on rank p-1-s), half the
    micro-batches each, so each rank holds two stage replicas, whose gradients are
    all-reduced after the flush. Micro-batches alternate between the pipelines.
    Compute order: list scheduling on the unit-cost replay (a free rank runs what can
    start earliest; ties go to backward-first, or to forward-first, whichever of the
    two gives the shorter step, backward-first on a tie for its smaller memory).
    Its bubble meets the paper's (p-2)/(2m+p-2) at m >= 2p in most cases and is a
    unit or a few longer at m = p (see the tests and README). Needs p even and m even."""
    _check_sizes(CHIMERA, ranks, microbatches)
    if ranks % 2:
        raise ValueError(f"chimera needs an even number of pipeline ranks (p={ranks}): its two opposite pipelines "
                         f"pair stage s with stage p-1-s; use p = {ranks + 1}" + (f" or {ranks - 1}" if ranks > 1 else ""))
    if microbatches % 2:
        raise ValueError(f"chimera needs an even number of microbatches (m={microbatches}): half go down, half up; "
                         f"use m = {microbatches + 1}")
    p, m = ranks, microbatches
    pipelines = (tuple(range(p)), tuple(reversed(range(p))))
    microbatch_pipeline = tuple(mb % 2 for mb in range(m))
    candidates = [list_schedule(p, m, p, pipelines, microbatch_pipeline, prefer_forward=prefer)
                  for prefer in (False, True)]
    _, orders = min(candidates, key=lambda candidate: candidate[0])  # min keeps the first on a tie
    return _single(CHIMERA, p, m, p, orders, pipelines, microbatch_pipeline, all_reduce=True)


def zero_bubble(ranks: int, microbatches: int) -> PipelineSchedule:
    """Zero-bubble pipelining in the manner of ZB-H1 (Qi et al. 2023): the backward is
    split into B (input gradient, on the critical path) and W (weight gradient,
    needed only by the optimiser step), and W is deferred into what would be
    bubbles. With F = B = W the idle time per rank drops from 1F1B's (p-1)(F+B+W) to
    ZB-H1's (p-1)·F: a bubble of (p-1)/(3m+p-1). Compute order: list scheduling on the
    replay (a free rank runs a ready B, else a forward, else its oldest W) with at
    most 2p-r-1 micro-batches between forward and W on rank r; that is the smallest
    such cap the greedy order needs to reach ZB-H1's bubble, more than the p of
    ZB-H1's hand-built order (see the tests)."""
    _check_sizes(ZERO_BUBBLE, ranks, microbatches)
    pipelines = (tuple(range(ranks)),)
    _, orders = list_schedule(ranks, microbatches, ranks, pipelines, (0,) * microbatches, split_backward=True,
                              in_flight_limits=[2 * ranks - r - 1 for r in range(ranks)])
    return _single(ZERO_BUBBLE, ranks, microbatches, ranks, orders, pipelines, split_backward=True)


# ----- list scheduling (Chimera's and zero bubble's compute orders) -------------------------
def list_schedule(ranks: int, microbatches: int, stages: int, pipelines, microbatch_pipeline, *,
                  prefer_forward: bool = False, split_backward: bool = False, in_flight_limits=None,
                  forward: float = 1.0, backward: float = 2.0) -> tuple[float, list[list[Action]]]:
    """Greedy list scheduling with unit costs: repeatedly, the computation that can
    start earliest runs (lowest rank on a tie); among a rank's computations ready at
    that time, a backward goes first (or a forward, with ``prefer_forward``), then the
    oldest micro-batch. With ``split_backward`` each backward is B then W (half the
    cost each); W has the lowest priority (it fills idle time) and a forward waits
    while the rank has ``in_flight_limits[rank]`` micro-batches whose W has not run.
    Returns (makespan, each rank's compute order)."""
    rank_of = [[pipelines[microbatch_pipeline[mb]][s] for s in range(stages)] for mb in range(microbatches)]
    done: dict[tuple, float] = {}  # (kind, mb, stage) -> finish time
    free = [0.0] * ranks
    in_flight = [0] * ranks
    orders: list[list[Action]] = [[] for _ in range(ranks)]
    last = stages - 1
    total = (3 if split_backward else 2) * microbatches * stages
    while len(done) < total:
        best = None  # (start time, priority, rank, action)
        for rank in range(ranks):
            candidates = []
            for mb in range(microbatches):
                for s in range(stages):
                    if rank_of[mb][s] != rank:
                        continue
                    if (FORWARD, mb, s) not in done:
                        if s > 0 and (FORWARD, mb, s - 1) not in done:
                            continue
                        if in_flight_limits is not None and in_flight[rank] >= in_flight_limits[rank]:
                            continue
                        ready = done.get((FORWARD, mb, s - 1), 0.0) if s > 0 else 0.0
                        candidates.append((max(free[rank], ready), 0 if prefer_forward else 1, mb,
                                           Action(FORWARD, mb, s)))
                    elif (BACKWARD, mb, s) not in done:
                        need = (BACKWARD, mb, s + 1) if s < last else (FORWARD, mb, s)
                        if need not in done:
                            continue
                        candidates.append((max(free[rank], done[need]), 1 if prefer_forward else 0, mb,
                                           Action(BACKWARD, mb, s)))
                    elif split_backward and (WEIGHT, mb, s) not in done:
                        candidates.append((max(free[rank], done[(BACKWARD, mb, s)]), 2, mb, Action(WEIGHT, mb, s)))
            if candidates:
                start = min(c[0] for c in candidates)
                # among what can start at the earliest time: by priority, then oldest micro-batch
                choice = min((c for c in candidates if c[0] == start), key=lambda c: (c[1], c[2]))
                if best is None or (choice[0], rank) < (best[0], best[2]):
                    best = (choice[0], choice[1], rank, choice[3])
        if best is None:
            raise ScheduleError("list scheduling is stuck: an in-flight limit below 1 leaves nothing runnable")
        start, _, rank, action = best
        end = start + compute_cost(action.kind, forward, backward, split=split_backward)
        done[(action.kind, action.microbatch, action.stage)] = end
        free[rank] = end
        if action.kind == FORWARD:
            in_flight[rank] += 1
        elif action.kind == (WEIGHT if split_backward else BACKWARD):
            in_flight[rank] -= 1
        orders[rank].append(action)
    return max(done.values()), orders


SCHEDULES = {GPIPE: gpipe, ONE_F_ONE_B: one_f_one_b, INTERLEAVED_1F1B: interleaved_1f1b, CHIMERA: chimera,
             ZERO_BUBBLE: zero_bubble}
LIST_SCHEDULED = (CHIMERA, ZERO_BUBBLE)  # built by list_schedule: time grows as O(p^3 m^2)


def build(name: str, ranks: int, microbatches: int, virtual: int | None = None) -> PipelineSchedule:
    """The named schedule (``virtual``, v >= 2, only for interleaved_1f1b; default 2)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == INTERLEAVED_1F1B:
        return interleaved_1f1b(ranks, microbatches, 2 if virtual is None else virtual)
    if virtual not in (None, 1):
        raise ValueError(f"virtual={virtual} applies to interleaved_1f1b only, not {name}")
    return SCHEDULES[name](ranks, microbatches)


# ----- communication implied by the compute order ----------------------------------------
def _with_communication(schedule: PipelineSchedule, all_reduce: bool) -> PipelineSchedule:
    last = schedule.stages - 1
    actions = []
    for rank, order in enumerate(schedule.actions):
        out = []
        for action in order:
            mb, s = action.microbatch, action.stage
            if action.kind == FORWARD:
                if s > 0 and (peer := schedule.rank_of(mb, s - 1)) != rank:
                    out.append(Action(RECV_ACT, mb, s - 1, peer))
                out.append(action)
                if s < last and (peer := schedule.rank_of(mb, s + 1)) != rank:
                    out.append(Action(SEND_ACT, mb, s, peer))
            elif action.kind == BACKWARD:
                if s < last and (peer := schedule.rank_of(mb, s + 1)) != rank:
                    out.append(Action(RECV_GRAD, mb, s + 1, peer))
                out.append(action)
                if s > 0 and (peer := schedule.rank_of(mb, s - 1)) != rank:
                    out.append(Action(SEND_GRAD, mb, s, peer))
            else:  # W: local, no messages
                out.append(action)
        if all_reduce:
            out.append(Action(ALL_REDUCE))
        out.append(Action(STEP))
        actions.append(tuple(out))
    return PipelineSchedule(name=schedule.name, ranks=schedule.ranks, microbatches=schedule.microbatches,
                            stages=schedule.stages, pipelines=schedule.pipelines,
                            microbatch_pipeline=schedule.microbatch_pipeline, actions=tuple(actions),
                            split_backward=schedule.split_backward)


def backward_next(actions) -> set[int]:
    """Positions of forwards whose own backward is this rank's next computation (the
    last stage's, in 1F1B): nothing to gain from offloading those (plait.memory.offload)."""
    computing = [position for position, action in enumerate(actions) if action.kind in (FORWARD, BACKWARD, WEIGHT)]
    return {here for here, following in zip(computing, computing[1:])
            if actions[here].kind == FORWARD and actions[following].kind == BACKWARD
            and (actions[following].microbatch, actions[following].stage) == (actions[here].microbatch,
                                                                            actions[here].stage)}


def next_backward(actions) -> list:
    """Per position, the (micro-batch, stage) of the first backward at or after the
    next action (what to read back while this one runs), None past the last."""
    upcoming, found = [None] * len(actions), None
    for position in range(len(actions) - 1, -1, -1):
        upcoming[position] = found
        if actions[position].kind == BACKWARD:
            found = (actions[position].microbatch, actions[position].stage)
    return upcoming
