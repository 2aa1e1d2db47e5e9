"""The measured step, part by part: each rank's timed parts summed over its steps,
and their per-step mean and maximum over ranks (``plait.names.step_parts``'s parts).

Every part comes from a timer around the real calls (``plait.parallel.step_times.StepTimes``):
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

The pipeline's drain is waiting too. The engine closes each step with a loss sum over
the pipeline group (and the sums of parameters shared between stages), posted by each
rank once its own last action is done (Chimera first exchanges its replicas' gradients
with the partner rank); a rank that finishes before the others (every rank but the
first, in 1F1B: the first stage runs the last backward) waits there for the slowest
stage, not for the collective. With P_r the time rank r posted its part of an exchange
and L = max P over the exchange's ranks (the pipeline for the loss sum, the pair for
Chimera's exchange; the same step, the same host clock), the exchange from P_r to its
end e_r holds

    drain = clamp(L - P_r, 0, e_r - P_r)     (pp_bubble: the last stage still computing)
    rest  = (e_r - P_r) - drain              (dp_comm: the collectives' own time after the last post)

summed over the recorded steps and applied, as a fraction of the engine's closing time
(``StepTimes.closing_s``, part of dp_comm_s), to each rank's closing time over its
steady steps. The collectives after the engine (the gradient norm's sums over tp and pp,
the dp sync) start once every pipeline rank has left the loss sum, so they do not wait
for the drain: they stay dp_comm (measured: the norm's pp sums took <= 2.4 ms a step on
every rank of a pp2 run, tp 1 and 2, whose drain was 80 ms). On several hosts the closing stays dp_comm (no common
clock), and the report says so. The engine's closing holds only collectives under plait
train (it passes the engine no optimizer): a caller stepping its optimizer inside the
engine's closing would have that step counted as waiting.

Per step: the first step of a process (shapes announced, caches warmed) is left out when
more than one ran (``steady``), as the throughput is.
"""

from __future__ import annotations

import socket

from plait.names.step_parts import (COMPUTE, DATA, DP_COMM, OPTIMIZER, OTHER, PP_BUBBLE, PP_COMM, STEP_PARTS,
                                    TP_COMM)
from plait.parallel.step_times import StepTimes, TIMED_PARTS
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
        self.closing_s = 0.0  # of dp_comm_s: the engine's closing collectives (StepTimes.closing_s)
        self.steady_closing_s = 0.0

    def add(self, times: StepTimes) -> None:
        self.steps += 1
        targets = [(self.total, self.stage_compute_s)]
        self.closing_s += times.closing_s
        if self.steps > 1:
            self.steady_steps += 1
            targets.append((self.steady, self.steady_stage_compute_s))
            self.steady_closing_s += times.closing_s
        for totals, stages in targets:
            for name in TIMED_PARTS:
                totals[name] += getattr(times, name)
            for stage, seconds in times.stage_compute_s.items():
                stages[str(stage)] = stages.get(str(stage), 0.0) + seconds

    def report(self, history) -> dict:
        """This rank's entry for the report: the coarse split of earlier reports
        (compute_s, comm_s, bubble_s, other_s; other = optimizer + data + bookkeeping),
        the fine parts, per-stage compute, the engine's closing time (of dp_comm), and the
        engine's recent message times and closing post/end times."""
        total = self.total
        steady = self.steady if self.steady_steps else self.total
        return {"wall_s": total["wall_s"], "compute_s": total["compute_s"],
                "comm_s": total["tp_comm_s"] + total["dp_comm_s"],
                "bubble_s": total["pp_comm_s"] + total["receive_s"],
                "other_s": total["optimizer_s"] + total["data_s"] + total["other_s"],
                "parts_s": dict(total), "stage_compute_s": dict(self.stage_compute_s), "closing_s": self.closing_s,
                "steady": {"steps": self.steady_steps or self.steps, "parts_s": dict(steady),
                           "stage_compute_s": dict(self.steady_stage_compute_s if self.steady_steps
                                                   else self.stage_compute_s),
                           "closing_s": self.steady_closing_s if self.steady_steps else self.closing_s},
                "host": socket.gethostname(),
                "messages": [(list(record.receives), list(record.sends), (record.closing_s, list(record.closings)))
                             for record in history]}


def _pipelines(ranks: list[dict]) -> list[tuple[dict[int, dict], int]]:
    """The ranks of each pipeline (same dp and tp coordinates) by pipeline rank, with the
    number of recorded steps every member has (their last ones: the same steps)."""
    pipelines: dict[tuple, dict[int, dict]] = {}
    for rank in ranks:
        coords = rank["coords"]
        pipelines.setdefault((coords["dp"], coords["tp"]), {})[coords["pp"]] = rank
    return [(members, min(len(member.get("messages") or []) for member in members.values()))
            for members in pipelines.values()]


def _recorded(member: dict, steps: int) -> list:
    return member["messages"][-steps:] if steps else []


def _receive_split(ranks: list[dict]) -> tuple[dict[int, float], str]:
    """Per global rank, the fraction of its receive waits that was transfer (the rest:
    the peer still computing), from the senders' post times (module docstring)."""
    if len({rank.get("host") for rank in ranks}) > 1:
        return {}, "ranks on several hosts: no common clock, every receive wait counted as bubble"
    fractions = {}
    for members, steps in _pipelines(ranks):
        posted: list[dict] = [{} for _ in range(steps)]
        for member in members.values():
            for index, (_, sends, *_) in enumerate(_recorded(member, steps)):
                for kind, microbatch, stage, posted_s in sends:
                    posted[index][(kind, microbatch, stage)] = posted_s
        for member in members.values():
            waited_s = transfer_s = 0.0
            for index, (receives, *_) in enumerate(_recorded(member, steps)):
                for kind, microbatch, stage, start_s, end_s in receives:
                    sent_s = posted[index].get((_MATCHING_SEND.get(kind), microbatch, stage))
                    if sent_s is None:
                        continue
                    idle_s = min(max(sent_s - start_s, 0.0), end_s - start_s)
                    waited_s += end_s - start_s
                    transfer_s += end_s - start_s - idle_s
            fractions[member["rank"]] = transfer_s / waited_s if waited_s > 0 else 0.0
    return fractions, "receive waits split by the senders' post times (one host's clock)"


def _closing_split(ranks: list[dict]) -> tuple[dict[int, float], str]:
    """Per global rank, the fraction of its engine closing time that was the pipeline's
    drain: in each closing exchange, waiting before the last of its ranks posted (module
    docstring). Recorded steps without closing times (an older report) count 0."""
    if len({rank.get("host") for rank in ranks}) > 1:
        return {}, "ranks on several hosts: no common clock, the pipeline's closing waits counted as dp_comm"
    fractions = {}
    for members, steps in _pipelines(ranks):
        # per pipeline rank and recorded step: (closing seconds, [(what, posted_s, end_s), ...]) or None
        closings = {pp: [entry[2] if len(entry) > 2 else None for entry in _recorded(member, steps)]
                    for pp, member in members.items()}
        size = len(members)
        for pp, member in members.items():
            drain_s = closing_s = 0.0
            for index, mine in enumerate(closings[pp]):
                if mine is None:
                    continue
                seconds, exchanges = mine
                closing_s += seconds
                peers = {"loss": list(members), "replicas": [pp, size - 1 - pp]}
                for what, posted_s, end_s in exchanges:
                    assert what != "replicas" or size - 1 - pp in members, (
                        f"closing exchange 'replicas' of pipeline rank {pp}: its Chimera partner {size - 1 - pp} is "
                        f"not among the pipeline's members {sorted(members)}")
                    posts = [posted for peer in peers[what] if closings.get(peer) and closings[peer][index]
                             for name, posted, _ in closings[peer][index][1] if name == what]
                    drain_s += min(max(max(posts) - posted_s, 0.0), end_s - posted_s)
            fractions[member["rank"]] = min(drain_s / closing_s, 1.0) if closing_s > 0 else 0.0
    return fractions, ("closing waits before the last post of the loss sum (Chimera: of the replica exchange) "
                       "counted as bubble (one host's clock)")


def rank_parts(rank: dict, fraction: float, steady: bool = True, drain_fraction: float = 0.0) -> dict[str, float]:
    """One rank's step parts (seconds, summed over its steps) with its receive waits
    split: ``fraction`` of them transfer (pp_comm), the rest bubble; and
    ``drain_fraction`` of its engine closing time (part of dp_comm) moved to bubble."""
    source = rank["steady"]["parts_s"] if steady else rank["parts_s"]
    parts = {part: source[name] for name, part in FIELD_PART.items()}
    parts[PP_COMM] += fraction * source["receive_s"]
    parts[PP_BUBBLE] = (1.0 - fraction) * source["receive_s"]
    closing_s = (rank["steady"] if steady else rank).get("closing_s", 0.0)
    drain_s = min(drain_fraction * closing_s, parts[DP_COMM])
    parts[DP_COMM] -= drain_s
    parts[PP_BUBBLE] += drain_s
    return parts


def measured_breakdown(ranks: list[dict]) -> dict | None:
    """Per step part, ms per step: the mean over ranks and the largest rank's (and which),
    from each rank's steady steps; the wall likewise; compute per pipeline stage (mean over
    the ranks running it). None when no rank reported parts (an older report)."""
    timed = [rank for rank in ranks if "steady" in rank and rank["steady"]["steps"]]
    if not timed:
        return None
    fractions, split_source = _receive_split(timed)
    drains, closing_source = _closing_split(timed)
    per_rank = {}
    for rank in timed:
        steps = rank["steady"]["steps"]
        parts = rank_parts(rank, fractions.get(rank["rank"], 0.0), drain_fraction=drains.get(rank["rank"], 0.0))
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
            "receive_split": split_source, "closing_split": closing_source,
            "first_step_excluded": any(rank["steady"]["steps"] < rank.get("steps", 0) for rank in timed)}
