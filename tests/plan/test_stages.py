"""Stage partitioners: minmax_partition and alpa_partition against brute force."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

from plait.plan.stages import StagePlan, alpa_partition, minmax_partition, partition_sums


# ----------------------------------------------------------------------------- minmax


def _compositions(num_layers: int, parts: int):
    """Every cut [0 < b_1 < ... < L] into ``parts`` non-empty slices."""
    for inner in itertools.combinations(range(1, num_layers), parts - 1):
        yield [0, *inner, num_layers]


def _random_costs(rng: random.Random, num_layers: int) -> list[float]:
    style = rng.randrange(3)
    if style == 0:  # integers: many ties
        return [rng.randint(0, 4) for _ in range(num_layers)]
    if style == 1:
        return [rng.uniform(0.0, 10.0) for _ in range(num_layers)]
    return [rng.choice([0.0, 0.1, 0.2, 0.3, 1e-3, 7.5]) for _ in range(num_layers)]


def test_minmax_hand_cases():
    assert max(partition_sums([1, 2, 3, 4, 5], minmax_partition([1, 2, 3, 4, 5], 2))) == 9
    assert minmax_partition([1, 2, 3, 4, 5], 2) == [0, 3, 5]
    assert minmax_partition([1.0] * 12, 4) == [0, 3, 6, 9, 12]
    assert minmax_partition([1.0] * 12, 12) == list(range(13))
    assert minmax_partition([5.0], 1) == [0, 1]
    # One huge layer: it is the bottleneck alone; the rest fill the other slices.
    cuts = minmax_partition([1, 1, 100, 1, 1, 1], 3)
    assert max(partition_sums([1, 1, 100, 1, 1, 1], cuts)) == 100
    assert cuts == [0, 2, 3, 6]  # element-wise smallest optimal cut
    assert minmax_partition([0, 0, 0, 0], 3) == [0, 1, 2, 4]


def test_minmax_equals_brute_force_and_is_elementwise_smallest():
    rng = random.Random(1234)
    for _ in range(400):
        num_layers = rng.randint(1, 10)
        parts = rng.randint(1, num_layers)
        costs = _random_costs(rng, num_layers)
        cuts = minmax_partition(costs, parts)
        assert len(cuts) == parts + 1 and cuts[0] == 0 and cuts[-1] == num_layers
        assert all(a < b for a, b in zip(cuts, cuts[1:]))
        bottleneck = max(partition_sums(costs, cuts))
        optimum = min(max(partition_sums(costs, c)) for c in _compositions(num_layers, parts))
        assert bottleneck == optimum, (costs, parts, cuts)
        optimal = [c for c in _compositions(num_layers, parts) if max(partition_sums(costs, c)) == optimum]
        assert cuts == [min(column) for column in zip(*optimal)], (costs, parts, cuts)


@pytest.mark.parametrize("costs, parts, fragment", [
    ([], 1, "non-empty"),
    ([1, 2], 0, "parts=0"),
    ([1, 2], 3, "parts=3"),
    ([1, -2], 1, "costs[1]=-2"),
    ([1, math.nan], 1, "costs[1]=nan"),
    ([math.inf], 1, "costs[0]=inf"),
    ([1, "a"], 1, "costs[1]='a'"),
    ([1e308, 1e308], 1, "overflows"),
])
def test_minmax_bad_inputs_name_the_value(costs, parts, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        minmax_partition(costs, parts)


def test_partition_sums_rejects_bad_boundaries():
    with pytest.raises(ValueError, match="boundaries"):
        partition_sums([1, 2, 3], [0, 2, 2, 3])


# ----------------------------------------------------------------------------- alpa


def _latency(times, microbatches):
    return sum(times) + (microbatches - 1) * max(times)


def _brute_force(num_layers, devices, sizes, microbatches, stage_time_s, stage_counts):
    """Least T over every cut of the layers and every size assignment summing to devices."""
    best = math.inf
    for parts in stage_counts:
        for cuts in _compositions(num_layers, parts):
            for assignment in itertools.product(sizes, repeat=parts):
                if sum(assignment) != devices:
                    continue
                times = [stage_time_s(a, b, n) for (a, b), n in zip(zip(cuts, cuts[1:]), assignment)]
                if all(math.isfinite(t) for t in times):
                    best = min(best, _latency(times, microbatches))
    return best


def _random_stage_time(rng: random.Random, num_layers: int, sizes, inf_probability: float):
    layer_costs = [rng.choice([1.0, 2.0, 3.0]) if rng.random() < 0.3 else rng.uniform(0.1, 3.0)
                   for _ in range(num_layers)]
    table = {}
    for start in range(num_layers):
        for end in range(start + 1, num_layers + 1):
            for size in sizes:
                if rng.random() < inf_probability:
                    table[start, end, size] = math.inf
                else:
                    table[start, end, size] = sum(layer_costs[start:end]) / size + rng.uniform(0.0, 0.5)
    return table


def _lookup(table):
    return lambda i, j, n: table[i, j, n]


def _check_plan(plan: StagePlan, num_layers, devices, microbatches, table):
    assert plan.slices[0][0] == 0 and plan.slices[-1][1] == num_layers
    assert sum(plan.submesh_sizes) == devices == plan.devices
    assert plan.stage_times_s == tuple(table[a, b, n] for (a, b), n in zip(plan.slices, plan.submesh_sizes))
    assert plan.latency_s == _latency(plan.stage_times_s, microbatches)
    assert plan.bottleneck_time_s == max(plan.stage_times_s)
    assert plan.microbatches == microbatches


def test_alpa_equals_brute_force_on_random_cases():
    rng = random.Random(2022)
    checked = 0
    for case in range(1500):
        num_layers, devices = rng.randint(1, 6), rng.randint(1, 7)
        sizes = rng.choice([(1,), (1, 2), (2,), (1, 2, 4), (2, 4), (1, 3), (3, 2)])
        microbatches = rng.choice([1, 2, 2, 3, 3, 4, 16, 1000])  # small m: sum and bottleneck trade off
        table = _random_stage_time(rng, num_layers, sizes, rng.choice([0.0, 0.1, 0.3, 0.6]))
        if rng.random() < 0.3:  # whole seconds: many equal stage times and sums
            table = {key: float(round(value)) if math.isfinite(value) else value for key, value in table.items()}
        calls = Counter()

        def stage_time_s(i, j, n):
            calls[i, j, n] += 1
            return table[i, j, n]

        most = min(num_layers, devices // min(sizes))
        mode = rng.randrange(3)
        limits, counts = {}, range(1, most + 1)
        if mode == 1:
            limits = {"stages": rng.randint(1, max(1, min(3, most)))}
            counts = [limits["stages"]]
        elif mode == 2:
            limits = {"max_stages": rng.randint(1, 4)}
            counts = range(1, min(most, limits["max_stages"]) + 1)
        expected = _brute_force(num_layers, devices, sizes, microbatches, _lookup(table), counts)
        try:
            plan = alpa_partition(num_layers, devices, sizes, microbatches, stage_time_s, **limits)
        except ValueError as error:
            assert expected == math.inf, (case, error)
            continue
        assert max(calls.values()) == 1
        assert len(calls) == num_layers * (num_layers + 1) // 2 * sum(n <= devices for n in sizes)
        _check_plan(plan, num_layers, devices, microbatches, table)
        assert plan.latency_s == pytest.approx(expected, rel=1e-12, abs=0), case
        assert plan.num_stages in counts
        checked += 1
    assert checked > 600


def test_alpa_max_stages_bounds_the_count():
    rng = random.Random(7)
    for _ in range(40):
        num_layers, devices, sizes, microbatches = 5, 4, (1, 2, 4), rng.choice([1, 8])
        table = _random_stage_time(rng, num_layers, sizes, 0.0)
        for limit in (1, 2, 3):
            plan = alpa_partition(num_layers, devices, sizes, microbatches, _lookup(table), max_stages=limit)
            assert plan.num_stages <= limit
            expected = _brute_force(num_layers, devices, sizes, microbatches, _lookup(table), range(1, limit + 1))
            assert plan.latency_s == pytest.approx(expected, rel=1e-12, abs=0)


def test_alpa_single_microbatch_minimises_the_sum():
    # m = 1: T = sum of stage times, so one stage on every device wins when splitting adds overhead.
    def stage_time_s(i, j, n):
        return (j - i) / n + 0.25
    plan = alpa_partition(6, 4, (1, 2, 4), 1, stage_time_s)
    assert plan.slices == ((0, 6),) and plan.submesh_sizes == (4,)
    assert plan.latency_s == 6 / 4 + 0.25


def test_alpa_many_microbatches_prefer_balanced_stages():
    # Tensor parallelism scales as sqrt(n): one 4-device stage is 2.1 s, four 1-device stages 1.1 s each.
    def stage_time_s(i, j, n):
        return (j - i) / math.sqrt(n) + 0.1
    few = alpa_partition(4, 4, (1, 4), 1, stage_time_s)
    assert few.slices == ((0, 4),) and few.latency_s == pytest.approx(2.1)
    many = alpa_partition(4, 4, (1, 4), 32, stage_time_s)
    assert many.slices == ((0, 1), (1, 2), (2, 3), (3, 4)) and many.submesh_sizes == (1, 1, 1, 1)
    assert many.latency_s == pytest.approx(4 * 1.1 + 31 * 1.1) and many.latency_s < 32 * 2.1


def test_alpa_with_one_device_stages_matches_minmax():
    rng = random.Random(99)
    for _ in range(30):
        costs = [rng.uniform(0.5, 2.0) for _ in range(rng.randint(2, 9))]
        parts = rng.randint(1, len(costs))
        prefix = list(itertools.accumulate(costs, initial=0.0))
        plan = alpa_partition(len(costs), parts, (1,), 10**6, lambda i, j, n: prefix[j] - prefix[i])
        assert plan.bottleneck_time_s == pytest.approx(max(partition_sums(costs, minmax_partition(costs, parts))))


def test_alpa_infeasible_cases_say_why():
    with pytest.raises(ValueError, match=r"every such plan has a stage with stage_time_s = inf"):
        alpa_partition(3, 2, (1, 2), 4, lambda i, j, n: math.inf)
    # Only (0, 2) on 2 devices would fit, but layer 2 needs a stage too.
    with pytest.raises(ValueError, match="inf"):
        alpa_partition(3, 2, (1, 2), 4, lambda i, j, n: 1.0 if (i, j, n) == (0, 2, 2) else math.inf)
    with pytest.raises(ValueError, match=r"devices=5 is not a sum of 1\.\.2 submesh sizes from \(2, 4\)"):
        alpa_partition(4, 5, (2, 4), 4, lambda i, j, n: 1.0)
    with pytest.raises(ValueError, match=r"devices=5 is not a sum"):
        alpa_partition(2, 5, (1, 2), 4, lambda i, j, n: 1.0)  # 2 layers: at most 2 stages, at most 4 devices
    with pytest.raises(ValueError, match=r"no submesh in submesh_sizes=\(8,\) fits in devices=4"):
        alpa_partition(4, 4, (8,), 4, lambda i, j, n: 1.0)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(num_layers=0), "num_layers=0"),
    (dict(devices=0), "devices=0"),
    (dict(microbatches=0), "microbatches=0"),
    (dict(submesh_sizes=()), "submesh_sizes=()"),
    (dict(submesh_sizes=(1, 0)), r"submesh_sizes\[1\]=0"),
    (dict(submesh_sizes=(2, 2)), "repeats"),
    (dict(stages=0), "stages=0"),
    (dict(stages=5), "stages=5 > num_layers=4"),
    (dict(stages=3, submesh_sizes=(2,)), "stages=3 needs at least"),
    (dict(max_stages=0), "max_stages=0"),
    (dict(stages=2, max_stages=2), "not both"),
])
def test_alpa_bad_arguments_name_the_value(kwargs, fragment):
    arguments = dict(num_layers=4, devices=4, submesh_sizes=(1, 2), microbatches=4,
                     stage_time_s=lambda i, j, n: 1.0)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")
                       if "\\" not in fragment else fragment):
        alpa_partition(**arguments)


def test_alpa_rejects_bad_stage_times():
    with pytest.raises(ValueError, match=r"stage_time_s\(0, 1, 1\) = -1\.0"):
        alpa_partition(2, 1, (1,), 1, lambda i, j, n: -1.0)
    with pytest.raises(TypeError, match="returned None"):
        alpa_partition(2, 1, (1,), 1, lambda i, j, n: None)


def test_stage_plan_bottleneck_and_validation():
    plan = StagePlan(slices=((0, 2), (2, 3)), submesh_sizes=(1, 1), stage_times_s=(1.0, 3.0),
                     latency_s=4.0 + 3 * 3.0, microbatches=4)
    assert plan.bottleneck_stage == 1 and plan.num_stages == 2 and plan.devices == 2
    with pytest.raises(ValueError, match="contiguous"):
        StagePlan(slices=((0, 2), (3, 4)), submesh_sizes=(1, 1), stage_times_s=(1.0, 1.0),
                  latency_s=2.0, microbatches=1)
