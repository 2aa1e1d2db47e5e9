"""plait.parallel.pipeline: pipeline parallelism with schedules as data.

- ``actions``: one step of a schedule (``Action``, ``ActionKind``) and its unit cost.
- ``schedules``: GPipe, 1F1B, interleaved 1F1B, Chimera and zero bubble as per-rank action
  lists (named by ``plait.names.schedules``), and the list scheduler two of them use.
- ``replay``: the unit-cost replay (timeline, bubble, in-flight activations) and the
  validator; the engine's tests and the planner (``plait.plan.pipeline``) both use it.
- ``partition``: splitting a sequential model into stages.
- ``engine``: ``PipelineEngine``, which runs a schedule over real processes.
- ``graph_split``: ``split(model, example_inputs, stages=N | split_points=[...])``, the
  automatic split of any model (traced by ``graph_trace``) into stage modules.
- ``draw``: ASCII and PNG Gantt charts, timeline JSON, the closed forms.

``actions``, ``schedules`` and ``replay`` import neither torch nor torch.distributed
(``plait.plan`` prices schedules with them) and depend one way: replay -> schedules ->
actions. The names of the other modules load on first use.
"""

from __future__ import annotations

import importlib

from plait.parallel.pipeline.replay import (
    Interval,
    ScheduleError,
    Timeline,
    peak_in_flight,
    peak_in_flight_per_chunk,
    replay,
    validate,
)
from plait.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    PipelineSchedule,
    build,
    chimera,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble,
)

_LAZY = {name: "plait.parallel.pipeline.draw"
         for name in ("ascii_gantt", "plot_gantt", "theory", "timeline_from_json", "timeline_to_json")}
_LAZY.update({name: "plait.parallel.pipeline.engine" for name in ("PipelineEngine", "PipelineError", "gather_timeline")})
_LAZY.update({name: "plait.parallel.pipeline.graph_split" for name in ("split", "causal_lm_loss", "PipelineSplit")})

__all__ = [
    "PipelineEngine", "PipelineError", "PipelineSplit", "ascii_gantt", "causal_lm_loss", "gather_timeline",
    "plot_gantt", "split", "theory", "timeline_from_json", "timeline_to_json",
    "SCHEDULES", "Action", "ActionKind", "Interval", "PipelineSchedule", "ScheduleError", "Timeline", "build",
    "chimera", "gpipe", "interleaved_1f1b", "one_f_one_b", "peak_in_flight", "peak_in_flight_per_chunk", "replay",
    "validate", "zero_bubble",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
