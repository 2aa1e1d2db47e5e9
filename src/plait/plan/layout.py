"""A parallel layout as plait plan prices it and plait train runs it (tp x pp x dp,
micro-batching, schedule, recomputation, ZeRO stage, sequence parallelism, offload,
mesh order), and every rule a layout must keep to run (``layout_problems``)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from plait.names.schedules import INTERLEAVED_1F1B, NO_PIPELINE, PIPELINE_SCHEDULES
from plait.names.axes import DEFAULT_ORDER, DP, PP, TP
from plait.plan.layers import RECOMPUTE_MODES
from plait.plan.pipeline import LIST_SCHEDULED, schedule_problem

SCHEDULES = (NO_PIPELINE, *PIPELINE_SCHEDULES)  # plait.names.schedules, and none at pp = 1
MESH_ORDERS = (DEFAULT_ORDER, ",".join((TP, PP, DP)))  # tp first: tp groups are priced as consecutive


@dataclass(frozen=True, kw_only=True)
class Layout:
    """tp x pp x dp, micro-batching, schedule and memory options."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    num_microbatches: int = 1
    schedule: str = NO_PIPELINE
    virtual: int = 1
    recompute: str = "none"  # none | selective | full (plait train's --recompute)
    zero_stage: int = 0
    sequence_parallel: bool = False
    offload: bool = False  # plait train's --offload-activations
    offload_optimizer: bool = False  # plait train's --offload optimizer: ZeRO's state in files, not in memory
    mesh_order: str = DEFAULT_ORDER  # plait train's --mesh-order, tp first (tp groups are priced as consecutive)

    def stride(self, axis: str) -> int:
        """Ranks between neighbours of ``axis``'s groups: the product of the axes
        inside it in ``mesh_order``."""
        order = self.mesh_order.split(",")
        return math.prod(getattr(self, name) for name in order[:order.index(axis)])

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.dp * self.num_microbatches * self.micro_batch

    def as_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        schedule = self.schedule + (f" v={self.virtual}" if self.schedule == INTERLEAVED_1F1B else "")
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} mb={self.micro_batch} m={self.num_microbatches} {schedule}"
                f"{' sp' if self.sequence_parallel else ''}{f' recompute={self.recompute}' if self.recompute != 'none' else ''}"
                f"{f' zero{self.zero_stage}' if self.zero_stage else ''}{' offload' if self.offload else ''}"
                f"{' offload-optimizer' if self.offload_optimizer else ''}")


def layout_problems(layout: Layout, *, num_groups: int, world_size: int, global_batch: int,
                    tp_problem: str | None, seq_len: int | None) -> list[str]:
    """Every rule ``layout`` breaks, each naming the values and the rule."""
    problems = []
    for key in ("tp", "pp", "dp", "micro_batch", "num_microbatches", "virtual"):
        value = getattr(layout, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{key}={value!r} must be a whole number >= 1")
    if layout.mesh_order not in MESH_ORDERS:
        problems.append(f"mesh_order={layout.mesh_order!r} must be one of {', '.join(MESH_ORDERS)} (the plan prices "
                        "tp groups as consecutive ranks)")
    for key in ("offload", "offload_optimizer"):
        if not isinstance(getattr(layout, key), bool):
            problems.append(f"{key}={getattr(layout, key)!r} must be True or False")
    if isinstance(layout.recompute, bool) or layout.recompute not in RECOMPUTE_MODES:
        problems.append(f"recompute={layout.recompute!r} must be one of {', '.join(RECOMPUTE_MODES)}")
    if problems:
        return problems
    if layout.devices != world_size:
        problems.append(f"tp({layout.tp}) * pp({layout.pp}) * dp({layout.dp}) = {layout.devices} != "
                        f"devices({world_size})")
    if layout.global_batch != global_batch:
        problems.append(f"dp({layout.dp}) * num_microbatches({layout.num_microbatches}) * micro_batch"
                        f"({layout.micro_batch}) = {layout.global_batch} != global batch({global_batch})")
    if tp_problem:
        problems.append(tp_problem)
    if layout.schedule not in SCHEDULES:
        problems.append(f"schedule={layout.schedule!r} must be one of {', '.join(SCHEDULES)}")
    elif layout.pp == 1 and layout.schedule != NO_PIPELINE:
        problems.append(f"schedule={layout.schedule!r} needs pp > 1 (pp=1 runs no pipeline: schedule none)")
    elif layout.pp > 1 and layout.schedule == NO_PIPELINE:
        problems.append(f"pp={layout.pp} needs a pipeline schedule ({', '.join(PIPELINE_SCHEDULES)})")
    if layout.schedule == INTERLEAVED_1F1B:
        if layout.virtual < 2:
            problems.append(f"{INTERLEAVED_1F1B} needs virtual >= 2 model chunks per rank, got {layout.virtual}")
        if layout.num_microbatches % layout.pp:
            problems.append(f"{INTERLEAVED_1F1B} needs num_microbatches({layout.num_microbatches}) to be a multiple of "
                            f"pp({layout.pp})")
    elif layout.virtual != 1:
        problems.append(f"virtual={layout.virtual} is only for the {INTERLEAVED_1F1B} schedule")
    elif layout.schedule in LIST_SCHEDULED and layout.pp > 1:
        problem = schedule_problem(layout.schedule, layout.pp, layout.num_microbatches, 1)
        if problem:
            problems.append(problem)
    chunks = layout.pp * layout.virtual
    if chunks > num_groups:
        problems.append(f"pp({layout.pp}) * virtual({layout.virtual}) = {chunks} chunks exceed the model's "
                        f"{num_groups} layers (each chunk needs at least one)")
    if layout.zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_stage={layout.zero_stage!r} must be 0, 1, 2 or 3")
    elif layout.zero_stage == 3 and layout.pp > 1:
        problems.append("zero_stage=3 with pp > 1: plait runs stage 3 (plait.parallel.ZeRO) without a pipeline; "
                        "use zero_stage <= 2 with pp > 1")
    if layout.offload_optimizer is True and layout.zero_stage == 0:
        problems.append("offload_optimizer with zero_stage=0: plait offloads ZeRO's sharded optimizer state "
                        "(plait train --zero-stage 1|2|3 --offload optimizer); use zero_stage 1, 2 or 3")
    if layout.sequence_parallel:
        if layout.tp == 1:
            problems.append("sequence_parallel needs tp > 1")
        elif seq_len is not None and seq_len % layout.tp:
            problems.append(f"sequence_parallel splits seq_len({seq_len}) over tp({layout.tp}): it must divide")
    return problems
