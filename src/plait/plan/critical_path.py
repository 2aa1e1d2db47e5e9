"""An exact list scheduler for one rank's step: tasks on resources (the compute
stream, a communication stream or thread), each starting when its resource is free
and its inputs are done; the makespan and, per step part, the EXPOSED and the HIDDEN
time.

Semantics (those of a CUDA stream or of plait's comm thread, which runs one
communicator's jobs in the order they were submitted): a resource runs its tasks in
the order they are listed, one at a time; task i starts at

    start_i = max(end of the previous task on i's resource, max_{j in after_i} end_j)

and ends at start_i + duration_i. Dependencies point backwards in the list (``after``
holds indices of earlier tasks), so one pass over the list is the whole schedule:
O(tasks + dependencies), no search. The makespan is the latest end.

Attribution. The ``critical`` resource (the rank's compute stream, what the step
waits on) partitions [0, makespan]: its busy time goes to its tasks' parts; each of
its idle gaps [a, b) goes to the task that ended last among what the next task waited
for (its blocker X, ending at b): [max(a, start_X), b) to X's part, and the rest of
the gap, if X itself started after a, to X's own blocker, and so on back (a critical
path walk). The gap after the critical stream's last task goes the same way to the
task that ends last. So

    makespan = Σ_part exposed[part]                                  (exactly)

and a part's HIDDEN time is the duration of its tasks off the critical resource less
what of them was exposed: the communication that ran under compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Task", "Timeline", "schedule"]


@dataclass(frozen=True)
class Task:
    """One piece of work: ``duration_s`` on ``resource``, counted in step part
    ``part`` (``plait.names.step_parts``), after the tasks at indices ``after``."""

    resource: str
    duration_s: float
    part: str
    after: tuple[int, ...] = ()
    name: str = ""


@dataclass(frozen=True)
class Timeline:
    """A scheduled task list: per task start and end, the makespan, and per part the
    exposed seconds (summing to the makespan) and the hidden seconds."""

    start_s: tuple[float, ...]
    end_s: tuple[float, ...]
    makespan_s: float
    exposed_s: dict[str, float] = field(default_factory=dict)
    hidden_s: dict[str, float] = field(default_factory=dict)


def _check(tasks: list[Task]) -> None:
    for index, task in enumerate(tasks):
        if not task.duration_s >= 0:
            raise ValueError(f"task {index} ({task.name or task.part}): duration_s={task.duration_s!r} must be >= 0")
        for before in task.after:
            if not (isinstance(before, int) and 0 <= before < index):
                raise ValueError(f"task {index} ({task.name or task.part}): after={task.after!r} must name earlier "
                                 f"tasks (indices 0..{index - 1}); list a task after the tasks it waits for")


def schedule(tasks: list[Task], critical: str = "compute") -> Timeline:
    """Schedule ``tasks`` (see the module docstring); ``critical`` names the resource
    whose time is attributed to parts (the rank's compute stream)."""
    tasks = list(tasks)
    _check(tasks)
    free: dict[str, float] = {}
    last_on: dict[str, int] = {}
    start, end, blocker = [], [], []
    for index, task in enumerate(tasks):
        begin, why = free.get(task.resource, 0.0), last_on.get(task.resource)
        for before in task.after:
            if end[before] > begin:
                begin, why = end[before], before
        start.append(begin)
        end.append(begin + task.duration_s)
        blocker.append(why)
        free[task.resource], last_on[task.resource] = end[-1], index
    makespan = max(end, default=0.0)
    exposed: dict[str, float] = {}

    def charge(part: str, seconds: float) -> None:
        if seconds > 0:
            exposed[part] = exposed.get(part, 0.0) + seconds

    exposed_off: dict[int, float] = {}  # per task off the critical resource, its exposed seconds

    def walk(low: float, high: float, why: int | None) -> None:
        """Attribute the idle gap [low, high) of the critical resource, which ``why`` (ending at high) ended."""
        while why is not None and high > low:
            piece = high - max(low, start[why])
            charge(tasks[why].part, piece)
            exposed_off[why] = exposed_off.get(why, 0.0) + piece
            high, why = start[why], blocker[why]
        # an idle stretch nothing explains (a resource idle from the start): nothing to charge

    cursor = 0.0
    for index, task in enumerate(tasks):
        if task.resource != critical:
            continue
        if start[index] > cursor:
            walk(cursor, start[index], blocker[index])
        charge(task.part, task.duration_s)
        cursor = end[index]
    if makespan > cursor:
        last = max(range(len(tasks)), key=lambda i: (end[i], i))
        walk(cursor, makespan, last)
    hidden: dict[str, float] = {}
    for index, task in enumerate(tasks):
        if task.resource != critical:
            seconds = task.duration_s - exposed_off.get(index, 0.0)
            hidden[task.part] = hidden.get(task.part, 0.0) + max(seconds, 0.0)
    return Timeline(tuple(start), tuple(end), makespan, exposed, hidden)
