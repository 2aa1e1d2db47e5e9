"""ZeRO's communication waits inside the forward and backward are dp_comm, not compute.

One 2-process run (dp=2, ZeRO stage 3, pp=1, a tiny float64 GPT) twice in one world:
plain, then with dp rank 1's first gathered module (the embedding) sleeping SLEEP_S after
each forward. Stage 3 prefetches module k+1 while module k computes, so dp rank 1 posts
its part of module 2's gather SLEEP_S late and dp rank 0 waits that long for it inside
its forward (plait.parallel.zero.unit_gathering: a prefetch waited for, or on the first
step a synchronous gather): the engine's busy interval holds the wait, and train_step
moves it (the ZeRO engine's waited seconds over the step) from compute to dp_comm. So
dp rank 0 gains >= SLEEP_S of dp_comm per step and no compute (within SLACK_S: a late
wake-up or a time slice lost on the shared machine); dp rank 1 gains it as compute (the
sleep is in its forward). The parts still add up to the wall (float64 rounding, 1e-9).

Stage 2 in the same world: 2 micro-batches a rank, dp rank 1's backward sleeping SLEEP_S
per micro-batch (a gradient hook on its last module's parameter). Its first micro-batch's
reduce-scatters are posted SLEEP_S late, and dp rank 0 waits for them at its second
backward's start (plait.parallel.zero.engine: begin_backward -> wait_in_flight), inside
the engine's backward interval: dp_comm, so dp rank 0's compute gains nothing (SLACK_S).
"""

from __future__ import annotations

import json
import time

import pytest

from plait.names.step_parts import COMPUTE, DP_COMM, STEP_PARTS
from plait.testing import run_distributed
from plait.train.config import TrainConfig
from plait.train.loop import Trainer

SLEEP_S = 0.080
SLACK_S = 0.030
STEPS = 4


def _config(out, zero_stage: int = 3, micro_batch: int = 2) -> TrainConfig:
    return TrainConfig(layers=2, hidden=16, heads=2, seq_len=8, data_max_bytes=20_000, global_batch=4,
                       micro_batch=micro_batch, dp=2, tp=1, pp=1, zero_stage=zero_stage, steps=STEPS, warmup_steps=0, dtype="float64", eval_interval=0,
                       grad_clip=0.0, checkpoint_interval=0, keep_checkpoints=0, log_interval=STEPS,
                       out=str(out), timeout_s=60.0)


def _plain_and_sleepy(rank, world_size, root):
    for stage, micro_batch in ((3, 2), (2, 1)):
        Trainer(_config(f"{root}/plain{stage}", stage, micro_batch), resume="never", log=lambda _: None).train()
        trainer = Trainer(_config(f"{root}/sleepy{stage}", stage, micro_batch), resume="never", log=lambda _: None)
        if trainer.mesh.coords["dp"] == 1:
            module = next(iter(trainer.hybrid.engine.stages.values()))
            held = [child for child in module.children() if any(True for _ in child.parameters())]
            if stage == 3:  # the first gathered module's forward
                held[0].register_forward_hook(lambda *_: time.sleep(SLEEP_S))
            else:  # the backward's first gradient, once per micro-batch
                next(held[-1].parameters()).register_hook(lambda grad: time.sleep(SLEEP_S))
        trainer.train()


def _per_dp_rank_ms(report) -> dict[int, dict]:
    for row in report["step_parts"]["measured"]["per_rank_ms"].values():
        assert sum(row[part] for part in STEP_PARTS) == pytest.approx(row["wall"], rel=1e-9), row
    dp_of = {str(rank["rank"]): rank["coords"]["dp"] for rank in report["ranks"]}
    return {dp_of[rank]: row for rank, row in report["step_parts"]["measured"]["per_rank_ms"].items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero-waits")
    run_distributed(_plain_and_sleepy, 2, str(root), timeout_s=120)
    return {name: _per_dp_rank_ms(json.loads((root / name / "report.json").read_text()))
            for name in ("plain3", "sleepy3", "plain2", "sleepy2")}


@pytest.mark.slow
def test_zero3_gather_waits_are_dp_comm_not_compute(runs):
    base, slow = runs["plain3"], runs["sleepy3"]
    sleep_ms, slack_ms = 1e3 * SLEEP_S, 1e3 * SLACK_S
    # dp rank 0 waited for dp rank 1's late post: dp communication, not compute
    assert slow[0][DP_COMM] - base[0][DP_COMM] >= sleep_ms - slack_ms, (base[0], slow[0])
    assert slow[0][COMPUTE] - base[0][COMPUTE] <= slack_ms, (base[0], slow[0])
    # dp rank 1 slept in its forward: compute (time.sleep(N) sleeps at least N)
    assert slow[1][COMPUTE] >= sleep_ms, slow[1]


@pytest.mark.slow
def test_zero2_reduce_scatter_waits_are_dp_comm_not_compute(runs):
    base, slow = runs["plain2"], runs["sleepy2"]
    sleep_ms, slack_ms = 1e3 * SLEEP_S, 1e3 * SLACK_S
    # two late posts a step (one per micro-batch): waited for at the second backward's start and at the sync
    assert slow[0][DP_COMM] - base[0][DP_COMM] >= 2 * sleep_ms - slack_ms - base[0][COMPUTE], (base[0], slow[0])
    assert slow[0][COMPUTE] - base[0][COMPUTE] <= slack_ms, (base[0], slow[0])
    assert slow[1][COMPUTE] >= 2 * sleep_ms, slow[1]
