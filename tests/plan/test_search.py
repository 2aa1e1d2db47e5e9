"""The search: its best plan is the brute-force optimum, it never returns a plan over
the memory limit, it honours fixed choices, and it says why when nothing fits."""

from __future__ import annotations

import itertools
import json

import pytest

from plait.plan import (Layout, PlanError, cluster_preset, estimate_layout, explain, model_preset, plan, table)
from plait.plan.search import DIMENSIONS

GIB = 1 << 30


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _brute_force(spec, cluster, batch, limit):
    """Every layout enumerated independently of the search, priced one by one."""
    best = None
    world = cluster.world_size
    for tp, pp in itertools.product(_divisors(world), repeat=2):
        if world % (tp * pp) or spec.tensor_parallel_problem(tp) or pp > spec.layers:
            continue
        dp = world // (tp * pp)
        if batch % dp:
            continue
        for mb in _divisors(batch // dp):
            m = batch // (dp * mb)
            schedules = [("none", 1)] if pp == 1 else [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2),
                                                       ("interleaved_1f1b", 4), ("interleaved_1f1b", 8),
                                                       ("zero_bubble", 1), ("chimera", 1)]
            zeros = [0] if dp == 1 else ([0, 1] if pp > 1 else [0, 1, 2, 3])
            for (schedule, v), rc, zero, sp in itertools.product(schedules, ("none", "selective", "full"), zeros,
                                                                 (False, True) if tp > 1 else (False,)):
                if schedule == "interleaved_1f1b" and (m % pp or pp * v > spec.layers):
                    continue
                if schedule in ("zero_bubble", "chimera") and pp > 8:
                    continue
                if schedule == "chimera" and (pp % 2 or m % 2 or 2 * m * pp > 256):
                    continue
                layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, num_microbatches=m, schedule=schedule,
                                virtual=v, recompute=rc, zero_stage=zero, sequence_parallel=sp)
                result = estimate_layout(spec, cluster, layout)
                if result.memory_per_gpu_bytes <= limit and (best is None or result.step_time_s < best.step_time_s):
                    best = result
    return best


@pytest.mark.parametrize("limit_gib", [80, 6, 3])
def test_the_best_plan_is_the_brute_force_optimum_within_memory(limit_gib):
    spec = model_preset("gpt-350m")
    cluster = cluster_preset("dgx-a100", gpus=8)
    limit = limit_gib * GIB
    result = plan(spec, cluster, global_batch=16, memory_limit_bytes=limit, max_micro_batch=64, top=2000)
    expected = _brute_force(spec, cluster, 16, limit)
    assert result.best.step_time_s == pytest.approx(expected.step_time_s, rel=1e-12)
    assert all(p.memory_per_gpu_bytes <= limit for p in result.plans)
    assert [p.step_time_s for p in result.plans] == sorted(p.step_time_s for p in result.plans)
    assert result.feasible == len(result.plans)


def test_fixed_choices_are_honoured_and_the_rest_searched():
    result = plan("gpt-1.3b", "dgx-a100", gpus=16, global_batch=64, tp=2, schedule="gpipe", recompute="full", top=50)
    assert result.plans
    for p in result.plans:
        assert (p.layout.tp, p.layout.schedule, p.layout.recompute) == (2, "gpipe", "full")
        assert p.layout.pp > 1 and p.layout.devices == 16 and p.layout.global_batch == 64
    assert len({p.layout.pp for p in result.plans}) > 1  # pp still searched
    assert "(fixed by the request)" in "\n".join(explain(result))


def test_the_explanation_covers_every_choice():
    result = plan("gpt-13b", "dgx-a100", gpus=64, global_batch=256)
    lines = explain(result)
    text = "\n".join(lines)
    for label in ("tp =", "pp =", "dp =", "micro-batch =", "schedule =", "recompute =", "ZeRO stage =",
                  "sequence parallel ="):
        assert label in text
    assert lines[0] == f"best: {result.best.layout.text()}"
    assert "x slower" in text and "searched" in lines[-1]
    assert len(table(result)) == len(result.plans) + 1
    # the parts add up to the step
    assert sum(result.best.time_s.values()) == pytest.approx(result.best.step_time_s, rel=1e-12)


def test_json_is_stable():
    result = plan("gpt-1.3b", "dgx-h100", gpus=8, global_batch=32, top=3)
    document = json.loads(json.dumps(result.as_json()))
    assert [d["rank"] for d in document] == [1, 2, 3]
    for key in ("tp", "pp", "dp", "micro_batch", "num_microbatches", "schedule", "recompute", "zero_stage",
                "step_time_s", "tflops_per_gpu", "percent_of_peak", "memory_per_gpu_bytes", "virtual",
                "sequence_parallel", "mfu", "time_breakdown_s", "memory_breakdown_bytes"):
        assert key in document[0]


def test_a_model_too_big_says_how_much_is_missing_and_what_would_fit():
    with pytest.raises(PlanError) as error:
        plan("gpt-76b", "dgx-a100", gpus=8, global_batch=64)
    text = str(error.value)
    assert "GiB more than the 72.0 GiB available" in text
    assert "would fit it" in text and "devices" in text


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp=3), "tp=3 does not divide the 8 devices"),
    (dict(tp=8, model="gpt-125m-heads"), None),
    (dict(pp=32), "pp=32 does not divide the 8 devices"),
    (dict(tp=2, pp=2, dp=4), r"tp\(2\) \* pp\(2\) \* dp\(4\) = 16 != devices\(8\)"),
    (dict(dp=8, global_batch=12), "global batch 12 is not divisible by dp=8"),
    (dict(schedule="gpipe", pp=1), "needs pp > 1"),
])
def test_invalid_degrees_name_the_rule(kwargs, message):
    kwargs = dict(kwargs)
    if kwargs.pop("model", None):
        # 12 heads: tp=8 does not divide them
        with pytest.raises(PlanError, match="tp=8 does not divide heads=12"):
            plan("gpt-125m", "dgx-a100", gpus=8, global_batch=16, **kwargs)
        return
    with pytest.raises(PlanError, match=message):
        plan("gpt-125m", "dgx-a100", gpus=8, global_batch=kwargs.pop("global_batch", 16), **kwargs)


def test_unknown_presets_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown cluster 'dgx-z'; valid: dgx-a100"):
        cluster_preset("dgx-z", gpus=8)
    with pytest.raises(ValueError, match="unknown model preset"):
        plan("gpt-2t", "dgx-a100", gpus=8, global_batch=8)
    with pytest.raises(ValueError, match="not a whole number of dgx-a100 nodes"):
        cluster_preset("dgx-a100", gpus=12)


def test_dimensions_are_all_tallied():
    result = plan("gpt-125m", "dgx-a100", gpus=8, global_batch=16)
    assert {d for d, _ in result.tallies} == set(DIMENSIONS)


def test_an_uneven_traced_model_is_split_by_alpa():
    """An uneven model on a 2-stage pipeline is cut where Σ t + (m-1)·max t is least,
    boundary transfers included: not in the middle, where the min-max cut of the layer
    times would go, because the activation there is huge (brute force over the cut)."""
    from plait.cost import LinkModel
    from plait.plan import LayerCost, ModuleModel
    from plait.plan.cluster import Cluster
    from plait.plan.device import DeviceSpec

    device = DeviceSpec(name="unit", peak_flops_per_s=(("float32", 1.0),), memory_bytes=1e18,
                        memory_bandwidth_bytes_per_s=1e30, matmul_efficiency=1.0, memory_efficiency=1.0,
                        kernel_overhead_s=0.0)
    link = LinkModel(0.0, 1e-9)  # 1 GB/s: a 1e10-byte activation takes 10 s each way
    cluster = Cluster(name="unit", nodes=1, devices_per_node=2, device=device, intra_link=link, inter_link=link)
    costs, outputs = [1, 1, 1, 1], [4, 1e10, 4, 4]
    model = ModuleModel(name="uneven", traced_batch=1, layers=tuple(
        LayerCost(name=f"l{i}", forward_flops=c, backward_flops=2 * c, output_bytes=o)
        for i, (c, o) in enumerate(zip(costs, outputs))))
    m = 4
    result = plan(model, cluster, global_batch=m, pp=2, micro_batch=1, schedule="1f1b", top=1, precision="fp32")

    def latency(k):
        transfer = outputs[k - 1] * 1e-9
        a, b = 3 * sum(costs[:k]) + transfer, 3 * sum(costs[k:]) + transfer
        return a + b + (m - 1) * max(a, b)

    assert min(range(1, 4), key=latency) != 2
    assert result.best.step_time_s == pytest.approx(min(latency(k) for k in range(1, 4)))
    assert len(result.best.stage_layers[0]) != 2


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp=4, pp=4), r"tp\(4\) \* pp\(4\) = 16 does not divide the 8 devices"),
    (dict(pp=2, dp=8), r"pp\(2\) \* dp\(8\) = 16 does not divide the 8 devices"),
    (dict(micro_batch=5), "micro_batch=5 divides no per-replica batch.*valid micro-batches: 1, 2, 4, 8, 16"),
    (dict(virtual=1, schedule="interleaved_1f1b"), "virtual=1: interleaving needs at least 2"),
    (dict(virtual=2, pp=1), "pp=1 has none"),
    (dict(virtual=8, pp=4), r"pp\(4\) \* virtual\(8\) = 32 chunks exceed the model's 12 layers"),
])
def test_impossible_fixed_choices_are_named(kwargs, message):
    with pytest.raises(PlanError, match=message):
        plan("gpt-125m", "dgx-a100", gpus=8, global_batch=16, **kwargs)


def test_virtual_alone_means_interleaved():
    result = plan("gpt-1.3b", "dgx-a100", gpus=16, global_batch=64, virtual=4, top=20)
    assert all(p.layout.schedule == "interleaved_1f1b" and p.layout.virtual == 4 and p.layout.pp > 1
               for p in result.plans)


def test_the_default_memory_limit_keeps_a_reserve():
    result = plan("gpt-13b", "dgx-a100", gpus=16, global_batch=64)
    assert result.memory_limit_bytes == pytest.approx(0.9 * 80 * GIB)
    assert all(p.memory_per_gpu_bytes <= 0.9 * 80 * GIB for p in result.plans)
    explained = "\n".join(explain(result))
    assert "at best with" in explained  # alternatives name the choices they differ in


def test_a_traced_model_is_priced_in_the_planned_precision():
    from plait.plan import LayerCost, ModuleModel

    layer = LayerCost(name="l", forward_flops=10.0, backward_flops=20.0, activation_bytes=400.0, output_bytes=40.0,
                      forward_bytes=80.0)
    model = ModuleModel(name="m", layers=(layer, layer), traced_batch=2, traced_element_bytes=4)
    from plait.plan.precision import PRECISIONS

    half = model.groups(4, 1, False, PRECISIONS["bf16-mixed"], "plait")[0][0].cost
    assert (half.activation_bytes, half.output_bytes, half.forward_bytes) == (400.0, 40.0, 80.0)  # x2 batch, /2 dtype
    assert half.forward_flops == 20.0


def test_the_search_holds_only_the_top_plans_and_the_tallies(monkeypatch):
    """Every priced layout is dropped unless it is among the ``top`` best or some
    dimension value's best or closest: the search never keeps all feasible estimates."""
    import sys
    import weakref

    search_module = sys.modules["plait.plan.search"]  # plait.plan.search is also the function

    alive, most = [], [0]
    price = search_module.estimate

    def tracked(*args, **kwargs):
        result = price(*args, **kwargs)
        alive[:] = [ref for ref in alive if ref() is not None]
        most[0] = max(most[0], len(alive))
        alive.append(weakref.ref(result))
        return result

    monkeypatch.setattr(search_module, "estimate", tracked)
    result = plan("gpt-1.3b", "dgx-a100", gpus=16, global_batch=128, top=3)
    held = result.request.top + 2 * len(result.tallies)
    assert result.feasible > 10 * held
    assert most[0] <= held, (most[0], held)


@pytest.mark.parametrize("kwargs,message", [
    (dict(global_batch=1 << 40), "global_batch=1,099,511,627,776 is above the limit of 4,294,967,296"),
    (dict(max_micro_batch=1 << 20), "max_micro_batch=1,048,576 is above the limit of 65,536"),
    (dict(top=10 ** 6), "top=1,000,000 is above the limit of 10,000: ask for at most 10,000 plans"),
    (dict(max_layouts=0), "max_layouts=0 must be a whole number >= 1"),
    (dict(max_layouts=-5), "max_layouts=-5 must be a whole number >= 1"),
])
def test_absurd_requests_are_refused_naming_the_limit(kwargs, message):
    from plait.plan import PlanRequest

    with pytest.raises(ValueError, match=message):
        PlanRequest(**{"global_batch": 64, **kwargs})


def test_a_model_with_absurdly_many_layers_is_refused_before_any_pricing():
    """--layers 100000000 ran out of memory building per-layer costs."""
    from plait.plan import PlanError, PlanRequest, TransformerModel, TransformerSpec, cluster_preset
    from plait.plan.search import MAX_LAYER_GROUPS, search

    model = TransformerModel(TransformerSpec(layers=100_000_000, hidden=1024, heads=16, seq_len=2048, vocab=51200))
    with pytest.raises(PlanError, match=f"100,000,000 layers are above the planner's limit of {MAX_LAYER_GROUPS:,}"):
        search(model, cluster_preset("dgx-a100", gpus=8), PlanRequest(global_batch=8))
