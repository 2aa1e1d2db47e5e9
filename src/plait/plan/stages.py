"""Pipeline stage partitioners: cut a chain of layers into contiguous stages.

Both problems cut L layers, run one after another, into contiguous slices
``[b_0, b_1), [b_1, b_2), ...`` with ``0 = b_0 < b_1 < ... = L``:

- ``minmax_partition``: the linear-partition problem. Given per-layer costs c_l and
  a stage count p, minimise the bottleneck ``max_s sum_{l in s} c_l`` (what paces a
  pipeline whose stages each get one equal device). Exact; ~0.1-0.3 ms for L = 98.
- ``alpa_partition``: Alpa's inter-operator DP (Zheng et al., OSDI 2022, §5.2).
  Each stage also chooses a submesh of n devices, the sizes sum to the device
  count, and the objective is the pipeline latency of m micro-batches

      T = sum_s t_s + (m - 1) · max_s t_s

  (the first micro-batch walks through every stage, then the slowest stage paces
  the other m - 1).

Slice sums are prefix-sum differences ``S[j] - S[i]`` (``S[k] = c_0 + ... +
c_{k-1}``), so the same float is used everywhere a slice is priced.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["StagePlan", "alpa_partition", "minmax_partition", "partition_sums"]


def _prefix_sums(costs: Sequence[float]) -> list[float]:
    """S[k] = costs[0] + ... + costs[k-1], after checking every cost."""
    if isinstance(costs, (str, bytes)) or not hasattr(costs, "__len__") or len(costs) == 0:
        raise ValueError(f"costs={costs!r} must be a non-empty sequence of finite numbers >= 0 (one per layer)")
    prefix = [0.0]
    for index, cost in enumerate(costs):
        if isinstance(cost, bool) or not isinstance(cost, (int, float, np.integer, np.floating)):
            raise ValueError(f"costs[{index}]={cost!r} is not a number; give one finite cost >= 0 per layer")
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(f"costs[{index}]={cost!r} must be finite and >= 0")
        prefix.append(prefix[-1] + float(cost))
    if not math.isfinite(prefix[-1]):
        raise ValueError(f"sum(costs) overflows to {prefix[-1]}; rescale the costs (e.g. to seconds or GFLOPs)")
    return prefix


def _greedy_bottleneck(prefix: list[float], bound: float, parts: int) -> float | None:
    """Largest slice sum of the left-greedy cut into at most ``parts`` slices of sum
    <= ``bound``, or None when it needs more. Each slice takes as many layers as fit,
    which is optimal for feasibility (its k-th cut is never left of any feasible
    cut's k-th). Cost O(parts · log L)."""
    num_layers = len(prefix) - 1
    start, used, worst = 0, 0, 0.0
    while start < num_layers:
        if used == parts:
            return None
        end = bisect_right(prefix, prefix[start] + bound, start + 1) - 1
        # S[start] + bound rounds; re-check with the subtraction that defines a slice sum.
        while end > start and prefix[end] - prefix[start] > bound:
            end -= 1
        while end < num_layers and prefix[end + 1] - prefix[start] <= bound:
            end += 1
        if end == start:
            return None
        worst = max(worst, prefix[end] - prefix[start])
        used, start = used + 1, end
    return worst


def _slice_sums_between(prefix: list[float], low: float, high: float, limit: int) -> set[float] | None:
    """The distinct slice sums S[j] - S[i] in (low, high], or None when more than
    ``limit`` slices have one. Two bisections per start i; cost O(L log L + limit)."""
    num_layers = len(prefix) - 1
    values: set[float] = set()
    listed = 0
    for start in range(num_layers):
        base = prefix[start]
        first = bisect_right(prefix, base + low, start + 1)
        while first > start + 1 and prefix[first - 1] - base > low:  # base + low rounds: re-check
            first -= 1
        while first <= num_layers and prefix[first] - base <= low:
            first += 1
        last = bisect_right(prefix, base + high, start + 1) - 1
        while last > start and prefix[last] - base > high:
            last -= 1
        while last < num_layers and prefix[last + 1] - base <= high:
            last += 1
        listed += max(0, last + 1 - first)
        if listed > limit:
            return None
        values.update(prefix[end] - base for end in range(first, last + 1))
    return values


def minmax_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Cut ``costs`` into ``parts`` contiguous non-empty slices minimising the largest
    slice sum B* = min over cuts of max_s (S[b_s] - S[b_{s-1}]); returns the cuts
    [0 = b_0 < b_1 < ... < b_parts = L].

    Exact: B* is a slice sum, and "is max <= B feasible" is monotone in B and decided
    by a greedy pass (O(parts · log L)). B* lies in (lo, hi] with lo = max(widest layer,
    S[L]/parts) - or just below the widest layer - and hi = the greedy bottleneck at
    lo + widest layer (B* <= S[L]/parts + widest). We halve that bracket until it holds
    at most 4L slice sums (rarely needed), list them, and bisect over them; each
    feasible pass snaps hi down to the bottleneck it achieved. Cost O(L log L + parts ·
    log L · log L) typically; about 0.1 ms for L = 98, parts = 64.

    Ties: among all optimal cuts the returned one is element-wise the smallest
    (every b_s is as small as in any optimal cut): slices are filled from the back,
    each as long as the bottleneck allows, so early stages get the fewest layers
    (in 1F1B the first stage keeps the most micro-batches of activations).
    """
    prefix = _prefix_sums(costs)
    num_layers = len(prefix) - 1
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or not 1 <= parts <= num_layers:
        raise ValueError(f"parts={parts!r} must be an integer in 1..{num_layers} (len(costs)): "
                         "every slice needs a layer")
    parts = int(parts)
    widest_layer = max(prefix[k + 1] - prefix[k] for k in range(num_layers))
    # Any cut has a slice holding the widest layer, whose sum is >= widest_layer.
    infeasible = math.nextafter(widest_layer, -math.inf)
    lower_bound = max(widest_layer, prefix[-1] / parts)
    feasible = _greedy_bottleneck(prefix, lower_bound, parts)
    if feasible is None:
        infeasible = lower_bound
        feasible = _greedy_bottleneck(prefix, lower_bound + widest_layer, parts)
        if feasible is None:  # only if rounding broke B* <= S[L]/parts + widest
            feasible = prefix[-1]
    while (listed := _slice_sums_between(prefix, infeasible, feasible, 4 * num_layers)) is None:
        for _ in range(4):  # halve the bracket; the greedy snaps a feasible end to a real slice sum
            middle = infeasible + (feasible - infeasible) / 2
            if not infeasible < middle < feasible:
                listed = {feasible}  # no float between: feasible is B*
                break
            worst = _greedy_bottleneck(prefix, middle, parts)
            infeasible, feasible = (middle, feasible) if worst is None else (infeasible, worst)
        if listed is not None:
            break
    values = sorted(listed)  # holds B* and, as its last entry, feasible
    left, right = 0, len(values) - 1
    while left < right:
        middle_index = (left + right) // 2
        worst = _greedy_bottleneck(prefix, values[middle_index], parts)
        if worst is None:
            left = middle_index + 1
        else:
            right = bisect_left(values, worst)
    bottleneck = values[left]
    cuts = [num_layers]
    for slice_number in range(parts, 1, -1):
        end = cuts[-1]
        start = bisect_left(prefix, prefix[end] - bottleneck, 0, end)
        while start > 0 and prefix[end] - prefix[start - 1] <= bottleneck:
            start -= 1
        while start < end and prefix[end] - prefix[start] > bottleneck:
            start += 1
        start = max(start, slice_number - 1)  # leave one layer for each earlier slice
        assert start < end, (start, end, bottleneck)
        cuts.append(start)
    assert prefix[cuts[-1]] - prefix[0] <= bottleneck, (cuts, bottleneck)
    cuts.append(0)
    return cuts[::-1]


def partition_sums(costs: Sequence[float], boundaries: Sequence[int]) -> list[float]:
    """Per-slice sums S[b_s] - S[b_{s-1}] of ``costs`` cut at ``boundaries``
    ([0 = b_0 < ... < b_p = len(costs)]), priced exactly as ``minmax_partition`` does."""
    prefix = _prefix_sums(costs)
    cuts = list(boundaries)
    if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != len(costs) or any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"boundaries={cuts!r} must rise strictly from 0 to len(costs)={len(costs)}")
    return [prefix[b] - prefix[a] for a, b in zip(cuts, cuts[1:])]


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """A pipeline plan: stage s runs layers ``slices[s] = (i, j)`` (i.e. i..j-1) on a
    submesh of ``submesh_sizes[s]`` devices in ``stage_times_s[s]`` seconds per
    micro-batch. ``latency_s = sum_s t_s + (microbatches - 1) · max_s t_s``."""

    slices: tuple[tuple[int, int], ...]
    submesh_sizes: tuple[int, ...]
    stage_times_s: tuple[float, ...]
    latency_s: float
    microbatches: int

    def __post_init__(self) -> None:
        problems = []
        if not self.slices or not len(self.slices) == len(self.submesh_sizes) == len(self.stage_times_s):
            problems.append(f"slices ({len(self.slices)}), submesh_sizes ({len(self.submesh_sizes)}) and "
                            f"stage_times_s ({len(self.stage_times_s)}) must have the same length >= 1")
        ends = [0] + [end for _, end in self.slices]
        if any(start != ends[s] or end <= start for s, (start, end) in enumerate(self.slices)):
            problems.append(f"slices={self.slices!r} must be non-empty, contiguous and start at layer 0")
        if any(n < 1 for n in self.submesh_sizes):
            problems.append(f"submesh_sizes={self.submesh_sizes!r} must all be >= 1")
        if self.microbatches < 1:
            problems.append(f"microbatches={self.microbatches!r} must be >= 1")
        if problems:
            raise ValueError("invalid StagePlan: " + "; ".join(problems))

    @property
    def num_stages(self) -> int:
        return len(self.slices)

    @property
    def devices(self) -> int:
        return sum(self.submesh_sizes)

    @property
    def bottleneck_stage(self) -> int:
        """Index of the slowest stage (the first one on ties): it paces the pipeline."""
        return max(range(self.num_stages), key=lambda s: (self.stage_times_s[s], -s))

    @property
    def bottleneck_time_s(self) -> float:
        return self.stage_times_s[self.bottleneck_stage]


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return int(value)


def _stage_count_range(num_layers: int, devices: int, sizes: tuple[int, ...],
                       stages: int | None, max_stages: int | None) -> tuple[int, int]:
    """Allowed stage counts [low, high]; every stage needs >= 1 layer and >= min(sizes) devices."""
    most = min(num_layers, devices // min(sizes))
    if stages is not None and max_stages is not None:
        raise ValueError(f"give stages={stages!r} or max_stages={max_stages!r}, not both")
    if stages is not None:
        stages = _check_count("stages", stages)
        if stages > num_layers:
            raise ValueError(f"stages={stages} > num_layers={num_layers}: every stage needs at least one layer")
        if stages * min(sizes) > devices:
            raise ValueError(f"stages={stages} needs at least {stages} x {min(sizes)} (smallest usable submesh) "
                             f"= {stages * min(sizes)} devices > devices={devices}; use stages <= {most}")
        return stages, stages
    if max_stages is not None:
        return 1, min(_check_count("max_stages", max_stages), most)
    return 1, most


def _stage_time_table(num_layers: int, sizes: tuple[int, ...], stage_time_s: Callable[..., float],
                      depths: int | None) -> np.ndarray:
    """times[0, i, j, a] = stage_time_s(i, j, sizes[a]) for i < j (one call each), inf
    elsewhere; with ``depths``, times[s, i, j, a] = stage_time_s(i, j, sizes[a], s) for
    s = 1..depths (level 0 inf)."""
    levels = (0,) if depths is None else range(1, depths + 1)
    times = np.full((1 if depths is None else depths + 1, num_layers, num_layers + 1, len(sizes)), math.inf)
    for level in levels:
        for start in range(num_layers):
            for end in range(start + 1, num_layers + 1):
                for index, size in enumerate(sizes):
                    args = (start, end, size) if depths is None else (start, end, size, level)
                    value = stage_time_s(*args)
                    call = f"stage_time_s{args}"
                    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                        raise TypeError(f"{call} returned {value!r}; return seconds as a float (math.inf when the "
                                        "slice cannot run on that submesh)")
                    if math.isnan(value) or value < 0:
                        raise ValueError(f"{call} = {value!r} must be >= 0 seconds (math.inf when the slice cannot "
                                         "run on that submesh)")
                    times[level, start, end, index] = value
    return times


def _dp_tables(capped_s: np.ndarray, sizes: tuple[int, ...], devices: int,
               stage_limit: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Alpa's DP at one cap: least sums of stage times and the choices that give them.

    capped_s[0, k, j, a] is t(k, j, sizes[a]), or inf above the cap (with one level per
    depth, capped_s[s, k, j, a] is the time of a stage that is s-th from the end, and
    F[s, ...] below reads it). Without a stage
    limit F[0, k, d] = min over j > k, a of capped_s[k, j, a] + F[0, j, d - sizes[a]]
    (layers k..L-1 on d devices, F[0, L, 0] = 0); with one, F[s, k, d] counts stages
    exactly and reads F[s - 1, j, ...]. The first minimum in (j, a) order wins: the
    stage takes the fewest layers, then the smallest submesh. Returns F and the chosen
    end layer and size index per (s, k, d). Cost O(L² · |sizes| · D) (· S with a limit),
    vectorised over (j, size, d): L numpy passes.
    """
    num_layers, count = capped_s.shape[1], len(sizes)
    by_depth = capped_s.shape[0] > 1
    pad = max(sizes)  # d - n < 0 reads the inf columns left of d = 0
    levels = 1 if stage_limit is None else stage_limit + 1
    sums_s = np.full((levels, num_layers + 1, pad + devices + 1), math.inf)
    sums_s[0, num_layers, pad] = 0.0
    end_choice = np.zeros((levels, num_layers, devices + 1), dtype=np.int64)
    size_choice = np.zeros_like(end_choice)
    columns = pad - np.asarray(sizes)[:, None] + np.arange(devices + 1)[None, :]  # (|sizes|, D + 1)
    source, target = (slice(None), slice(None)) if stage_limit is None else (slice(0, -1), slice(1, None))
    for start in range(num_layers - 1, -1, -1):
        allowed_s = capped_s[1:, start, start + 1:, :] if by_depth else capped_s[:1, start, start + 1:, :]
        rest_s = sums_s[source, start + 1:, :][:, :, columns]                       # (S', L - k, |sizes|, D + 1)
        totals_s = (allowed_s[:, :, :, None] + rest_s).reshape(rest_s.shape[0], -1, devices + 1)
        pick = totals_s.argmin(axis=1)                                              # (S', D + 1)
        sums_s[target, start, pad:] = totals_s.min(axis=1)
        end_choice[target, start] = start + 1 + pick // count
        size_choice[target, start] = pick % count
    return sums_s[:, :, pad:], end_choice, size_choice


def alpa_partition(num_layers: int, devices: int, submesh_sizes: Sequence[int], microbatches: int,
                   stage_time_s: Callable[..., float], *, stages: int | None = None,
                   max_stages: int | None = None, by_depth: bool = False) -> StagePlan:
    """Alpa's inter-operator DP: layer slices and submesh sizes minimising pipeline latency.

    Choose contiguous slices [i, j) covering 0..L-1 and a submesh size n per slice
    (from ``submesh_sizes``, summing to exactly ``devices``) minimising
    T = sum_s t_s + (m - 1) · max_s t_s with t_s = stage_time_s(i, j, n); math.inf
    marks an infeasible (slice, submesh), e.g. out of memory.

    As in Alpa, for a cap t_max from the distinct finite stage times a DP gives
    F(t_max), the least sum of stage times with every stage <= t_max, and
    min over caps of F(t_max) + (m - 1) · t_max is the optimal T. We visit fewer caps
    than Alpa's rising scan, with the same answer: the DP at cap c returns a plan of
    sum F(c) and bottleneck a <= c, so F is constant on [a, c] and the best objective
    there is that plan's own T; the next cap tried is the largest one below a. Caps c
    with F(inf) + (m - 1) · c >= the best T (Alpa's early stop), below the smallest
    feasible cap c_lo (binary search), or once F(c) + (m - 1) · c_lo >= the best T,
    cannot win and are skipped. ``latency_s`` is the true T of the returned plan.

    ``stages`` fixes the stage count, ``max_stages`` bounds it (default: any count up to
    min(L, devices // min(sizes))). stage_time_s is called once per (i, j, n) with
    n <= devices: L(L+1)/2 · |sizes| calls. Worst case O(#caps · L² · |sizes| · D), times
    the stage count when limited; in practice tens of DPs (~5-15 ms for L = 24, D = 16).

    ``by_depth``: the stage time also depends on the stage's depth s, the number of
    stages from it to the last (1 for the last): stage_time_s(i, j, n, s), as Alpa's
    t_intra((i, j), mesh, s) does, since under 1F1B that stage keeps min(s, m)
    micro-batches of activations in flight (its memory limit). The DP then counts
    stages (F[s, k, d], the limited form above) and calls stage_time_s once per
    (i, j, n, s): times the largest stage count.

    Ties: the first plan found wins (caps are visited from the largest down, so among
    equally fast plans it tends to have the smaller sum of stage times); within a DP
    each stage takes the fewest layers, then the smallest submesh, then fewest stages.
    """
    num_layers = _check_count("num_layers", num_layers)
    devices = _check_count("devices", devices)
    microbatches = _check_count("microbatches", microbatches)
    if not callable(stage_time_s):
        raise TypeError(f"stage_time_s={stage_time_s!r} must be callable as stage_time_s(i, j, n) -> seconds")
    if isinstance(submesh_sizes, (str, bytes)) or not hasattr(submesh_sizes, "__len__") or len(submesh_sizes) == 0:
        raise ValueError(f"submesh_sizes={submesh_sizes!r} must be a non-empty sequence of integers >= 1")
    sizes = tuple(_check_count(f"submesh_sizes[{k}]", n) for k, n in enumerate(submesh_sizes))
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"submesh_sizes={submesh_sizes!r} has repeats; list each size once")
    usable = tuple(sorted(n for n in sizes if n <= devices))
    if not usable:
        raise ValueError(f"no submesh in submesh_sizes={sizes} fits in devices={devices}; add a size <= {devices}")
    low, high = _stage_count_range(num_layers, devices, usable, stages, max_stages)
    reachable = [{0}]  # reachable[s]: device totals of s stages
    for _ in range(high):
        reachable.append({d + n for d in reachable[-1] for n in usable if d + n <= devices})
    if not any(devices in reachable[s] for s in range(low, high + 1)):
        raise ValueError(f"devices={devices} is not a sum of {low}..{high} submesh sizes from {usable} "
                         f"(every device must be used; num_layers={num_layers} caps the stage count); "
                         "add a size such as 1 or change devices")
    limited = by_depth or (low, high) != (1, min(num_layers, devices // usable[0]))
    times = _stage_time_table(num_layers, usable, stage_time_s, high if by_depth else None)
    caps_s = np.unique(times[np.isfinite(times)]).tolist()

    def best_plan(cap_s: float) -> StagePlan | None:
        """The DP's plan with every stage <= cap_s, or None if there is none."""
        sums_s, end_choice, size_choice = _dp_tables(np.where(times <= cap_s, times, math.inf), usable, devices,
                                                     high if limited else None)
        level = 0 if not limited else low + int(np.argmin(sums_s[low:high + 1, 0, devices]))
        if not math.isfinite(sums_s[level, 0, devices]):
            return None
        start, left, slices, chosen, stage_times_s = 0, devices, [], [], []
        while start < num_layers:
            end, index = int(end_choice[level, start, left]), int(size_choice[level, start, left])
            slices.append((start, end))
            chosen.append(usable[index])
            stage_times_s.append(float(times[level if by_depth else 0, start, end, index]))
            start, left, level = end, left - usable[index], level - (1 if limited else 0)
        assert left == 0 and level == 0, (left, level, slices, chosen)
        latency_s = sum(stage_times_s) + (microbatches - 1) * max(stage_times_s)
        return StagePlan(slices=tuple(slices), submesh_sizes=tuple(chosen), stage_times_s=tuple(stage_times_s),
                         latency_s=latency_s, microbatches=microbatches)

    top = best = best_plan(caps_s[-1]) if caps_s else None
    if top is None:
        rows, columns = np.triu_indices(num_layers, 1, num_layers + 1)
        listed_s = times[1:] if by_depth else times
        inf_options = int(np.isinf(listed_s[:, rows, columns]).sum())
        raise ValueError(f"no feasible plan for num_layers={num_layers}, devices={devices}, submesh sizes {usable}, "
                         f"stages {low}..{high}: every such plan has a stage with stage_time_s = inf ({inf_options} "
                         f"of {listed_s[:, rows, columns].size} (slice, submesh{', depth' if by_depth else ''}) "
                         "options are inf); "
                         "allow more devices, smaller stages or a lighter configuration")
    floor_s = sum(top.stage_times_s)  # F(inf): no plan has a smaller sum
    first, last = 0, len(caps_s) - 1  # the smallest feasible cap: feasibility is monotone in the cap
    while first < last:
        middle = (first + last) // 2
        plan = best_plan(caps_s[middle])
        if plan is None:
            first = middle + 1
        else:
            last = middle
            best = plan if plan.latency_s < best.latency_s else best
    lowest_cap_s, plan = caps_s[first], top  # caps above plan's bottleneck are done
    while microbatches > 1 and sum(plan.stage_times_s) + (microbatches - 1) * lowest_cap_s < best.latency_s:
        below_bottleneck = bisect_left(caps_s, plan.bottleneck_time_s) - 1
        below_early_stop = bisect_right(caps_s, (best.latency_s - floor_s) / (microbatches - 1)) - 1
        index = min(below_bottleneck, below_early_stop)
        if index < first:
            break
        plan = best_plan(caps_s[index])
        assert plan is not None, (index, first)
        if plan.latency_s < best.latency_s:
            best = plan
    return best
