"""Pipeline schedule names, one spelling each, as every layer spells them: the builders
(``plait.parallel.pipeline.schedules.build``), the engine's timelines, ``plait train
--schedule``, ``plait schedule``, ``plait bench pp`` and the planner (``plait plan
--schedule``, ``Layout.schedule``).

- gpipe: every forward, then every backward (GPipe).
- 1f1b: one forward, one backward in the steady state (PipeDream-Flush).
- interleaved_1f1b: Megatron-LM's interleaved 1F1B, v model chunks per rank.
- chimera: two pipelines in opposite directions (Li & Hoefler 2021).
- zero_bubble: the backward split into input and weight gradients (ZB-H1).

``NO_PIPELINE`` ("none") is the planner's schedule of a layout with pp = 1.
"""

from __future__ import annotations

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
INTERLEAVED_1F1B = "interleaved_1f1b"
CHIMERA = "chimera"
ZERO_BUBBLE = "zero_bubble"
PIPELINE_SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, CHIMERA, ZERO_BUBBLE)

NO_PIPELINE = "none"

__all__ = ["CHIMERA", "GPIPE", "INTERLEAVED_1F1B", "NO_PIPELINE", "ONE_F_ONE_B", "PIPELINE_SCHEDULES",
           "ZERO_BUBBLE"]
