"""PipelineEngine's arguments checked before anything runs: the schedule, this rank's
stage modules, the loss and the group are of the kinds it takes, or a TypeError names
the one that is not (a string used to surface as an AttributeError from inside)."""

from __future__ import annotations

from torch import nn

from plait.comm.communicator import check_group
from plait.parallel.arguments import check_module
from plait.parallel.pipeline.schedules import PipelineSchedule


def check_pipeline_arguments(schedule, stage_modules, loss_fn, group, model) -> None:
    """PipelineEngine's arguments are of the kinds it takes, or a TypeError naming the one
    that is not (a string used to surface as an AttributeError from inside)."""
    if not isinstance(schedule, PipelineSchedule):
        raise TypeError(f"PipelineEngine: schedule must be a PipelineSchedule (e.g. "
                        f"plait.parallel.pipeline.schedules.one_f_one_b(ranks, microbatches)), got "
                        f"{type(schedule).__name__} ({schedule!r:.40})")
    if not isinstance(stage_modules, dict) or not all(
            isinstance(stage, int) and isinstance(module, nn.Module) for stage, module in stage_modules.items()):
        raise TypeError("PipelineEngine: stage_modules must be a dict of stage index -> nn.Module (this rank's "
                        f"stages), got {stage_modules!r:.80}")
    if not callable(loss_fn):
        raise TypeError(f"PipelineEngine: loss_fn must be callable (output, target) -> loss, got {loss_fn!r:.40}")
    if model is not None:
        check_module(model, "PipelineEngine", "model")
    try:
        check_group(group)
    except TypeError as error:
        raise TypeError(f"PipelineEngine: {error}") from None
