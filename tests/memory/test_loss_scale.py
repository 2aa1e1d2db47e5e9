"""LossScaler against torch.amp.GradScaler: for injected overflow patterns the scale
sequence, the skipped steps and the parameters are GradScaler's bit for bit; an
overflow on one rank skips the step on every rank; a run that overflows at every
scale stops with a named error; the state round-trips."""

import pytest
import torch

from plait.memory.loss_scale import LossScaleError, LossScaler
from plait.testing import run_distributed

GROWTH_INTERVAL = 3  # small, so growth happens within the run


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _loss(model, step):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
    return model(x).square().mean()


def _inject(model, step, overflows):
    if step in overflows:
        next(model.parameters()).grad[0, 0] = float("inf") if step % 2 else float("nan")


def _with_grad_scaler(overflows, steps):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    scales = []
    for step in range(steps):
        optimizer.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        _inject(model, step, overflows)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [param.detach().clone() for param in model.parameters()]


def _with_loss_scaler(overflows, steps):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = LossScaler(growth_interval=GROWTH_INTERVAL)
    scales, stepped = [], []
    for step in range(steps):
        optimizer.zero_grad()
        scaler.scale_loss(_loss(model, step)).backward()
        _inject(model, step, overflows)
        scaler.unscale(model.parameters())
        scaler.found_overflow()
        stepped.append(scaler.step(optimizer))
        scaler.update()
        scales.append(scaler.scale)
    return scales, [param.detach().clone() for param in model.parameters()], stepped


@pytest.mark.parametrize("overflows", [set(), {0}, {1, 2}, {0, 1, 2, 3}, {4, 8, 9, 15}])
def test_the_scale_sequence_and_the_parameters_are_grad_scalers(overflows):
    steps = 20
    want_scales, want_params = _with_grad_scaler(overflows, steps)
    scales, params, stepped = _with_loss_scaler(overflows, steps)
    assert scales == want_scales
    assert stepped == [step not in overflows for step in range(steps)]
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))


def test_defaults_are_grad_scalers():
    scaler, torch_scaler = LossScaler(), torch.amp.GradScaler("cpu")
    assert scaler.scale == torch_scaler.get_scale() == 2.0 ** 16
    assert (scaler.growth_factor, scaler.backoff_factor, scaler.growth_interval) == (
        torch_scaler.get_growth_factor(), torch_scaler.get_backoff_factor(), torch_scaler.get_growth_interval())


def test_a_run_that_overflows_at_every_scale_stops_with_the_reason():
    scaler = LossScaler(max_consecutive_overflows=3)
    param = torch.nn.Parameter(torch.ones(2))
    for attempt in range(3):
        param.grad = torch.full((2,), float("inf"))
        scaler.unscale([param])
        scaler.found_overflow()
        if attempt < 2:
            scaler.update()
    with pytest.raises(LossScaleError, match="inf or NaN at 3 steps in a row; the loss scale is down to 8192"):
        scaler.update()


def test_state_round_trips_and_bad_settings_are_named():
    scaler = LossScaler(growth_interval=2)
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    scaler.unscale([param])
    scaler.found_overflow()
    scaler.update()
    restored = LossScaler(growth_interval=2)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict().keys() == scaler.state_dict().keys()
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b))
               for a, b in zip(restored.state_dict().values(), scaler.state_dict().values()))
    with pytest.raises(ValueError, match="backoff_factor=1.5 must be in \\(0, 1\\); growth_interval=0 must be"):
        LossScaler(backoff_factor=1.5, growth_interval=0)


def overflow_on_one_rank(rank, world_size):
    """Rank 1's gradient overflows at step 1: every rank must skip that step."""
    scaler = LossScaler(growth_interval=GROWTH_INTERVAL)
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    stepped, scales = [], []
    for step in range(4):
        optimizer.zero_grad()
        scaler.scale_loss(param.sum()).backward()
        if step == 1 and rank == 1:
            param.grad[0] = float("inf")
        scaler.unscale([param])
        scaler.found_overflow()
        stepped.append(scaler.step(optimizer))
        scaler.update()
        scales.append(scaler.scale)
    return stepped, scales, param.detach().tolist()


@pytest.mark.slow
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    results = run_distributed(overflow_on_one_rank, 3)
    for stepped, scales, _ in results:
        assert stepped == [True, False, True, True]
        assert scales == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 15]
    assert results[0][2] == results[1][2] == results[2][2]  # the replicas stay identical
