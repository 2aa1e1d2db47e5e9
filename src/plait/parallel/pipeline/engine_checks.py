"""PipelineEngine's arguments checked before anything runs: the schedule, this rank's
stage modules, the loss, the group and the ``tied=`` declaration are of the kinds it
takes, or a TypeError (ValueError for a value) names the one that is not (a string used
to surface as an AttributeError from inside)."""

from __future__ import annotations

from torch import nn

from plait.comm.communicator import check_group
from plait.parallel.arguments import check_module, refuse_dtensor_parameters
from plait.parallel.pipeline.schedules import PipelineSchedule


def check_pipeline_arguments(schedule, stage_modules, loss_fn, group, model, tied=None) -> None:
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
    for stage, module in stage_modules.items():  # its storages, messages and shared-weight checks take plain tensors
        refuse_dtensor_parameters(((f"stage {stage} {name}", param) for name, param in module.named_parameters()),
                                  "PipelineEngine", "build the stages' tensor parallelism with plait's layers "
                                  "(plait.parallel.tensor.ColumnParallelLinear / RowParallelLinear; "
                                  "plait.parallel.hybrid for dp x tp x pp)")
    if not callable(loss_fn):
        raise TypeError(f"PipelineEngine: loss_fn must be callable (output, target) -> loss, got {loss_fn!r:.40}")
    if model is not None:
        check_module(model, "PipelineEngine", "model")
    check_tied(tied, schedule.stages, model)
    try:
        check_group(group)
    except TypeError as error:
        raise TypeError(f"PipelineEngine: {error}") from None


def check_tied(tied, stages: int, model) -> None:
    """``tied``: None, or groups of >= 2 (stage, parameter name) pairs, each pair in one
    group at most, stages in [0, stages); not together with ``model`` (which finds ties
    itself)."""
    if tied is None:
        return
    example = 'e.g. tied=[[(0, "wte.weight"), (1, "lm_head.weight")]], or tied=() for none'
    if model is not None:
        raise ValueError("PipelineEngine: pass model= or tied=, not both: with model= the ties are found by "
                         "identity (drop tied=)")
    if isinstance(tied, (str, bytes)) or not isinstance(tied, (list, tuple)):
        raise TypeError(f"PipelineEngine: tied must be a list of groups of (stage, parameter name) pairs that are "
                        f"one parameter ({example}), got {tied!r:.60}")
    seen: set = set()
    for group in tied:
        pairs = group if isinstance(group, (list, tuple)) else None
        if pairs is None or not all(isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], int)
                                    and not isinstance(pair[0], bool) and isinstance(pair[1], str) for pair in pairs):
            raise TypeError(f"PipelineEngine: each group in tied= is a list of (stage, parameter name) pairs "
                            f"({example}), got {group!r:.60}")
        if len(pairs) < 2:
            raise ValueError(f"PipelineEngine: tied= group {list(map(tuple, pairs))} names {len(pairs)} parameter: a "
                             "shared parameter has at least two (stage, name) pairs")
        for stage, name in pairs:
            if not 0 <= stage < stages:
                raise ValueError(f"PipelineEngine: tied= names stage {stage} ({name!r}) but the schedule has stages "
                                 f"0..{stages - 1}")
            if (stage, name) in seen:
                raise ValueError(f"PipelineEngine: tied= names {(stage, name)} twice: list each shared parameter's "
                                 "pairs in one group")
            seen.add((stage, name))
