"""The calibration ring shift as data: who sends what, and what it leaves in the
buffers (virtual executor, no processes)."""

import pytest
import torch

from plait.bench.calibrate import CalibrateConfig, measurement_plan, shift_schedule
from plait.comm.virtual import run_schedule


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("steps", [1, 2, 4])
def test_shift_counts(world_size, steps):
    schedule = shift_schedule(world_size, 5, steps, reduce=False)
    assert schedule.num_steps == steps and schedule.buffer_numel == 5 * world_size  # p regions
    for rank in range(world_size):
        assert schedule.sent_numel(rank) == steps * 5 == schedule.recv_numel(rank)
    assert schedule.critical_path_numel() == steps * 5
    assert shift_schedule(world_size, 5, steps, reduce=True).reduced_numel(0) == steps * 5


@pytest.mark.parametrize("regions", [None, 2, 3])
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_copy_shift_forwards_around_the_ring(world_size, regions):
    # each step forwards what the previous one received: after k steps rank r holds,
    # in region k % m, the region-0 data of rank r - k
    numel, steps = 3, 4
    schedule = shift_schedule(world_size, numel, steps, reduce=False, regions=regions)
    m = schedule.buffer_numel // numel
    assert m == max(2, regions or world_size)
    buffers = [torch.cat([torch.full((numel,), float(r)), torch.full(((m - 1) * numel,), -1.0)])
               for r in range(world_size)]
    run_schedule(schedule, buffers)
    for rank, buffer in enumerate(buffers):
        region = buffer[(steps % m) * numel:][:numel]
        assert torch.equal(region, torch.full((numel,), float((rank - steps) % world_size)))


def test_reduce_shift_adds():
    buffers = [torch.tensor([1.0, 10.0]), torch.tensor([2.0, 20.0])]
    run_schedule(shift_schedule(2, 1, 1, reduce=True), buffers)  # rank r adds rank 1-r's region 0
    assert buffers[0].tolist() == [1.0, 12.0] and buffers[1].tolist() == [2.0, 21.0]


def test_config_and_plan():
    config = CalibrateConfig(min_nbytes=1000, max_nbytes=8000, factor=2, steps=(4, 1, 2, 2))
    assert config.steps == (1, 2, 4)
    assert config.sizes_nbytes == [1000, 2000, 4000, 8000]
    plan = measurement_plan(config)
    assert len(plan) == 4 * (3 * 2 + 1)
    assert plan[:7] == [("shift", 1, 1000, False), ("shift", 1, 1000, True), ("shift", 2, 1000, False),
                        ("shift", 2, 1000, True), ("shift", 4, 1000, False), ("shift", 4, 1000, True),
                        ("ping_pong", 1, 1000, False)]
    with pytest.raises(ValueError) as error:
        CalibrateConfig(min_nbytes=2, factor=1, steps=(1,), reps=0, timeout_s=0)
    for fragment in ("min_nbytes(2)", "factor(1)", "steps=(1,)", "reps(0)", "timeout_s(0)"):
        assert fragment in str(error.value)
