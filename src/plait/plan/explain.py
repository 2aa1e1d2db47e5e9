"""Words and tables for a plan search: the ranked table, the winner's time and memory,
and for each choice the winner made, what the best alternative costs or which
constraint removed it."""

from __future__ import annotations

from collections import Counter

from plait.names.recompute import FULL, NONE, SELECTIVE

from plait.plan.estimate import Estimate
from plait.plan.search import DIMENSIONS, PlanResult, dimension_value

__all__ = ["table", "explain", "breakdown_text"]

GIB = 1 << 30
_RECOMPUTE_SHORT = {NONE: "-", SELECTIVE: "sel", FULL: "ful"}
_PARTS = (("compute", "compute"), ("tp_comm", "tp comm"), ("pp_bubble", "pp bubble"), ("pp_comm", "pp p2p"),
          ("dp_comm", "dp comm"), ("optimizer", "optimizer"))
_LABELS = {"tp": "tp", "pp": "pp", "dp": "dp", "micro_batch": "micro-batch", "schedule": "schedule",
           "recompute": "recompute", "zero_stage": "ZeRO stage", "sequence_parallel": "sequence parallel"}


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"


def _value_text(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def table(result: PlanResult) -> list[str]:
    """The ranked plans, one row each."""
    # the schedule column fits its longest entry ("interleaved_1f1b v=8"), at least 14 wide
    width = max([14] + [len(dimension_value(plan.layout, "schedule")) for plan in result.plans])
    header = (f"{'#':>2} {'tp':>3} {'pp':>3} {'dp':>5} {'mb':>3} {'m':>5} {'schedule':<{width}} {'sp':<3} {'rc':<3} "
              f"{'zero':>4} {'step':>10} {'TFLOP/s/GPU':>11} {'%peak':>6} {'mem GiB':>8}  split: compute/tp/bubble/p2p/dp")
    rows = [header]
    for i, plan in enumerate(result.plans, 1):
        lay = plan.layout
        schedule = dimension_value(lay, "schedule")
        total = plan.step_time_s
        split = "/".join(f"{100 * plan.time_s[key] / total:.0f}" for key in
                         ("compute", "tp_comm", "pp_bubble", "pp_comm", "dp_comm"))
        rows.append(f"{i:>2} {lay.tp:>3} {lay.pp:>3} {lay.dp:>5} {lay.micro_batch:>3} {lay.num_microbatches:>5} "
                    f"{schedule:<{width}} {'y' if lay.sequence_parallel else '-':<3} {_RECOMPUTE_SHORT[lay.recompute]:<3} "
                    f"{lay.zero_stage:>4} {_seconds(total):>10} {plan.tflops_per_gpu:>11.4g} "
                    f"{plan.percent_of_peak:>6.1f} {plan.memory_per_gpu_bytes / GIB:>8.3g}  {split} %")
    return rows


def breakdown_text(plan: Estimate, memory_limit_bytes: float) -> list[str]:
    total = plan.step_time_s
    parts = " + ".join(f"{label} {_seconds(plan.time_s[key])} ({100 * plan.time_s[key] / total:.0f}%)"
                       for key, label in _PARTS if plan.time_s[key] > 0)
    memory = ", ".join(f"{key} {value / GIB:.3g}" for key, value in plan.memory_bytes.items())
    layers = [len(chunk) for chunk in plan.stage_layers]
    lines = [f"  step {_seconds(total)} = {parts}",
             f"  {plan.samples_per_s:.4g} samples/s; {plan.tflops_per_gpu:.4g} TFLOP/s per device counting "
             f"recomputation ({plan.percent_of_peak:.1f}% of peak), model FLOPs utilisation {plan.mfu:.1f}%",
             f"  memory per device {plan.memory_per_gpu_bytes / GIB:.3g} GiB of {memory_limit_bytes / GIB:.3g} "
             f"({memory} GiB)"]
    if len(layers) > 1:
        lines.append(f"  layer groups per pipeline chunk (the first holds the embedding, the last the head): "
                     f"{_compact(layers)}; slowest pipeline rank {plan.bottleneck_rank}")
    if plan.algorithms:
        lines.append("  collectives: " + ", ".join(f"{k} {v}" for k, v in sorted(plan.algorithms.items())
                                                   if v != "none"))
    return lines


def _compact(values: list[int]) -> str:
    runs, out = [], []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    for v, n in runs:
        out.append(f"{v}x{n}" if n > 1 else str(v))
    return " ".join(out)


def _slower_because(alternative: Estimate, best: Estimate) -> str:
    deltas = {key: alternative.time_s[key] - best.time_s[key] for key, _ in _PARTS}
    key = max(deltas, key=deltas.get)
    if deltas[key] <= 0:
        return "no part slower: a tie"
    label = dict(_PARTS)[key]
    return f"{label} +{_seconds(deltas[key])}"


def _failure_text(failures: Counter, closest: Estimate | None, limit: float) -> str:
    reason, count = failures.most_common(1)[0]
    total = sum(failures.values())
    if reason == "exceeds memory" and closest is not None:
        return (f"all {total} layouts exceed memory (the least needs {closest.memory_per_gpu_bytes / GIB:.3g} GiB "
                f"of {limit / GIB:.3g})" if count == total else
                f"no layout fits: {count} exceed memory (least {closest.memory_per_gpu_bytes / GIB:.3g} GiB), "
                f"{total - count} break rules")
    others = ", ".join(f"{r}" for r, _ in failures.most_common()[1:3])
    return f"{reason}" + (f" (also: {others})" if others else "")


def explain(result: PlanResult) -> list[str]:
    """Why the winner: its time and memory, then per choice the alternatives."""
    best = result.best
    lines = [f"best: {best.layout.text()}", *breakdown_text(best, result.memory_limit_bytes), "why:"]
    for dimension in DIMENSIONS:
        chosen = dimension_value(best.layout, dimension)
        others = sorted((value for (dim, value) in result.tallies if dim == dimension and value != chosen),
                        key=lambda v: (str(type(v)), v))
        notes, grouped = [], {}
        for value in others:
            entry = result.tallies[(dimension, value)]
            if entry.best is not None:
                ratio = entry.best.step_time_s / best.step_time_s
                changed = [f"{d}={_value_text(dimension_value(entry.best.layout, d))}" for d in DIMENSIONS
                           if d != dimension and dimension_value(entry.best.layout, d) != dimension_value(best.layout, d)]
                how = f" at best with {' '.join(changed)}" if changed else ""
                blocked = entry.failures.get("exceeds memory", 0)
                memory = f"; {blocked} of its layouts exceed memory" if blocked else ""
                notes.append(f"{_value_text(value)}: {ratio:.2f}x slower{how} "
                             f"({_slower_because(entry.best, best)}{memory})")
            elif entry.failures:
                text = _failure_text(entry.failures, entry.closest, result.memory_limit_bytes)
                grouped.setdefault(text, []).append(_value_text(value))
        notes += [f"{', '.join(values)}: {text}" for text, values in grouped.items()]
        fixed = getattr(result.request, dimension, None) is not None
        head = f"  {_LABELS[dimension]} = {_value_text(chosen)}" + (" (fixed by the request)" if fixed else "")
        lines.append(head + (" -- " + "; ".join(notes) if notes else " (the only option)"))
    eliminated = ", ".join(f"{count} {reason}" for reason, count in result.eliminated.most_common())
    pruning = result.pruning
    lines.append(f"searched {result.considered} layouts in {result.search_time_s:.2f} s: {result.feasible} fit"
                 + (f"; eliminated: {eliminated}" if eliminated else "")
                 + (f"; {pruning.text()}" if pruning is not None and pruning.pruned else ""))
    return lines
