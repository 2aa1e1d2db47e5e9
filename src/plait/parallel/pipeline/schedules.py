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

import re
from dataclasses import dataclass, field
from enum import Enum


class ActionKind(str, Enum):
    """What an action does. A str enum: ``ActionKind.FORWARD == "F"``, and it prints and
    serialises (JSON timelines) as its value."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"  # the weight-gradient half of a split backward
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    ALL_REDUCE = "ALL_REDUCE"
    STEP = "STEP"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{kind}" gives the value, as str() does


FORWARD, BACKWARD, WEIGHT = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD
ALL_REDUCE, STEP = ActionKind.ALL_REDUCE, ActionKind.STEP
COMPUTE = (FORWARD, BACKWARD, WEIGHT)
MESSAGES = (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)
_SHORT = {SEND_ACT: "sa", RECV_ACT: "ra", SEND_GRAD: "sg", RECV_GRAD: "rg"}
_LONG = {short: kind for kind, short in _SHORT.items()}
_FIELDS = {kind: ("microbatch", "stage") for kind in COMPUTE}
_FIELDS.update({kind: ("microbatch", "stage", "peer") for kind in MESSAGES})
_FIELDS.update({ALL_REDUCE: (), STEP: ()})
_PATTERN = re.compile(r"(?P<kind>[FBW]|sa|ra|sg|rg)(?P<mb>\d+)@(?P<stage>\d+)(?:(?P<arrow>[<>])(?P<peer>\d+))?$")


@dataclass(frozen=True)
class Action:
    """One thing a rank does: ``kind`` on micro-batch ``microbatch`` at stage
    ``stage``; ``peer`` is the other rank of a send or receive. A message is named by
    the stage that produced it: SEND_ACT/RECV_ACT carry the stage whose forward made
    the activation, SEND_GRAD/RECV_GRAD the stage whose backward made the gradient.
    Fields a kind has no use for are None (ALL_REDUCE and STEP have none; a
    computation has no peer)."""

    kind: ActionKind
    microbatch: int | None = None
    stage: int | None = None
    peer: int | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", ActionKind(self.kind))
        except ValueError:
            raise ValueError(f"unknown action kind {self.kind!r}; one of {[k.value for k in ActionKind]}") from None
        wanted = _FIELDS[self.kind]
        for name in ("microbatch", "stage", "peer"):
            value = getattr(self, name)
            if name in wanted and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"a {self.kind.name} action needs {name} as an int >= 0, got {value!r}")
            if name not in wanted and value is not None:
                raise ValueError(f"a {self.kind.name} action has no {name}: leave it None, got {value!r}")

    def text(self) -> str:
        """Lossless form, read back by ``parse``: F3@2 (forward of micro-batch 3 at stage
        2), B3@2, W3@2, sa3@2>1 / ra3@2<0 (send/receive the activation of micro-batch 3
        made by stage 2 to/from rank 1/0), sg, rg likewise, AR, STEP."""
        if self.kind in COMPUTE:
            return f"{self.kind.value}{self.microbatch}@{self.stage}"
        if self.kind in _SHORT:
            arrow = ">" if self.kind in (SEND_ACT, SEND_GRAD) else "<"
            return f"{_SHORT[self.kind]}{self.microbatch}@{self.stage}{arrow}{self.peer}"
        return "AR" if self.kind == ALL_REDUCE else "STEP"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action ``text()`` wrote."""
        if text in ("AR", "STEP"):
            return cls(ALL_REDUCE if text == "AR" else STEP)
        match = _PATTERN.match(text)
        if match is None or (match["kind"] in _LONG) != (match["peer"] is not None) or (
                match["kind"] in _LONG and (match["arrow"] == ">") != match["kind"].startswith("s")):
            raise ValueError(f"cannot read pipeline action {text!r}: expected e.g. F3@2, B3@2, W3@2, sa3@2>1, "
                             "ra3@2<0, sg3@2>1, rg3@2<0, AR or STEP")
        kind = _LONG.get(match["kind"]) or ActionKind(match["kind"])
        peer = None if match["peer"] is None else int(match["peer"])
        return cls(kind, int(match["mb"]), int(match["stage"]), peer)

    def label(self, chunk: int | None = None) -> str:
        """Compact display form (Gantt charts, timelines): F3, B3 (F3.1: chunk 1 of a
        rank holding several), sa3>2 / ra3<0 (send/receive activation of micro-batch 3
        to/from rank 2/0), AR, STEP. Drops the stage: ``text()`` keeps it."""
        suffix = "" if chunk is None else f".{chunk}"
        if self.kind in COMPUTE:
            return f"{self.kind.value}{self.microbatch}{suffix}"
        if self.kind in _SHORT:
            arrow = ">" if self.kind in (SEND_ACT, SEND_GRAD) else "<"
            return f"{_SHORT[self.kind]}{self.microbatch}{suffix}{arrow}{self.peer}"
        return "AR" if self.kind == ALL_REDUCE else "STEP"


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
    _check_sizes("gpipe", ranks, microbatches)
    orders = [[Action(FORWARD, m, r) for m in range(microbatches)] + [Action(BACKWARD, m, r)
              for m in range(microbatches)] for r in range(ranks)]
    return _single("gpipe", ranks, microbatches, ranks, orders)


def one_f_one_b(ranks: int, microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-Flush): stage r runs min(p-r-1, m) warm-up forwards, then
    alternates one forward and one backward, then drains. Same bubble as GPipe,
    (p-1)/(m+p-1), but at most p - r micro-batches in flight on stage r."""
    _check_sizes("1f1b", ranks, microbatches)
    orders = []
    for r in range(ranks):
        warmup = min(ranks - r - 1, microbatches)
        order = [Action(FORWARD, m, r) for m in range(warmup)]
        for i in range(microbatches - warmup):
            order += [Action(FORWARD, warmup + i, r), Action(BACKWARD, i, r)]
        order += [Action(BACKWARD, m, r) for m in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return _single("1f1b", ranks, microbatches, ranks, orders)


def interleaved_1f1b(ranks: int, microbatches: int, virtual: int) -> PipelineSchedule:
    """Megatron-LM's interleaved 1F1B: each rank holds v chunks (chunk c of rank r is
    stage c·p + r) and walks micro-batches in groups of p through its chunks. The
    bubble time shrinks v-fold, to (p-1)/v of a full (forward + backward) stage
    time, for ~(1 + (p-1)/(p·v)) times the in-flight activations. Needs m a multiple of p."""
    _check_sizes("interleaved_1f1b", ranks, microbatches)
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
    return _single("interleaved_1f1b", p, m, p * v, orders)


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
    _check_sizes("chimera", ranks, microbatches)
    if ranks % 2:
        raise ValueError(f"chimera needs an even number of pipeline ranks (p={ranks}): its two opposite pipelines "
                         f"pair stage s with stage p-1-s; use p = {ranks + 1}" + (f" or {ranks - 1}" if ranks > 1 else ""))
    if microbatches % 2:
        raise ValueError(f"chimera needs an even number of microbatches (m={microbatches}): half go down, half up; "
                         f"use m = {microbatches + 1}")
    p, m = ranks, microbatches
    pipelines = (tuple(range(p)), tuple(reversed(range(p))))
    microbatch_pipeline = tuple(mb % 2 for mb in range(m))
    from plait.parallel.pipeline.replay import list_schedule  # the greedy builder replays unit costs
    candidates = [list_schedule(p, m, p, pipelines, microbatch_pipeline, prefer_forward=prefer)
                  for prefer in (False, True)]
    _, orders = min(candidates, key=lambda candidate: candidate[0])  # min keeps the first on a tie
    return _single("chimera", p, m, p, orders, pipelines, microbatch_pipeline, all_reduce=True)


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
    _check_sizes("zero_bubble", ranks, microbatches)
    from plait.parallel.pipeline.replay import list_schedule
    pipelines = (tuple(range(ranks)),)
    _, orders = list_schedule(ranks, microbatches, ranks, pipelines, (0,) * microbatches, split_backward=True,
                              in_flight_limits=[2 * ranks - r - 1 for r in range(ranks)])
    return _single("zero_bubble", ranks, microbatches, ranks, orders, pipelines, split_backward=True)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b, "chimera": chimera,
             "zero_bubble": zero_bubble}


def build(name: str, ranks: int, microbatches: int, virtual: int | None = None) -> PipelineSchedule:
    """The named schedule (``virtual``, v >= 2, only for interleaved_1f1b; default 2)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "interleaved_1f1b":
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
