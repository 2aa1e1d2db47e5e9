"""One layout priced: the pipeline time against plait's own schedules replayed, the
activations in flight against the schedules, ZeRO's memory, the collectives' prices."""

from __future__ import annotations

import dataclasses

import pytest

from plait.cost import LinkModel
from plait.cost.alpha_beta import predict_time_s
from plait.parallel.pipeline.replay import peak_in_flight, replay
from plait.parallel.pipeline.schedules import build
from plait.plan import Layout, cluster_preset, estimate_layout, model_preset
from plait.plan.cluster import Cluster
from plait.plan.device import DeviceSpec
from plait.plan.estimate import Unit, estimate, in_flight
from plait.plan.precision import PRECISIONS, precision_for
from plait.plan.layers import LayerCost
from plait.plan.overlap import bucket_count
from plait.plan.transformer import TensorParallelComm

# a device where one FLOP takes one second and nothing else costs anything, and links
# that cost nothing, so an estimate is pure schedule arithmetic
UNIT_DEVICE = DeviceSpec(name="unit", peak_flops_per_s=(("float32", 1.0),), memory_bytes=1e18,
                         memory_bandwidth_bytes_per_s=1e30, matmul_efficiency=1.0, memory_efficiency=1.0,
                         kernel_overhead_s=0.0)
FREE_LINK = LinkModel(0.0, 1e-30)


def _cluster(devices: int) -> Cluster:
    return Cluster(name="unit", nodes=1, devices_per_node=devices, device=UNIT_DEVICE, intra_link=FREE_LINK,
                   inter_link=FREE_LINK)


def _uniform_groups(count: int, forward_s: float) -> list[list[Unit]]:
    cost = LayerCost(name="layer", forward_flops=forward_s, backward_flops=2 * forward_s)
    return [[Unit(cost, TensorParallelComm(), True)] for _ in range(count)]


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 7, 1),
                                           ("1f1b", 4, 4, 1), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 2, 6, 3),
                                           ("interleaved_1f1b", 4, 4, 2), ("none", 1, 5, 1)])
def test_pipeline_time_is_the_replayed_schedule(schedule, p, m, v):
    """Uniform stages, free links: the estimate's step equals the makespan of plait's
    own schedule replayed with each rank's forward and backward times."""
    layers = p * v * 2
    groups = _uniform_groups(layers, 1.0)
    layout = Layout(pp=p, num_microbatches=m, schedule=schedule, virtual=v)
    result = estimate(groups, layout, _cluster(p), PRECISIONS["fp32"], model_flops=1.0, hardware_flops=1.0)
    per_rank_forward = layers / p
    if schedule == "none":
        expected = m * 3 * per_rank_forward
    else:
        name = "interleaved_1f1b" if schedule == "interleaved_1f1b" else schedule
        expected = replay(build(name, p, m, v if v > 1 else None), forward=per_rank_forward,
                          backward=2 * per_rank_forward).makespan_s
    assert result.step_time_s == pytest.approx(expected, rel=1e-12)
    bubble = (p - 1) / v / (m + (p - 1) / v)  # DESIGN §6
    assert result.time_s["pp_bubble"] / result.step_time_s == pytest.approx(bubble, rel=1e-12)


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("1f1b", 4, 2, 1),
                                           ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 3, 3, 2),
                                           ("interleaved_1f1b", 2, 4, 4)])
def test_in_flight_matches_the_schedules(schedule, p, m, v):
    name = "interleaved_1f1b" if schedule == "interleaved_1f1b" else schedule
    peaks = peak_in_flight(build(name, p, m, v if v > 1 else None))
    layout = Layout(pp=p, num_microbatches=m, schedule=schedule, virtual=v)
    assert [in_flight(layout, r) * v for r in range(p)] == peaks


def test_uneven_stages_are_balanced_and_priced_by_the_slowest():
    """Six layers of costs 1, 1, 1, 1, 1, 5 on two stages: the min-max split puts the
    heavy layer alone on the second stage, the other five on the first (both 5); then
    T = Σ t + (m-1)·max t with t = forward + backward = 3 x 5."""
    costs = [1, 1, 1, 1, 1, 5]
    groups = [[Unit(LayerCost(name=f"l{i}", forward_flops=c, backward_flops=2 * c), TensorParallelComm(), True)]
              for i, c in enumerate(costs)]
    layout = Layout(pp=2, num_microbatches=4, schedule="1f1b")
    result = estimate(groups, layout, _cluster(2), PRECISIONS["fp32"], model_flops=1.0, hardware_flops=1.0)
    assert result.stage_layers == [[0, 1, 2, 3, 4], [5]]
    t = [3 * 5, 3 * 5]
    assert result.step_time_s == pytest.approx(sum(t) + 3 * max(t))


@pytest.mark.parametrize("zero,divisors", [(0, (1, 1, 1)), (1, (1, 1, 8)), (2, (1, 8, 8)), (3, (8, 8, 8))])
def test_zero_stages_shard_the_model_states(zero, divisors):
    """ZeRO (Rajbhandari et al.): 2 + 2 + 12 bytes per parameter, the optimizer states
    sharded from stage 1, the gradients from 2, the parameters from 3."""
    spec = model_preset("gpt-1.3b")
    layout = Layout(dp=8, micro_batch=1, num_microbatches=2, zero_stage=zero)
    result = estimate_layout(spec, "dgx-a100", layout, gpus=8)
    params = spec.num_parameters() + (spec.padded_vocab(1) - spec.vocab) * spec.hidden
    for key, per_param, divisor in zip(("parameters", "gradients", "optimizer"), (2, 2, 12), divisors):
        assert result.memory_bytes[key] == pytest.approx(params * per_param / divisor, rel=1e-12)


def test_zero_two_in_a_pipeline_reduces_every_micro_batch_and_offload_frees_the_optimizer():
    """Stage 2 with pp > 1 (what plait train runs): per micro-batch the stage's
    gradients reduce-scattered in 25 MiB buckets (one call each) and one all-gather per
    step, so its data-parallel time, exposed plus hidden, is stage 1's all-gather plus
    m bucketed reduce-scatters (issue 36: part of it hidden under the backward); with
    the optimizer offloaded, no optimizer bytes in memory and nothing else changed."""
    spec = model_preset("gpt-1.3b")
    m = 4
    base = dict(pp=2, dp=4, micro_batch=1, num_microbatches=m, schedule="1f1b")
    one = estimate_layout(spec, "dgx-a100", Layout(**base, zero_stage=1), gpus=8)
    two = estimate_layout(spec, "dgx-a100", Layout(**base, zero_stage=2), gpus=8)
    offloaded = estimate_layout(spec, "dgx-a100", Layout(**base, zero_stage=2, offload_optimizer=True), gpus=8)
    cluster = cluster_preset("dgx-a100", gpus=8)
    heavy = two.memory_bytes["gradients"] * 4  # the heaviest stage's gradient bytes (sharded 4 ways)
    reduce_scatter, _ = cluster.collective_time_s("reduce_scatter", heavy, 4, 1)
    buckets = -(-int(heavy) // (25 << 20))
    bucket, _ = cluster.collective_time_s("reduce_scatter", heavy / buckets, 4, 1)
    assert two.time_s["dp_comm"] + two.hidden_s["dp_comm"] - one.time_s["dp_comm"] == pytest.approx(
        m * buckets * bucket - reduce_scatter, rel=1e-9)
    assert 0 < two.hidden_s["dp_comm"] and one.hidden_s["dp_comm"] == 0
    assert two.memory_bytes["gradients"] * 4 == pytest.approx(one.memory_bytes["gradients"], rel=1e-12)
    assert offloaded.memory_bytes["optimizer"] == 0
    assert {key: value for key, value in offloaded.memory_bytes.items() if key != "optimizer"} == \
        {key: value for key, value in two.memory_bytes.items() if key != "optimizer"}


def test_zero_three_moves_each_unit_in_calls_of_its_own():
    """ZeRO 3 as plait runs it: per micro-batch, every unit (each block, the embedding
    and the head: layers + 2 without a pipeline) gathered before its forward and its
    backward (but the forward's last unit, still gathered when its backward comes) and
    reduce-scattered after, one call each, so each call carries 1/units of the bytes
    and pays its own latency."""
    spec = model_preset("gpt-1.3b")
    m, dp = 2, 8
    result = estimate_layout(spec, "dgx-a100", Layout(dp=dp, micro_batch=1, num_microbatches=m, zero_stage=3),
                             gpus=8)
    cluster = cluster_preset("dgx-a100", gpus=8)
    units = spec.layers + 2
    reduce_scatter, _ = cluster.collective_time_s("reduce_scatter", result.memory_bytes["gradients"] * dp / units,
                                                  dp, 1)
    all_gather, _ = cluster.collective_time_s("all_gather", result.memory_bytes["parameters"] * dp / units, dp, 1)
    # and the trainer's closing calls over dp (plan.trainer_calls): the norm's 8 bytes and 4 bytes of
    # flags per parameter tensor (12 a block, 2 the embedding's tables, 2 the final LayerNorm's)
    closing = sum(cluster.collective_time_s("all_reduce", nbytes, dp, 1)[0]
                  for nbytes in (8, 4 * (12 * spec.layers + 2 + 2)))
    assert result.time_s["dp_comm"] + result.hidden_s["dp_comm"] == pytest.approx(
        m * units * (reduce_scatter + 2 * all_gather) - m * all_gather + closing, rel=1e-9)  # part hidden (prefetch)


def test_data_parallel_time_is_the_cheapest_collective():
    cluster = cluster_preset("dgx-a100", gpus=16)
    spec = model_preset("gpt-350m")
    result = estimate_layout(spec, cluster, Layout(dp=16, micro_batch=4, num_microbatches=1))
    grad_bytes = 2 * (spec.num_parameters())
    units = bucket_count(grad_bytes)  # 25 MiB buckets, all-reduced during the backward
    # 16 ranks on 2 nodes, 8 per node: flat algorithms on the NIC link, or hierarchical
    candidates = [predict_time_s("all_reduce", a, grad_bytes / units, 16, cluster.inter_link)
                  for a in ("ring", "tree", "double_binary_tree", "recursive_doubling", "halving_doubling")]
    candidates.append(predict_time_s("all_reduce", "hierarchical", grad_bytes / units, 16,
                                     [cluster.inter_link, cluster.intra_link], hierarchy="2x8"))
    assert result.time_s["dp_comm"] + result.hidden_s["dp_comm"] == pytest.approx(units * min(candidates), rel=1e-9)
    assert result.algorithms["dp all_reduce"] == "hierarchical"


def test_group_shapes_follow_the_mesh_order():
    cluster = cluster_preset("dgx-a100", gpus=64)
    assert (cluster.group_shape(8, 1).per_node, cluster.group_shape(8, 1).nodes) == (8, 1)
    assert cluster.group_shape(8, 8).per_node == 1 and cluster.group_shape(8, 8).nodes == 8
    shape = cluster.group_shape(8, 2)  # dp over tp=2: 4 per node on 2 nodes
    assert (shape.per_node, shape.nodes) == (4, 2)
    # tp inside a node is NVLink-cheap, across nodes it is not
    inside, _ = cluster.collective_time_s("all_reduce", 1 << 26, 8, 1)
    across, _ = cluster.collective_time_s("all_reduce", 1 << 26, 8, 8)
    assert across > 5 * inside


def test_an_invalid_layout_is_refused_with_every_rule_named():
    with pytest.raises(ValueError) as error:
        estimate_layout("gpt-1.3b", "dgx-a100", Layout(tp=3, pp=2, dp=1, micro_batch=1, num_microbatches=2,
                                                        schedule="none", zero_stage=3), gpus=8)
    text = str(error.value)
    assert "tp(3) * pp(2) * dp(1) = 6 != devices(8)" in text
    assert "tp=3 does not divide heads=16" in text
    assert "pp=2 needs a pipeline schedule" in text
    assert "zero_stage=3 with pp > 1" in text
    with pytest.raises(ValueError, match="offload_optimizer with zero_stage=0"):
        estimate_layout("gpt-1.3b", "dgx-a100", Layout(dp=8, offload_optimizer=True), gpus=8)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_collective_prices_are_the_closed_forms_at_every_size(collective):
    """The cluster prices from closed forms computed once per segment count and scaled
    by the size; that must equal plait.cost.alpha_beta at the size itself."""
    from plait.cost.alpha_beta import closed_form_algorithms

    cluster = cluster_preset("dgx-h100", gpus=64)
    for size, stride in ((8, 1), (8, 8), (16, 2), (64, 1), (3, 8)):
        shape = cluster.group_shape(size, stride)
        flat = cluster.inter_link if shape.nodes > 1 else cluster.intra_link
        for nbytes in (1, 1000, 3 << 20, 7.5e8, 12345678901):
            expected = min(predict_time_s(collective, a, nbytes, size, flat) for a in closed_form_algorithms(collective)
                           if a not in ("direct", "star", "binary_tree", "hierarchical"))
            if collective == "all_reduce" and shape.nodes > 1 and shape.per_node > 1:
                expected = min(expected, predict_time_s(collective, "hierarchical", nbytes, size,
                                                        [cluster.inter_link, cluster.intra_link],
                                                        hierarchy=f"{shape.nodes}x{shape.per_node}"))
            assert cluster.collective_time_s(collective, nbytes, size, stride)[0] == pytest.approx(expected, rel=1e-9)


def test_groups_that_straddle_nodes_are_priced_on_the_slow_link():
    """tp=6 on 8-GPU nodes: the group of ranks 6..11 spans two nodes, so a tp
    collective crosses InfiniBand, not only NVLink."""
    cluster = cluster_preset("dgx-a100", gpus=24)
    shape = cluster.group_shape(6, 1)
    assert shape.nodes == 2 and shape.per_node == 1  # 2 + 4 ranks: uneven, priced flat
    seconds, _ = cluster.collective_time_s("all_reduce", 1 << 26, 6, 1)
    inter_ring = predict_time_s("all_reduce", "ring", 1 << 26, 6, cluster.inter_link)
    assert seconds >= 0.5 * inter_ring
    assert cluster.group_shape(8, 1).nodes == 1 and cluster.group_shape(3, 8).nodes == 3


def test_pipeline_boundaries_that_cross_nodes_pay_the_network():
    """tp=2 x dp=2 per stage, 4 stages on 16 GPUs: stages 1 and 2 sit on different
    nodes, and that boundary paces every micro-batch."""
    spec = model_preset("gpt-1.3b")
    cluster = cluster_preset("dgx-a100", gpus=16)
    layout = Layout(tp=2, pp=4, dp=2, micro_batch=1, num_microbatches=8, schedule="1f1b")
    result = estimate_layout(spec, cluster, layout)
    boundary = spec.block_input_bytes(1, tp=2, element_bytes=2)
    per_microbatch = 2 * cluster.p2p_time_s(boundary, True)  # a middle rank receives forward and backward
    assert result.time_s["pp_comm"] == pytest.approx(8 * per_microbatch, rel=1e-9)


def test_interleaved_memory_bounds_the_real_schedule_with_unequal_chunks():
    """Chunks of different activation sizes: the estimate's per-rank activations are
    never below the peak found by walking plait's interleaved schedule with each
    chunk's own bytes (and equal to it when the chunks are equal)."""
    p, m, v = 4, 8, 2
    sizes = [5, 1, 2, 7, 3, 3, 1, 9]  # activation bytes of the 8 layer groups = chunks
    groups = [[Unit(LayerCost(name=f"l{i}", forward_flops=1.0, backward_flops=2.0, activation_bytes=a),
                    TensorParallelComm(), True)] for i, a in enumerate(sizes)]
    layout = Layout(pp=p, num_microbatches=m, schedule="interleaved_1f1b", virtual=v)
    split = [[c] for c in range(p * v)]
    result = estimate(groups, layout, _cluster(p), PRECISIONS["fp32"], model_flops=1.0, hardware_flops=1.0,
                      split=split)
    schedule = build("interleaved_1f1b", p, m, v)
    peaks = []
    for rank in range(p):
        alive = peak = 0
        for action in schedule.compute_order(rank):
            weight = sizes[action.stage]
            alive += weight if action.kind == "F" else -weight if action.kind == "B" else 0
            peak = max(peak, alive)
        peaks.append(peak)
    assert result.memory_bytes["activations"] >= max(peaks)
    assert result.memory_bytes["activations"] <= 2 * max(peaks)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_recomputation_peak_reuses_the_head_freed_before_it(recompute):
    """One micro-batch on one rank (pp = 1): the backward frees the head's tensors
    before it recomputes the last block, so a recompute's working set adds only what
    exceeds them: emb + l·kept + head + max(working - head, 0)."""
    spec = model_preset("gpt-125m")
    layout = Layout(dp=8, micro_batch=2, num_microbatches=1, recompute=recompute)
    got = estimate_layout(spec, "dgx-a100", layout, gpus=8).memory_bytes["activations"]
    kw = dict(element_bytes=2)
    emb, head = spec.embedding_activation_bytes(2, **kw), spec.head_activation_bytes(2, **kw)
    block, core = spec.block_activation_bytes(2, **kw), spec.attention_core_bytes(2, **kw)
    kept, working = {"none": (block, 0.0), "selective": (block - core, core),
                     "full": (spec.block_input_bytes(2, **kw), block)}[recompute]
    assert got == pytest.approx(emb + spec.layers * kept + head + max(working - head, 0.0), rel=1e-12)


@pytest.mark.parametrize("schedule,p,m", [("gpipe", 2, 4), ("gpipe", 4, 8), ("1f1b", 4, 8), ("1f1b", 2, 4)])
def test_offload_keeps_at_most_two_micro_batches_in_memory(schedule, p, m):
    """plait train --offload-activations holds the running backward's micro-batch and
    the prefetched next one; the rest are in files, but for the activation each
    received from the previous stage (the engine holds it for the backward). Priced:
    min(k, 2) x the chunk's bytes + (k - min(k, 2)) x its input's, k the schedule's
    peak in flight on the rank; a schedule that never holds more than 2 gains nothing."""
    groups = [[Unit(LayerCost(name=f"l{i}", forward_flops=1.0, backward_flops=2.0, activation_bytes=10.0,
                              output_bytes=3.0), TensorParallelComm(), True)] for i in range(p)]
    layout = Layout(pp=p, num_microbatches=m, schedule=schedule)
    kept = estimate(groups, layout, _cluster(p), PRECISIONS["fp32"], model_flops=1.0, hardware_flops=1.0)
    offloaded = estimate(groups, Layout(pp=p, num_microbatches=m, schedule=schedule, offload=True), _cluster(p),
                         PRECISIONS["fp32"], model_flops=1.0, hardware_flops=1.0)
    want = []
    for r in range(p):
        k = in_flight(layout, r)
        want.append((10.0 * k, 10.0 * min(k, 2) + (3.0 * (k - min(k, 2)) if r > 0 else 0.0)))
    assert [rank["activations"] for rank in kept.rank_memory_bytes] == [a for a, _ in want]
    assert [rank["activations"] for rank in offloaded.rank_memory_bytes] == [b for _, b in want]
    assert offloaded.step_time_s == kept.step_time_s  # memory only: the copies are not priced (README)


def test_mixed_precision_bytes_follow_the_trainer_of_the_accounting():
    """Under the plait accounting a mixed precision is plait train's autocast: fp32
    parameters, gradients and AdamW states (4 + 4 + 8), a float32 residual stream and
    16-bit weight copies; under megatron's, 16-bit weights with fp32 masters (2 + 2 + 12)."""
    for name, dtype in (("bf16-mixed", "bfloat16"), ("fp16-mixed", "float16")):
        plait, megatron = precision_for(name, "plait"), precision_for(name, "megatron")
        assert (plait.dtype, plait.param_bytes, plait.grad_bytes, plait.optimizer_bytes) == (dtype, 4, 4, 8)
        assert (plait.element_bytes, plait.residual_bytes, plait.weight_copy_bytes) == (2, 4, 2)
        assert (megatron.dtype, megatron.param_bytes, megatron.grad_bytes, megatron.optimizer_bytes) == (dtype, 2, 2, 12)
        assert megatron.residual_bytes is None and megatron.weight_copy_bytes == 0
    assert precision_for("fp32", "plait") == PRECISIONS["fp32"]
    with pytest.raises(ValueError, match="precision='fp8' must be one of bf16-mixed, fp16-mixed, fp32"):
        precision_for("fp8", "plait")
    with pytest.raises(ValueError, match="offload='yes' must be True or False"):
        estimate_layout(model_preset("gpt-125m"), "dgx-a100", Layout(dp=8, offload="yes"), gpus=8)


def test_the_mesh_order_decides_which_axis_crosses_the_nodes():
    """2 nodes x 2 devices, dp=2 x pp=2. tp,dp,pp (the default): each dp pair is
    consecutive (one node) and the pipeline crosses; tp,pp,dp: each pipeline sits in a
    node and the dp pairs cross. With a slow link between nodes each pays it on its own
    axis: the gradient all-reduce over the slow link in one, the micro-batches'
    activations in the other."""
    slow, fast = LinkModel(1e-3, 1 / 12.5e6), LinkModel(1e-4, 1e-9)
    cluster = Cluster(name="unit", nodes=2, devices_per_node=2, device=cluster_preset("dgx-a100", gpus=8).device,
                      intra_link=fast, inter_link=slow)
    spec = dataclasses.replace(model_preset("gpt-125m"), tied_head=False)  # no embedding all-reduce across stages
    results = {}
    for order in ("tp,dp,pp", "tp,pp,dp"):
        layout = Layout(pp=2, dp=2, micro_batch=1, num_microbatches=4, schedule="1f1b", mesh_order=order)
        assert (layout.stride("dp"), layout.stride("pp")) == ((1, 2) if order == "tp,dp,pp" else (2, 1))
        results[order] = estimate_layout(spec, cluster, layout)
    grad_bytes = 2 * spec.num_parameters() / 2  # bf16 gradients of one stage (about half the model)
    pipeline_inside, dp_inside = results["tp,pp,dp"], results["tp,dp,pp"]
    assert dp_inside.time_s["dp_comm"] < grad_bytes * fast.beta_s_per_byte * 2
    assert pipeline_inside.time_s["dp_comm"] > grad_bytes * slow.beta_s_per_byte * 0.9
    boundary = spec.block_input_bytes(1, tp=1, element_bytes=2)
    assert dp_inside.time_s["pp_comm"] == pytest.approx(4 * 2 * cluster.p2p_time_s(boundary, True) / 2, rel=0.5)
    assert pipeline_inside.time_s["pp_comm"] < dp_inside.time_s["pp_comm"] / 10
    with pytest.raises(ValueError, match="mesh_order='dp,tp,pp' must be one of tp,dp,pp, tp,pp,dp"):
        estimate_layout(spec, cluster, Layout(pp=2, dp=2, micro_batch=1, num_microbatches=4, schedule="1f1b",
                                              mesh_order="dp,tp,pp"))
