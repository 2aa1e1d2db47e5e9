"""Replay a pipeline schedule with unit costs: the timeline, bubble and memory facts
its data implies, and the validator. The engine's tests check real runs against it and
the planner (``plait.plan.pipeline``) prices every schedule with it.

Costs: a forward of one stage costs ``forward`` (1), a backward ``backward`` (2; a
split backward's W ``weight``, default half of it, and B the rest), divided by the
chunks per rank for interleaved schedules (a chunk is 1/v of a stage's layers); sends
cost nothing and never block; a receive waits for its send.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from plait.parallel.pipeline.actions import (
    ALL_REDUCE,
    BACKWARD,
    COMPUTE,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    WEIGHT,
    Action,
    ScheduleError,
    compute_cost,
)
from plait.parallel.pipeline.schedules import PipelineSchedule

_MATCH = {RECV_ACT: SEND_ACT, RECV_GRAD: SEND_GRAD}


@dataclass(frozen=True)
class Interval:
    """Rank ``rank`` ran ``label`` (an Action's compact text) from start_s to end_s."""

    rank: int
    label: str
    kind: str
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    """What each rank did when: from the unit-cost replay or from a real run."""

    ranks: int
    intervals: tuple[Interval, ...]
    source: str = "unit costs"

    @property
    def makespan_s(self) -> float:
        starts = [i.start_s for i in self.intervals]
        return max(i.end_s for i in self.intervals) - min(starts) if starts else 0.0

    def busy_s(self, rank: int) -> float:
        return sum(i.end_s - i.start_s for i in self.intervals if i.rank == rank and i.kind in COMPUTE)

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Idle share of the step: 1 - busy/makespan (one rank, or the mean over ranks)."""
        span = self.makespan_s
        if span == 0:
            return 0.0
        ranks = range(self.ranks) if rank is None else [rank]
        return sum(1.0 - self.busy_s(r) / span for r in ranks) / len(ranks)


def _chunks(schedule: PipelineSchedule, rank: int) -> int:
    return len(schedule.stages_of(rank))


def replay(schedule: PipelineSchedule, forward: float = 1.0, backward: float = 2.0,
           weight: float | None = None, *, check: bool = True) -> Timeline:
    """Run the action lists with unit costs (``compute_cost``: a split backward's W costs
    ``weight``, default backward/2, and its B the rest); raise ScheduleError on a deadlock.
    ``check``: run ``validate_structure`` first; a caller replaying one schedule at many
    costs (the planner) validates it once and passes False."""
    if check:
        validate_structure(schedule)
    p = schedule.ranks
    position = [0] * p
    clock = [0.0] * p
    posted: dict[tuple, float] = {}  # (kind, microbatch, stage, from, to) -> time the send was posted
    intervals: list[Interval] = []
    scale = [1.0 / _chunks(schedule, r) if schedule.pipelines and len(schedule.pipelines) == 1 else 1.0
             for r in range(p)]
    remaining = sum(len(actions) for actions in schedule.actions)
    while remaining:
        progressed = False
        for rank in range(p):
            actions = schedule.actions[rank]
            while position[rank] < len(actions):
                action = actions[position[rank]]
                if action.kind in _MATCH:
                    key = (_MATCH[action.kind], action.microbatch, action.stage, action.peer, rank)
                    if key not in posted:
                        break  # blocked on the receive
                    clock[rank] = max(clock[rank], posted[key])
                elif action.kind in (SEND_ACT, SEND_GRAD):
                    posted[(action.kind, action.microbatch, action.stage, rank, action.peer)] = clock[rank]
                elif action.kind in COMPUTE:
                    cost = compute_cost(action.kind, forward, backward, split=schedule.split_backward,
                                        weight=weight) * scale[rank]
                    intervals.append(Interval(rank, action.label(), action.kind, action.microbatch,
                                              clock[rank], clock[rank] + cost))
                    clock[rank] += cost
                position[rank] += 1
                remaining -= 1
                progressed = True
        if remaining and not progressed:
            stuck = [f"rank {r} waits at {schedule.actions[r][position[r]].label()}"
                     for r in range(p) if position[r] < len(schedule.actions[r])]
            raise ScheduleError(f"{schedule.name}: deadlock: " + "; ".join(stuck))
    # collectives at the end (all-reduce, step) synchronise: they start when every rank is there
    return Timeline(ranks=p, intervals=tuple(intervals))


def peak_in_flight(schedule: PipelineSchedule) -> list[int]:
    """Per rank, the most micro-batch activations alive at once (forwards done whose
    backward has not run), counted per chunk: interleaved ranks hold up to v per micro-batch."""
    return [peak for peak, _ in _peaks(schedule)]


def peak_in_flight_per_chunk(schedule: PipelineSchedule) -> list[tuple[int, ...]]:
    """Per rank, per chunk (``schedule.stages_of(rank)`` order), the most micro-batch
    activations of that chunk alive at once."""
    return [per_chunk for _, per_chunk in _peaks(schedule)]


def _peaks(schedule: PipelineSchedule) -> list[tuple[int, tuple[int, ...]]]:
    """Per rank: (peak over the rank, peaks per chunk). An activation lives from its
    forward to its backward, or to its W when the backward is split."""
    freed_by = WEIGHT if schedule.split_backward else BACKWARD
    result = []
    for rank in range(schedule.ranks):
        chunk_index = {pair: chunk for chunk, pair in enumerate(schedule.stages_of(rank))}
        alive = peak = 0
        chunk_alive, chunk_peak = [0] * len(chunk_index), [0] * len(chunk_index)
        for action in schedule.compute_order(rank):
            if action.kind not in (FORWARD, freed_by):
                continue
            delta = 1 if action.kind == FORWARD else -1
            chunk = chunk_index[(schedule.microbatch_pipeline[action.microbatch], action.stage)]
            alive += delta
            chunk_alive[chunk] += delta
            peak = max(peak, alive)
            chunk_peak[chunk] = max(chunk_peak[chunk], chunk_alive[chunk])
        result.append((peak, tuple(chunk_peak)))
    return result


def validate_structure(schedule: PipelineSchedule) -> None:
    """Each (micro-batch, stage) forward and backward exactly once, on the rank the
    placement says; on each rank every computation after what it consumes (a
    forward after its input's receive or the local forward before it, a backward
    after its forward and its output gradient's receive or local backward) and
    every send after the computation it sends; every send matched by exactly one
    receive; one STEP last."""
    p, m, stages = schedule.ranks, schedule.microbatches, schedule.stages
    last = stages - 1
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for {p} ranks")
    seen: set[tuple] = set()
    sends: Counter = Counter()
    receives: Counter = Counter()
    for rank, actions in enumerate(schedule.actions):
        done: set[tuple] = set()  # what this rank has done so far: (kind, mb, stage[, peer])

        def need(condition: bool, action: Action, what: str) -> None:
            if not condition:
                raise ScheduleError(f"{schedule.name}: rank {rank} runs {action.label()} (stage {action.stage}) "
                                    f"before {what}")

        for action in actions:
            mb, s = action.microbatch, action.stage
            if action.kind in COMPUTE:
                if not (0 <= mb < m and 0 <= s < stages):
                    raise ScheduleError(f"{schedule.name}: rank {rank} runs {action.label()} on stage {s}: "
                                        f"out of range (m={m}, stages={stages})")
                owner = schedule.rank_of(mb, s)
                if owner != rank:
                    raise ScheduleError(f"{schedule.name}: {action.label()} of stage {s} runs on rank "
                                        f"{rank}, but the stage lives on rank {owner}")
                if (action.kind, mb, s) in seen:
                    raise ScheduleError(f"{schedule.name}: {action.label()} of stage {s} runs twice")
                seen.add((action.kind, mb, s))
                if action.kind == FORWARD and s > 0:
                    local = schedule.rank_of(mb, s - 1) == rank
                    need((FORWARD, mb, s - 1) in done if local else (RECV_ACT, mb, s - 1) in done, action,
                         "its input arrives" if not local else f"the forward of stage {s - 1}")
                if action.kind == WEIGHT:
                    if not schedule.split_backward:
                        raise ScheduleError(f"{schedule.name}: rank {rank} runs {action.label()}, a weight-gradient "
                                            "pass, in a schedule whose backward is not split")
                    need((BACKWARD, mb, s) in done, action, "its input-gradient backward B")
                if action.kind == BACKWARD:
                    need((FORWARD, mb, s) in done, action, "its forward")
                    if s < last:
                        local = schedule.rank_of(mb, s + 1) == rank
                        need((BACKWARD, mb, s + 1) in done if local else (RECV_GRAD, mb, s + 1) in done, action,
                             "its output gradient arrives" if not local else f"the backward of stage {s + 1}")
            elif action.kind in (SEND_ACT, SEND_GRAD):
                made_by = FORWARD if action.kind == SEND_ACT else BACKWARD
                need((made_by, mb, s) in done, action, f"the {made_by}{mb} that makes it")
                sends[(action.kind, mb, s, rank, action.peer)] += 1
            elif action.kind in _MATCH:
                receives[(_MATCH[action.kind], mb, s, action.peer, rank)] += 1
            done.add((action.kind, mb, s))
        if not actions or actions[-1].kind != STEP:
            raise ScheduleError(f"{schedule.name}: rank {rank} does not end with the optimiser STEP")
    kinds = COMPUTE if schedule.split_backward else (FORWARD, BACKWARD)
    missing = [(kind, mb, s) for kind in kinds for mb in range(m) for s in range(stages) if (kind, mb, s) not in seen]
    if missing:
        kind, mb, s = missing[0]
        raise ScheduleError(f"{schedule.name}: {len(missing)} computations never run, e.g. {kind}{mb} of stage {s}")
    if sends != receives:
        lonely = sorted((sends - receives) + (receives - sends))[0]
        raise ScheduleError(f"{schedule.name}: unmatched point-to-point message {lonely[0]} of micro-batch {lonely[1]} "
                            f"stage {lonely[2]} from rank {lonely[3]} to rank {lonely[4]} (sent "
                            f"{sends[lonely]} times, received {receives[lonely]})")
    if any(action.kind == ALL_REDUCE for actions in schedule.actions for action in actions) and len(
            schedule.pipelines) < 2:
        raise ScheduleError(f"{schedule.name}: an ALL_REDUCE without replicated stages")


def validate(schedule: PipelineSchedule) -> Timeline:
    """The structural checks, then a replay that must not deadlock; returns the timeline."""
    return replay(schedule)
