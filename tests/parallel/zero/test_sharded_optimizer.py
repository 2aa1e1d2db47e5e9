"""ShardedOptimizer (ZeRO 1-3 for a loop that computes its own gradients, as plait
train's pipeline does) on real gloo ranks, with 3 micro-batches a step:

- stages 1-3 train as one process on the whole batch, float64, within roundoff
  (stages 2 and 3 sum over the ranks inside each micro-batch and then over
  micro-batches, stage 1 the other way round: the same terms in another order,
  ~1e-15 relative per gradient; AdamW's update is smooth in the gradient, so 3 steps
  stay within 1e-12);
- stages 2 and 3 keep no full gradient after a backward (every ``.grad`` is None once
  the micro-batch's backward returns), and send, counted at the transport with ring
  algorithms, one reduce-scatter of Ψ(N-1)/N per micro-batch, Ψ the padded parameter
  bytes; stages 1 and 2 one all-gather of Ψ(N-1)/N per step, stage 3 two per
  micro-batch (before each unit's forward and before its backward) and none at the
  step; stage 1 one reduce-scatter per step;
- stage 3 holds no gathered parameter between steps (each unit's storage freed),
  and moves a module's units (one per optimizer param group) in one call: one
  all-gather per module before its forward and its backward, one reduce-scatter
  after its backward;
- offload="disk" (``offload_dir``) trains bitwise as without it."""

import tempfile

import pytest
import torch
from torch import nn

from plait import comm
from plait.parallel.zero.optimizer import ShardedOptimizer
from plait.testing import run_distributed

MICRO, ROWS = 3, 12  # micro-batches per step, rows per step over every rank


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 2)).double()


def _data(step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 5, generator=generator, dtype=torch.float64), \
        torch.randn(ROWS, 2, generator=generator, dtype=torch.float64)


def _optimizer(model):
    decay = [param for param in model.parameters() if param.dim() > 1]
    rest = [param for param in model.parameters() if param.dim() == 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2)


def _reference(steps: int):
    model = _model()
    optimizer = _optimizer(model)
    for step in range(steps):
        x, y = _data(step)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [param.detach().clone() for param in model.parameters()]


def _train(rank, world_size, stage, offload_dir, steps):
    model = _model()
    sharded = ShardedOptimizer(_optimizer(model), None, stage=stage, algorithm="ring", bucket_mb=0.0004,
                               offload_dir=offload_dir, modules=[model] if stage == 3 else None)
    per_rank = ROWS // world_size
    left_after_backward, sent, calls = [], [], []
    for step in range(steps):
        x, y = _data(step)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        comm.reset_stats()
        sharded.begin_step()
        for part in range(MICRO):
            rows = slice(part * per_rank // MICRO, (part + 1) * per_rank // MICRO)
            (nn.functional.mse_loss(model(x[rows]), y[rows], reduction="sum") / (per_rank * 2)).backward()
            left_after_backward.append(sum(param.grad is not None for param in model.parameters()))
        sharded.reduce_gradients()
        sharded.step()
        sent.append({name: entry["bytes_sent"] for name, entry in comm.stats().items()})
        calls.append({name: entry["calls"] for name, entry in comm.stats().items()})
    held = sum(param.untyped_storage().nbytes() for param in model.parameters())
    with sharded.whole_parameters():
        params = [param.detach().clone() for param in model.parameters()]
    last = {id(param) for param in model[4].parameters()}  # the last module the forward runs
    return {"params": params, "left": left_after_backward, "sent": sent, "calls": calls, "held": held,
            "padded": [unit.padded * 8 for unit in sharded.units],
            "last_padded": sum(unit.padded * 8 for unit in sharded.units if id(unit.params[0]) in last)}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_stages_one_to_three_train_as_one_process(stage, world_size):
    want = _reference(3)
    for result in run_distributed(_train, world_size, stage, None, 3):
        for got, expected in zip(result["params"], want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        psi, n = sum(result["padded"]), world_size
        for step, sent in enumerate(result["sent"]):
            assert sent["reduce_scatter"] == (1 if stage == 1 else MICRO) * psi * (n - 1) // n
            # stage 3 from the second step (which knows the forward's order): the last module is gathered
            # once a micro-batch, not freed between its forward and its backward
            kept = MICRO * result["last_padded"] if stage == 3 and step > 0 else 0
            assert sent["all_gather"] == ((2 * MICRO if stage == 3 else 1) * psi - kept) * (n - 1) // n
        # stages 2 and 3: no full gradient outlives its backward; stage 1 keeps every one
        assert result["left"] == [0 if stage >= 2 else len(want)] * (3 * MICRO)
        assert (result["held"] == 0) == (stage == 3)
        if stage == 3:  # each Linear's two units (weights; biases: two param groups) in one call each time
            for step, calls in enumerate(result["calls"]):
                assert calls["all_gather"] == 2 * MICRO * 3 - (MICRO if step > 0 else 0)
                assert calls["reduce_scatter"] == MICRO * 3


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_state_trains_bitwise_as_in_memory(stage):
    plain = run_distributed(_train, 2, stage, None, 3)
    with tempfile.TemporaryDirectory() as directory:
        offloaded = run_distributed(_train, 2, stage, directory, 3)
    for want, got in zip(plain, offloaded):
        for a, b in zip(want["params"], got["params"], strict=True):
            assert torch.equal(a, b)


def _bad(rank, world_size):
    errors = []
    for kwargs in ({"stage": 4}, {"stage": 3}):
        try:
            ShardedOptimizer(_optimizer(_model()), None, **kwargs)
        except ValueError as error:
            errors.append(str(error))
    return errors


@pytest.mark.slow
def test_bad_stage_is_named():
    errors = run_distributed(_bad, 2)[0]
    assert "stage=4 must be 1, 2 or 3" in errors[0]
    assert "stage 3 needs modules=" in errors[1]
