"""The estimate's overlap model: exposed parts add up to the step, hidden time is
what ran under compute, the host's sync wait and CPU share land in the right part.
Tolerances: float64 rounding of sums of a few hundred terms (1e-12 relative)."""

from __future__ import annotations

import pytest

from plait.cost import LinkModel
from plait.cost.alpha_beta import level_terms
from plait.names.step_parts import DP_COMM, PRICED_PARTS, TP_COMM
from plait.plan import Layout, cluster_preset, device_preset, estimate_layout, model_preset
from plait.plan.estimate import _unit_costs, estimate
from plait.plan.models import TransformerModel
from plait.plan.precision import precision_for
from plait.plan.host import HostModel
from plait.plan.overlap import GRADIENT_BUCKET_BYTES, bucket_count, cpu_share
from plait.names.schedules import ZERO_BUBBLE

EXACT = 1e-12
LINK = LinkModel(2e-5, 1e-9, 5e-10)  # a shared-memory-like link: 20 us per round, 1 GB/s, reductions 2 GB/s


def _local(host: HostModel | None, nprocs: int = 4):
    return cluster_preset("local", nprocs=nprocs, device=device_preset("a100-80gb"), local_link=LINK,
                          call_overhead_s=1e-4, host=host)


LAYOUTS = [dict(dp=4), dict(dp=4, zero_stage=1), dict(dp=4, zero_stage=2, num_microbatches=3),
           dict(dp=4, zero_stage=3, num_microbatches=2), dict(dp=2, tp=2, zero_stage=2, num_microbatches=2),
           dict(dp=2, pp=2, zero_stage=2, num_microbatches=4, schedule="1f1b"),
           dict(tp=2, pp=2, num_microbatches=4, schedule="1f1b", recompute="full")]


@pytest.mark.parametrize("host", [None, HostModel(ranks=4, cores=2, sync_wait_s=1e-3, sync_wait_per_compute=0.05)])
def test_exposed_parts_add_up_to_the_step_and_hidden_is_apart(host):
    """Σ time_s = step_time_s (exactly, up to rounding) on every layout, with and
    without a host model and with dp_overlap; hidden_s has the same keys, is >= 0, and
    is in as_dict."""
    spec = model_preset("gpt-125m")
    for fields in LAYOUTS:
        for dp_overlap in (False, True) if fields.get("zero_stage", 0) == 0 else (False,):
            layout = Layout(micro_batch=1, **{"num_microbatches": 1, **fields})
            result = (_with_dp_overlap if dp_overlap else estimate_layout)(spec, _local(host), layout)
            assert sum(result.time_s.values()) == pytest.approx(result.step_time_s, rel=EXACT), fields
            assert set(result.hidden_s) == set(PRICED_PARTS) and min(result.hidden_s.values()) >= 0
            assert result.as_dict()["hidden_breakdown_s"] == result.hidden_s


def _with_dp_overlap(spec, cluster, layout):
    """estimate() with dp_overlap=True over the groups estimate_layout prices."""
    chosen, spec = precision_for("bf16-mixed", "megatron"), TransformerModel(spec)
    groups = spec.groups(layout.micro_batch, layout.tp, layout.sequence_parallel, chosen, "megatron")
    return estimate(groups, layout, cluster, chosen, model_flops=spec.training_flops(layout.global_batch, "none"),
                    hardware_flops=spec.training_flops(layout.global_batch, layout.recompute),
                    tied_embedding_params=spec.tied_embedding_params(layout.tp), end_modules=spec.end_modules,
                    dp_overlap=True)


def test_data_parallel_overlap_prices_plait_dataparallel_buckets():
    """dp_overlap=True (plait's DataParallel): ZeRO 0's all-reduce volume in 25 MiB
    buckets, exposed + hidden = U·AR(grad/U), exposed = the last backward's tail.
    plait train prices the same (its buckets go during the backward) but under zero
    bubble and Chimera, where it all-reduces after the flush: nothing hidden, more
    exposed than dp_overlap=True prices on the same layout."""
    spec = model_preset("gpt-125m")
    layout = Layout(dp=4, micro_batch=1, num_microbatches=2)
    cluster = _local(None)
    trainer = estimate_layout(spec, cluster, layout)
    overlapped = _with_dp_overlap(spec, cluster, layout)
    assert trainer.time_s == overlapped.time_s and trainer.hidden_s == overlapped.hidden_s
    grad_bytes = overlapped.memory_bytes["gradients"]
    units = bucket_count(grad_bytes)
    bucket, _ = cluster.collective_time_s("all_reduce", grad_bytes / units, 4, 1)
    assert units > 1
    assert overlapped.time_s[DP_COMM] + overlapped.hidden_s[DP_COMM] == pytest.approx(units * bucket, rel=EXACT)
    assert overlapped.hidden_s[DP_COMM] > 0
    zero_bubble = Layout(dp=4, pp=2, micro_batch=1, num_microbatches=2, schedule=ZERO_BUBBLE)
    after_flush = estimate_layout(spec, _local(None, nprocs=8), zero_bubble)
    forced = _with_dp_overlap(spec, _local(None, nprocs=8), zero_bubble)
    assert after_flush.hidden_s[DP_COMM] == 0 < forced.hidden_s[DP_COMM]
    assert forced.time_s[DP_COMM] < after_flush.time_s[DP_COMM]
    assert forced.step_time_s - forced.time_s[DP_COMM] == pytest.approx(
        after_flush.step_time_s - after_flush.time_s[DP_COMM], rel=EXACT)
    for stage in (1, 2, 3):  # DataParallel's buckets are ZeRO 0's: refused by name above it
        with pytest.raises(ValueError, match=rf"dp_overlap=True with zero_stage={stage}: .* use zero_stage=0"):
            _with_dp_overlap(spec, cluster, Layout(dp=4, micro_batch=1, num_microbatches=2, zero_stage=stage))


def test_zero_two_hides_its_reductions_and_a_host_with_no_spare_core_gives_their_cpu_share_back():
    """ZeRO 2 on 4 ranks: the same exposed + hidden total on a host with spare cores
    (8 cores) and on one with none (2 cores); with none, phi = cpu_share of the
    bucket's reduce-scatter moves from hidden to exposed: exposed' = exposed + phi·hidden,
    hidden' = (1 - phi)·hidden."""
    spec = model_preset("gpt-125m")
    layout = Layout(dp=4, micro_batch=1, num_microbatches=4, zero_stage=2)
    spare = _local(HostModel(ranks=4, cores=8))
    busy = _local(HostModel(ranks=4, cores=2))
    free = estimate_layout(spec, spare, layout)
    shared = estimate_layout(spec, busy, layout)
    assert free.hidden_s[DP_COMM] > 0
    grad_bytes = free.memory_bytes["gradients"] * 4
    units = bucket_count(grad_bytes)
    phi = cpu_share(busy, "reduce_scatter", grad_bytes / units, 4, 1)
    assert 0 < phi < 1
    assert cpu_share(spare, "reduce_scatter", grad_bytes / units, 4, 1) == 0.0
    assert shared.time_s[DP_COMM] == pytest.approx(free.time_s[DP_COMM] + phi * free.hidden_s[DP_COMM], rel=EXACT)
    assert shared.hidden_s[DP_COMM] == pytest.approx((1 - phi) * free.hidden_s[DP_COMM], rel=EXACT)
    # phi by hand: R rounds of alpha are waiting, the rest of the priced time is CPU work
    seconds, algorithm = busy.collective_time_s("reduce_scatter", grad_bytes / units, 4, 1)
    rounds = sum(terms.rounds for _, terms in level_terms("reduce_scatter", algorithm, grad_bytes / units, 4))
    assert phi == pytest.approx(1 - rounds * LINK.alpha_s / seconds, rel=EXACT)
    assert GRADIENT_BUCKET_BYTES == 25 << 20
    # with a sync wait per call, the wait lengthens each hidden call but is not CPU work: the share exposed is
    # phi of the priced time over the call's whole time
    waits = dict(sync_wait_s=3e-4, sync_wait_per_compute=0.0)
    free = estimate_layout(spec, _local(HostModel(ranks=4, cores=8, **waits)), layout)
    busy = _local(HostModel(ranks=4, cores=2, **waits))
    shared = estimate_layout(spec, busy, layout)
    share = phi * seconds / (seconds + busy.sync_wait_s(4, 1.0))  # no per-compute term: any segment > 0
    assert shared.time_s[DP_COMM] == pytest.approx(free.time_s[DP_COMM] + share * free.hidden_s[DP_COMM], rel=EXACT)


def test_each_synchronising_call_waits_for_the_slowest_rank():
    """A host model's sync wait is added per call: tp = 2 over 12 layers, 4 calls per
    layer (two all-reduces forward, two backward) and 4 for the embedding and head,
    m = 2 micro-batches: tp_comm grows by m·52 waits; ZeRO 0 over dp = 2 adds one wait
    per bucket (exposed + hidden); on GPUs (no host model) tp's synchronous calls hide
    nothing, the dp buckets of the last backward do."""
    spec = model_preset("gpt-125m")
    layout = Layout(tp=2, dp=2, micro_batch=1, num_microbatches=2)
    host = HostModel(ranks=4, cores=2, sync_wait_s=2e-3, sync_wait_per_compute=0.0)
    plain = estimate_layout(spec, _local(HostModel(ranks=4, cores=2)), layout)
    waiting = estimate_layout(spec, _local(host), layout)
    cluster = _local(host)
    per_call = cluster.sync_wait_s(2, 1.0)  # no per-compute term: any segment
    groups = TransformerModel(spec).groups(1, 2, False, precision_for("bf16-mixed", "megatron"), "megatron")
    calls = sum(len(unit.comm.forward) + len(unit.comm.backward) for group in groups for unit in group)
    assert calls == spec.layers * 4 + 4  # the blocks' four, the vocabulary-parallel embedding's and head's
    assert waiting.time_s[TP_COMM] - plain.time_s[TP_COMM] == pytest.approx(2 * calls * per_call, rel=1e-9)
    buckets = bucket_count(waiting.memory_bytes["gradients"])
    assert (waiting.time_s[DP_COMM] + waiting.hidden_s[DP_COMM]) - (plain.time_s[DP_COMM] + plain.hidden_s[DP_COMM]) \
        == pytest.approx(buckets * per_call, rel=1e-9)
    gpu = estimate_layout(spec, "dgx-a100", layout, gpus=4)
    assert gpu.hidden_s[TP_COMM] == 0 and gpu.hidden_s[DP_COMM] > 0  # tp synchronous, ZeRO 0 during the backward


def test_full_recompute_spreads_the_sync_waits_over_the_recomputed_forward_too():
    """A tp block's synchronous calls each wait b·segment (HostModel with a = 0, b = 0.1,
    measured at the group's size: no scaling), the segment being the block's compute over
    its calls. Under full recompute the block's compute holds the recomputed forward and
    its calls the recomputed forward's: the waits add up to b x the whole compute (forward
    twice + backward), with or without recompute. float64: rel 1e-12."""
    chosen = precision_for("fp32", "plait")
    model = TransformerModel(model_preset("gpt-125m"))
    block = model.groups(1, 2, False, chosen, "plait")[1][0]
    assert block.recomputable and block.comm.recompute, "a block re-runs its forward's tp calls"
    waits = HostModel(ranks=2, cores=1, sync_wait_s=0.0, sync_wait_per_compute=0.1)
    bare = cluster_preset("local", nprocs=2, device=device_preset("a100-80gb"), local_link=LINK, call_overhead_s=1e-4)
    host = cluster_preset("local", nprocs=2, device=device_preset("a100-80gb"), local_link=LINK, call_overhead_s=1e-4,
                          host=waits)
    for recompute in ("none", "full"):
        plain = _unit_costs(block, 2, recompute, bare, chosen.dtype, {})
        waited = _unit_costs(block, 2, recompute, host, chosen.dtype, {})
        assert waited.compute_s == plain.compute_s
        assert waited.tp_comm_s - plain.tp_comm_s == pytest.approx(0.1 * plain.compute_s, rel=EXACT), recompute
