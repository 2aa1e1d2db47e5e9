"""The search grid and its budget: which layouts ``plait.plan.search`` visits, and
which it prices when there are more than ``PlanRequest.max_layouts``.

The search space is a grid of families, one per (tp, pp) pair (dp = devices / (tp·pp)),
each with its micro-batch sizes b; a (family, b) cell holds the layouts that differ in
schedule, recomputation, ZeRO stage and sequence parallelism, and how many of them
break no rule (and so would be priced) is known before any is priced. When the grid's
total fits the budget, everything is priced, in the search's own order, exactly as
without a budget. Otherwise the grid is thinned, one step at a time, until it fits:

1. rounds of geometric ladders of ratio 2, then 4, then 16, then the extremes only,
   each round over the micro-batch sizes of every family, then over the pp degrees;
2. then the tp degrees (few, and each splits every layer differently) by ladders of
   ratio 2, 4, then the extremes.

A ladder of ratio R keeps the smallest value, then each value at least R times the
last kept, and always the largest, so the extremes of every dimension stay and what
goes are the in-between values close to a kept one (b = 3, 6, 12, 24 before 1, 2, 4,
8, 16, 32): a dropped value is within a factor R of a kept one. Steps that would
drop nothing are skipped. The steps are fixed, so a request always prices the same
layouts. If even the coarsest grid is over budget, its layouts are priced in the
search's order until the budget is spent. ``Pruning`` records the steps and how many
layouts were not priced.

Measured on seven preset searches (GPT 1.3B to 1T on 64 to 3,072 A100s): with half of a
search's layouts as the budget the best plan found was the full search's in 6 of 7
(the 7th 2.9% slower), with a quarter or a tenth within 6% of it; with 3%, up to 1.7x
slower. What the budget costs is said, never hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from plait.names.schedules import CHIMERA, GPIPE, INTERLEAVED_1F1B, NO_PIPELINE, ONE_F_ONE_B, ZERO_BUBBLE
from plait.plan.layout import Layout, layout_problems
from plait.plan.layers import RECOMPUTE_MODES
from plait.plan.pipeline import MAX_LIST_SCHEDULED_PP

__all__ = ["DEFAULT_MAX_LAYOUTS", "Family", "Pruning", "ladder", "fit_budget", "enumerate_families",
           "variant_choices", "divisors"]

# Every preset search is priced in full: GPT-3 175B on 1,024 GPUs prices 7,620 layouts, the
# 1T model on 3,072 12,524, the most of 4,185 preset searches surveyed (8 to 3M GPUs) 25,712;
# ~0.3 ms a layout on a 2-core machine, so the budget is ~15 s of pricing there.
DEFAULT_MAX_LAYOUTS = 50_000

# coarser and coarser rounds over micro-batch sizes, then pp degrees; tp (a few values, each
# splitting every layer differently) only once both are down to their extremes
_STEPS = (tuple((dimension, ratio) for ratio in (2, 4, 16, math.inf) for dimension in ("micro_batch", "pp"))
          + (("tp", 2), ("tp", 4), ("tp", math.inf)))


@dataclass(frozen=True)
class Family:
    """One (tp, pp) pair of the grid: ``structural`` names the rule that removes it
    whole (then it has no micro-batches), else ``micro_batches`` are its sizes in
    search order and ``priced`` how many layouts of each would be priced."""

    tp: int
    pp: int
    dp: int
    structural: str | None = None
    micro_batches: tuple[int, ...] = ()
    priced: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.priced)


@dataclass
class Pruning:
    """What the budget cut: the thinning steps taken (in words), whether the search
    stopped early, and how many layouts that would have been priced were not."""

    max_layouts: int
    total: int = 0                 # layouts the full grid would price
    steps: list[str] = field(default_factory=list)
    stop_after: int | None = None  # price at most this many, in search order
    not_priced: int = 0

    @property
    def pruned(self) -> bool:
        return self.not_priced > 0

    def text(self) -> str:
        """One clause: the budget, what was thinned, and what was not priced."""
        what = "; ".join(self.steps + ([f"then stopped after {self.stop_after:,} in search order"]
                                       if self.stop_after is not None else []))
        return (f"budget max_layouts={self.max_layouts:,} cut the search: {what}; {self.not_priced:,} of "
                f"{self.total:,} layouts not priced (raise max_layouts, --max-layouts, to price them)")


def ladder(values, ratio: float) -> list[int]:
    """The smallest of ``values``, then each one at least ``ratio`` times the last kept,
    and the largest (ratio inf: the smallest and the largest only)."""
    ordered = sorted(set(values))
    if len(ordered) <= 2 or ratio <= 1:
        return ordered
    kept = [ordered[0]]
    for value in ordered[1:-1]:
        if value >= kept[-1] * ratio:
            kept.append(value)
    return kept + [ordered[-1]]


def _thin(families: list[Family], ratios: dict[str, float]) -> list[Family]:
    """The families and micro-batch sizes the ladders of ``ratios`` keep (order kept)."""
    valid = [f for f in families if f.structural is None]
    keep_pp = set(ladder((f.pp for f in valid), ratios.get("pp", 1)))
    keep_tp = set(ladder((f.tp for f in valid), ratios.get("tp", 1)))
    out = []
    for family in valid:
        if family.pp not in keep_pp or family.tp not in keep_tp:
            continue
        sizes = set(ladder(family.micro_batches, ratios.get("micro_batch", 1)))
        kept = [(b, n) for b, n in zip(family.micro_batches, family.priced) if b in sizes]
        out.append(replace(family, micro_batches=tuple(b for b, _ in kept), priced=tuple(n for _, n in kept)))
    return out


def fit_budget(families: list[Family], max_layouts: int) -> tuple[list[Family], Pruning]:
    """The families (structurally removed ones included, to be counted) and
    micro-batch sizes to search within ``max_layouts`` priced layouts, and the record
    of what was cut (see the module docstring)."""
    pruning = Pruning(max_layouts=max_layouts, total=sum(f.total for f in families))
    if pruning.total <= max_layouts:
        return families, pruning
    applied: dict[str, float] = {}
    thinned = families
    for dimension, ratio in _STEPS:
        trial = {**applied, dimension: ratio}
        candidate = _thin(families, trial)
        if sum(f.total for f in candidate) == sum(f.total for f in thinned):
            continue  # this step prices what the last one did: not worth taking or naming
        applied, thinned = trial, candidate
        if sum(f.total for f in thinned) <= max_layouts:
            break
    valid = [f for f in thinned if f.structural is None]
    sizes_before = sum(len(f.micro_batches) for f in families if f.structural is None)
    sizes_after = sum(len(f.micro_batches) for f in _thin(families, {"micro_batch": applied.get("micro_batch", 1)}))
    for dimension, ratio in applied.items():
        rule = "the smallest and largest" if ratio == math.inf else f"a x{ratio:g} ladder"
        if dimension == "micro_batch":
            pruning.steps.append(f"micro-batch sizes of each (tp, pp) thinned to {rule} "
                                 f"({sizes_before - sizes_after:,} of {sizes_before:,} sizes dropped)")
        else:
            kept = sorted({getattr(f, dimension) for f in valid})
            pruning.steps.append(f"{dimension} degrees thinned to {rule} (kept {', '.join(map(str, kept))})")
    priced = sum(f.total for f in thinned)
    if priced > max_layouts:
        pruning.stop_after = max_layouts
        priced = max_layouts
    pruning.not_priced = pruning.total - priced
    # structurally removed families are still counted (and tallied) as before
    kept = {(f.tp, f.pp): f for f in thinned}
    return [kept.get((f.tp, f.pp), f) for f in families
            if f.structural is not None or (f.tp, f.pp) in kept], pruning


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending: O(sqrt n)."""
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _choices(fixed, options):
    return [fixed] if fixed is not None else list(options)


def variant_choices(tp: int, pp: int, dp: int, request):
    """The sequence-parallel, recomputation, schedule and ZeRO choices of a (tp, pp, dp)
    family, in search order."""
    sps = _choices(request.sequence_parallel, (False, True) if tp > 1 else (False,))
    rcs = _choices(request.recompute, RECOMPUTE_MODES)
    zeros = _choices(request.zero_stage, [0] if dp == 1 else ([0, 1] if pp > 1 else [0, 1, 2, 3]))
    return sps, rcs, _schedules(pp, request), zeros


def enumerate_families(model, world: int, request) -> list[Family]:
    """The search grid, in search order: tp over the divisors of the devices, pp over
    those of devices / tp, each family's micro-batch sizes the divisors of its
    per-replica batch up to ``max_micro_batch`` (from the divisors of the global batch,
    found once), and how many layouts of each size break no rule: counted once per kind
    of cell, since the rules see tp, pp and whether pp divides the micro-batch count,
    nothing else of a cell (and, for Chimera's size limit, m at small pp)."""
    batch = request.global_batch
    sizes = [b for b in divisors(batch) if b <= request.max_micro_batch]
    valid_counts: dict = {}
    families = []
    for tp in _choices(request.tp, divisors(world)):
        for pp in _choices(request.pp, divisors(world // tp) if world % tp == 0 else []):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            if request.dp is not None and dp != request.dp:
                continue
            structural = [p for p in (model.tensor_parallel_problem(tp),) if p]
            if pp > model.num_groups:
                structural.append(f"pp={pp} exceeds the model's {model.num_groups} layers")
            if batch % dp:
                structural.append(f"global batch {batch} is not divisible by dp={dp}")
            if structural:
                families.append(Family(tp, pp, dp, structural=structural[0]))
                continue
            per_replica = batch // dp
            micro_batches = _choices(request.micro_batch, [b for b in sizes if per_replica % b == 0])
            counts = []
            for mb in micro_batches:
                if per_replica % mb:
                    counts.append(0)
                    continue
                m = per_replica // mb
                key = (tp, pp, m % pp == 0, m % 2 == 0, m if pp <= MAX_LIST_SCHEDULED_PP else None)
                if key not in valid_counts:
                    sps, rcs, schedules, zeros = variant_choices(tp, pp, dp, request)
                    valid_counts[key] = sum(
                        not layout_problems(Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, num_microbatches=m,
                                                   schedule=schedule, virtual=virtual, recompute=rc,
                                                   zero_stage=zero, sequence_parallel=sp,
                                                   offload_optimizer=request.offload_optimizer),
                                            num_groups=model.num_groups, world_size=world, global_batch=batch,
                                            tp_problem=None, seq_len=getattr(model, "seq_len", None))
                        for sp in sps for rc in rcs for schedule, virtual in schedules for zero in zeros)
                counts.append(valid_counts[key])
            families.append(Family(tp, pp, dp, micro_batches=tuple(micro_batches), priced=tuple(counts)))
    return families


def _schedules(pp: int, request) -> list[tuple[str, int]]:
    """(schedule, virtual) choices at ``pp``, as the request fixes or leaves them."""
    if pp == 1:
        options = [(NO_PIPELINE, 1)]
    else:
        options = ([(ONE_F_ONE_B, 1), (GPIPE, 1)] + [(INTERLEAVED_1F1B, v) for v in request.virtual_choices]
                   + [(ZERO_BUBBLE, 1), (CHIMERA, 1)])
    schedule = request.schedule or (INTERLEAVED_1F1B if request.virtual is not None else None)
    if schedule is not None:
        options = [o for o in options if o[0] == schedule] or [(schedule, request.virtual or 1)]
    if request.virtual is not None:
        options = [(s, request.virtual if s == INTERLEAVED_1F1B else v) for s, v in options]
        options = list(dict.fromkeys(options))
    return options
