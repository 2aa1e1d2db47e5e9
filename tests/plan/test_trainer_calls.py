"""The trainer's closing calls and its optimizer step, as the planner prices them.

Hand counts from the code (plait.parallel.hybrid.train_step with reduce_loss=False, as
plait train calls it; the pipeline engine's end of step): pp > 1 sums the loss (8 bytes,
the pipeline group); the gradient norm sums one float64 over tp then pp (ZeRO >= 1: dp,
tp, pp); fp16 MAX-reduces a 4-byte overflow flag over the world; a group of one makes
no call. Each call is priced collective_time_s + sync_wait_s(size, segment) and the
norm's compute (tensors + 3 kernels, the gradients read once) is added: checked against
the formulas written out here, to float64 rounding (1e-12 relative over ~10 additions).
The optimizer on a CPU: 9 kernels per parameter tensor + 1 per decayed matrix, times
the device's per-kernel cost, plus its bytes at the optimizer efficiency; on a GPU one
launch. A real 4-rank run (slow) checks the call counts per group against plait.comm's.
"""

from __future__ import annotations

import dataclasses

import pytest

from plait import comm
from plait.cost import LinkModel
from plait.names.axes import DP, PP, TP
from plait.plan import Layout, estimate_layout
from plait.plan.cluster import cluster_preset
from plait.plan.device import DeviceSpec
from plait.plan.host import HostModel
from plait.plan.precision import PRECISIONS
from plait.plan.trainer_calls import closing_calls, optimizer_kernels
from plait.plan.models import TransformerModel
from plait.plan.transformer import TransformerSpec
from plait.testing import run_distributed
from plait.train.config import TrainConfig
from plait.train.loop import Trainer

FP32 = PRECISIONS["fp32"]
KERNEL_S = 5e-6
CPU = DeviceSpec(name="cpu-p4", peak_flops_per_s=(("float32", 5e10),), memory_bytes=8e9,
                 memory_bandwidth_bytes_per_s=5e10, matmul_efficiency=0.5, memory_efficiency=0.25,
                 kernel_overhead_s=KERNEL_S, optimizer_memory_efficiency=0.05, eager=True)
GPU = DeviceSpec(name="a100-like", peak_flops_per_s=(("float32", 5e10),), memory_bytes=8e9,
                 memory_bandwidth_bytes_per_s=5e10, matmul_efficiency=0.5, memory_efficiency=0.25,
                 kernel_overhead_s=KERNEL_S, optimizer_memory_efficiency=0.05)
HOST = HostModel(ranks=4, cores=2, threads_per_rank=1, sync_wait_s=1e-3, sync_wait_per_compute=0.05,
                 sync_wait_by_size=((2, 7e-4, 0.01),))  # a pair waits a + b·segment, a = 0.7 ms, b = 0.01
LINK = LinkModel(2e-5, 1e-9)


def _cluster(device, nprocs):
    host = dataclasses.replace(HOST, ranks=nprocs)
    return cluster_preset("local", nprocs=nprocs, device=device, local_link=LINK, call_overhead_s=3e-4, host=host)


def _calls(layout, precision="fp32", tied=0.0, tensors=0):
    return [(call.what, call.group_size, call.stride, call.nbytes)
            for call in closing_calls(layout, precision, tied_embedding_bytes=tied, param_tensors=tensors)]


def test_closing_calls_counted_by_hand():
    """Each layout's closing calls, in the trainer's order, with sizes and strides
    (plait train's mesh order: tp innermost, then dp, then pp)."""
    mixed = Layout(tp=2, pp=2)
    assert _calls(mixed) == [("loss sum (pp)", 2, 2, 8), ("gradient norm (tp)", 2, 1, 8),
                             ("gradient norm (pp)", 2, 2, 8)]
    assert _calls(Layout(dp=4)) == []  # ZeRO 0's norm is over tp and pp only; the dp sync is priced apart
    # ZeRO: the norm over dp too, and a 4-byte flag per parameter tensor over dp in the step
    assert _calls(Layout(dp=2, tp=2, zero_stage=1), tensors=26) == [("gradient norm (dp)", 2, 2, 8),
                                                                    ("gradient norm (tp)", 2, 1, 8),
                                                                    ("unused flags (dp)", 2, 2, 104)]
    assert _calls(Layout(pp=4), tied=96.0) == [("loss sum (pp)", 4, 1, 8), ("tied embedding", 2, 3, 96.0),
                                               ("gradient norm (pp)", 4, 1, 8)]
    assert _calls(Layout(dp=2, pp=2), "fp16-mixed") == [("loss sum (pp)", 2, 2, 8),
                                                        ("overflow flag (world)", 4, 1, 4),
                                                        ("gradient norm (pp)", 2, 2, 8)]
    assert _calls(Layout()) == []


GPT = TransformerSpec(layers=4, hidden=32, heads=4, seq_len=16, vocab=96, tied_head=False)
# per rank (tp = t): the token table V/t·h and positions s·h (2 matrices), a block (12 tensors, 4
# matrices), the final LayerNorm 2h and the head V/t·h (2 vectors, 1 matrix); groups [emb+b0] [b1] [b2] [b3+head]


def _rank_params(tp: int) -> dict:
    """Pipeline rank 0 and 1 of a 2-stage split [[0, 1], [2, 3]]: (params, tensors, matrices)."""
    block = GPT.block_parameters_per_rank(tp)
    table = GPT.padded_vocab(tp) // tp * 32
    return {0: (table + 16 * 32 + 2 * block, 2 + 24, 2 + 8), 1: (2 * block + 2 * 32 + table, 24 + 3, 8 + 1)}


def _priced(device, layout):
    cluster = _cluster(device, layout.devices)
    return estimate_layout(TransformerModel(GPT), cluster, layout, precision=FP32), cluster


def test_dp_comm_at_dp1_is_the_closing_calls():
    """dp = 1, tp = 2, pp = 2: no dp sync, so dp_comm is exactly the norm's compute and the
    three closing calls by the formula (it was 0 before they were priced)."""
    layout = Layout(tp=2, pp=2, num_microbatches=4, micro_batch=2, schedule="1f1b")
    result, cluster = _priced(CPU, layout)
    assert result.stage_layers == [[0, 1], [2, 3]]
    params, tensors, _ = max(_rank_params(2).values())  # the rank with the most parameters
    norm_s = (tensors + 3) * KERNEL_S + params * 4 / (0.25 * 5e10)
    collective_s = cluster.collective_time_s("all_reduce", 8, 2, 1)[0]  # tp neighbours
    pp_collective_s = cluster.collective_time_s("all_reduce", 8, 2, 2)[0]
    norms = collective_s + pp_collective_s + 2 * HOST.wait_s(2, norm_s)
    # the loss sum waits after one micro-batch's backward of the slowest rank: a + b·backward, the
    # backward about 2/3 of its compute per micro-batch (2x the forward's FLOPs, kernels and bytes,
    # the embedding's and head's fewer kernels aside)
    loss_wait = result.time_s["dp_comm"] - norm_s - norms - pp_collective_s
    backward_s = (loss_wait - 7e-4) / 0.01
    assert 0.5 < backward_s / (result.time_s["compute"] / 4) < 0.75


def test_optimizer_kernels_by_hand():
    """The heaviest rank's AdamW on a CPU: (9·tensors + matrices)·t_kernel + 28 bytes per
    parameter at the optimizer efficiency; on a GPU one launch (Megatron's fused Adam)."""
    layout = Layout(pp=2, num_microbatches=2, schedule="1f1b")
    params, tensors, matrices = max(_rank_params(1).values())
    bandwidth_s = params * 28 / (0.05 * 5e10)
    assert optimizer_kernels(CPU, tensors, matrices) == 9 * tensors + matrices
    cpu, _ = _priced(CPU, layout)
    assert cpu.stage_layers == [[0, 1], [2, 3]]
    assert cpu.time_s["optimizer"] == pytest.approx((9 * tensors + matrices) * KERNEL_S + bandwidth_s, rel=1e-12)
    gpu, _ = _priced(GPU, layout)
    assert gpu.time_s["optimizer"] == pytest.approx(KERNEL_S + bandwidth_s, rel=1e-12)
    # eager or fused is the device's own property, not its name
    assert optimizer_kernels(dataclasses.replace(CPU, eager=False), tensors, matrices) == 1
    assert optimizer_kernels(dataclasses.replace(GPU, name="cpu-like", eager=True), tensors, matrices) == \
        9 * tensors + matrices
    with pytest.raises(ValueError, match=r"eager=1 must be True or False"):
        dataclasses.replace(GPU, eager=1)


# ----- a real run: plait.comm's call counts per group against the priced calls -------------------
STEPS = 3


def _config(out, **layout) -> TrainConfig:
    return TrainConfig(layers=2, hidden=16, heads=2, seq_len=8, data_max_bytes=20_000, global_batch=4, micro_batch=2,
                       steps=STEPS, warmup_steps=0, dtype="float64", eval_interval=0, grad_clip=0.0,
                       checkpoint_interval=0, keep_checkpoints=0, log_interval=STEPS, out=str(out), timeout_s=60.0,
                       **layout)


def _all_reduce_calls(rank, world_size, root, layouts):
    """Per layout, this rank's all_reduce calls on its dp, tp and pp groups over the run."""
    found = []
    for index, layout in enumerate(layouts):
        trainer = Trainer(_config(f"{root}/{index}", **layout), resume="never", log=lambda _: None)
        trainer.train()
        found.append({axis: comm.stats(trainer.mesh.group[axis]).get("all_reduce", {}).get("calls", 0)
                      for axis in (DP, TP, PP) if trainer.mesh.size(axis) > 1})
    return found


@pytest.mark.slow
def test_real_run_makes_the_priced_calls(tmp_path):
    """dp=2 pp=2 ZeRO 1 on 4 ranks (the dp group's all_reduces are the norm's and the unused
    flags', the pp group's the loss sum and the norm's; a tp group's also carry the model's
    own collectives, so tp is checked by the hand count only): per step, plait.comm's
    all_reduce calls on each group are the priced closing calls on it."""
    layouts = [dict(dp=2, pp=2, zero_stage=1)]
    found = run_distributed(_all_reduce_calls, 4, str(tmp_path), layouts, timeout_s=120)
    for index, layout in enumerate(layouts):
        priced = closing_calls(Layout(**layout), "fp32")
        for rank_calls in (ranks[index] for ranks in found):
            for axis in (DP, PP):
                if axis in rank_calls:
                    expected = sum(call.what.endswith(f"({axis})") for call in priced)
                    assert rank_calls[axis] == STEPS * expected, (layout, axis, rank_calls)
