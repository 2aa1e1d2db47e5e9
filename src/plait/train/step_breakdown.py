"""The measured step, part by part: each rank's timed parts summed over its steps,
and their per-step mean and maximum over ranks (``plait.names.step_parts``'s parts).

Every part comes from a timer around the real calls (``plait.parallel.hybrid.StepTimes``):
data fetch, the engine's forward/backward intervals, tensor-parallel collectives (plait.comm's
time on the tp group), pipeline sends and receive waits, the dp sync, the optimizer
step; ``other`` is the rest of the step's wall time, so the parts add up to the wall:

    wall = compute + tp_comm + pp_comm + pp_bubble + dp_comm + optimizer + data + other

The pipeline bubble is waiting: a pipeline receive's wait is the peer still computing
(bubble) plus the message's transfer once sent (pp_comm); the engine's own work between
its actions is bookkeeping (other). They are told apart with the sender's post time E of the same
message (perf_counter, one clock for every process of a host): a wait from t0 to t1
holds idle = clamp(E - t0, 0, t1 - t0) and transfer = (t1 - t0) - idle. The split is
computed over the engine's recorded steps (its last 100) and applied, as a fraction,
to each rank's receive time over the whole run; ranks on different hosts (no common
clock) count the whole wait as bubble, and the report says so.

Per step: the first step of a process (shapes announced, caches warmed) is left out when
more than one ran (``steady``), as the throughput is.
"""

from __future__ import annotations

import socket

from plait.names.step_parts import (COMPUTE, DATA, DP_COMM, OPTIMIZER, OTHER, PP_BUBBLE, PP_COMM, STEP_PARTS,
                                    TP_COMM)
from plait.parallel.hybrid import StepTimes, TIMED_PARTS
from plait.parallel.pipeline.schedules import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD

# StepTimes field -> step part (receive_s is split between pp_comm and pp_bubble)
FIELD_PART = {"compute_s": COMPUTE, "tp_comm_s": TP_COMM, "pp_comm_s": PP_COMM, "dp_comm_s": DP_COMM, "optimizer_s": OPTIMIZER, "data_s": DATA, "other_s": OTHER}
_MATCHING_SEND = {RECV_ACT: SEND_ACT, RECV_GRAD: SEND_GRAD}


class StepTotals:
    """One rank's StepTimes summed over its steps (all, and without the first: steady)."""

    def __init__(self):
        self.steps = 0
        self.total = {name: 0.0 for name in TIMED_PARTS}
        self.steady = {name: 0.0 for name in TIMED_PARTS}
        self.steady_steps = 0
        self.stage_compute_s: dict[str, float] = {}
        self.steady_stage_compute_s: dict[str, float] = {}

    def add(self, times: StepTimes) -> None:
        self.steps += 1
        targets = [(self.total, self.stage_compute_s)]
        if self.steps > 1:
            self.steady_steps += 1
            targets.append((self.steady, self.steady_stage_compute_s))
        for totals, stages in targets:
            for name in TIMED_PARTS:
                totals[name] += getattr(times, name)
            for stage, seconds in times.stage_compute_s.items():
                stages[str(stage)] = stages.get(str(stage), 0.0) + seconds

    def report(self, history) -> dict:
        """This rank's entry for the report: the coarse split of earlier reports
        (compute_s, comm_s, bubble_s, other_s; other = optimizer + data + bookkeeping),
        the fine parts, per-stage compute, and the engine's recent message times."""
        total = self.total
        steady = self.steady if self.steady_steps else self.total
        return {"wall_s": total["wall_s"], "compute_s": total["compute_s"],
                "comm_s": total["tp_comm_s"] + total["dp_comm_s"],
                "bubble_s": total["pp_comm_s"] + total["receive_s"],
                "other_s": total["optimizer_s"] + total["data_s"] + total["other_s"],
                "parts_s": dict(total), "stage_compute_s": dict(self.stage_compute_s),
                "steady": {"steps": self.steady_steps or self.steps, "parts_s": dict(steady),
                           "stage_compute_s": dict(self.steady_stage_compute_s if self.steady_steps
                                                   else self.stage_compute_s)},
                "host": socket.gethostname(),
                "messages": [(list(record.receives), list(record.sends)) for record in history]}


def _receive_split(ranks: list[dict]) -> tuple[dict[int, float], str]:
    """Per global rank, the fraction of its receive waits that was transfer (the rest:
    the peer still computing), from the senders' post times (module docstring)."""
    if len({rank.get("host") for rank in ranks}) > 1:
        return {}, "ranks on several hosts: no common clock, every receive wait counted as bubble"
    pipelines: dict[tuple, dict[int, dict]] = {}
    for rank in ranks:
        coords = rank["coords"]
        pipelines.setdefault((coords["dp"], coords["tp"]), {})[coords["pp"]] = rank
    fractions = {}
    for members in pipelines.values():
        steps = min(len(member.get("messages") or []) for member in members.values())
        posted: list[dict] = [{} for _ in range(steps)]
        for member in members.values():
            log = member["messages"][-steps:] if steps else []
            for index, (_, sends) in enumerate(log):
                for kind, microbatch, stage, posted_s in sends:
                    posted[index][(kind, microbatch, stage)] = posted_s
        for member in members.values():
            waited_s = transfer_s = 0.0
            log = member["messages"][-steps:] if steps else []
            for index, (receives, _) in enumerate(log):
                for kind, microbatch, stage, start_s, end_s in receives:
                    sent_s = posted[index].get((_MATCHING_SEND.get(kind), microbatch, stage))
                    if sent_s is None:
                        continue
                    idle_s = min(max(sent_s - start_s, 0.0), end_s - start_s)
                    waited_s += end_s - start_s
                    transfer_s += end_s - start_s - idle_s
            fractions[member["rank"]] = transfer_s / waited_s if waited_s > 0 else 0.0
    return fractions, "receive waits split by the senders' post times (one host's clock)"


def rank_parts(rank: dict, fraction: float, steady: bool = True) -> dict[str, float]:
    """One rank's step parts (seconds, summed over its steps) with its receive waits
    split: ``fraction`` of them transfer (pp_comm), the rest bubble."""
    source = rank["steady"]["parts_s"] if steady else rank["parts_s"]
    parts = {part: source[name] for name, part in FIELD_PART.items()}
    parts[PP_COMM] += fraction * source["receive_s"]
    parts[PP_BUBBLE] = (1.0 - fraction) * source["receive_s"]
    return parts


def measured_breakdown(ranks: list[dict]) -> dict | None:
    """Per step part, ms per step: the mean over ranks and the largest rank's (and which),
    from each rank's steady steps; the wall likewise; compute per pipeline stage (mean over
    the ranks running it). None when no rank reported parts (an older report)."""
    timed = [rank for rank in ranks if "steady" in rank and rank["steady"]["steps"]]
    if not timed:
        return None
    fractions, split_source = _receive_split(timed)
    per_rank = {}
    for rank in timed:
        steps = rank["steady"]["steps"]
        parts = rank_parts(rank, fractions.get(rank["rank"], 0.0))
        per_rank[rank["rank"]] = {**{part: 1e3 * seconds / steps for part, seconds in parts.items()},
                                  "wall": 1e3 * rank["steady"]["parts_s"]["wall_s"] / steps}
    parts = {}
    for part in (*STEP_PARTS, "wall"):
        values = {rank: row[part] for rank, row in per_rank.items()}
        worst = max(values, key=values.get)
        parts[part] = {"mean_ms": sum(values.values()) / len(values), "max_ms": values[worst], "max_rank": worst}
    stages: dict[str, list[float]] = {}
    for rank in timed:
        for stage, seconds in rank["steady"]["stage_compute_s"].items():
            stages.setdefault(stage, []).append(1e3 * seconds / rank["steady"]["steps"])
    return {"parts_ms": parts, "per_rank_ms": {str(rank): row for rank, row in per_rank.items()},
            "stage_compute_ms": {stage: sum(values) / len(values) for stage, values in sorted(stages.items())},
            "steps": {str(rank["rank"]): rank["steady"]["steps"] for rank in timed},
            "receive_split": split_source,
            "first_step_excluded": any(rank["steady"]["steps"] < rank.get("steps", 0) for rank in timed)}
