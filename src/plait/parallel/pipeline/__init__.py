"""plait.parallel.pipeline: pipeline parallelism with schedules as data.

- ``schedules``: GPipe, 1F1B, interleaved 1F1B, Chimera and zero bubble as per-rank action lists.
- ``replay``: the unit-cost replay (timeline, bubble, in-flight activations), the
  validator and the list scheduler.
- ``partition``: splitting a sequential model into stages.
- ``engine``: ``PipelineEngine``, which runs a schedule over real processes.
- ``draw``: ASCII and PNG Gantt charts, timeline JSON, the closed forms.
"""

from plait.parallel.pipeline.draw import ascii_gantt, plot_gantt, theory, timeline_from_json, timeline_to_json
from plait.parallel.pipeline.engine import PipelineEngine, PipelineError, gather_timeline

from plait.parallel.pipeline.replay import (
    Interval,
    ScheduleError,
    Timeline,
    peak_in_flight,
    replay,
    validate,
)
from plait.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    PipelineSchedule,
    build,
    chimera,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble,
)

__all__ = [
    "PipelineEngine", "PipelineError", "ascii_gantt", "gather_timeline", "plot_gantt", "theory",
    "timeline_from_json", "timeline_to_json",
    "SCHEDULES", "Action", "Interval", "PipelineSchedule", "ScheduleError", "Timeline", "build", "chimera", "gpipe",
    "interleaved_1f1b", "one_f_one_b", "peak_in_flight", "replay", "validate", "zero_bubble",
]
