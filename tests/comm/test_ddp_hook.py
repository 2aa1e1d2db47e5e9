"""plait.comm.ddp_comm_hook on stock DistributedDataParallel, real gloo ranks.

Parity: DDP with plait's hook (no compression) equals DDP's own hook after 5 SGD
steps in float64. Tolerance from the reference's bound: each averaged gradient
element may differ from the exact mean by 2 (p+1) u sum_r|g_r| / p (u = 2^-53, other
reduction order), about 1e-15 relative to the gradients here; 5 steps of lr 0.01 move
parameters by such differences (and the model's response to them), so 1e-12
absolute leaves a wide margin while a wrong average (a missing 1/p, a dropped
rank) is off by O(0.1).
"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import plait.comm as comm
from plait.testing import run_distributed

pytestmark = pytest.mark.slow

STEPS = 5


def _model(seed=0, hidden=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)).double()


def _batch(rank, step):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(9, 7, generator=generator, dtype=torch.float64), torch.randn(
        9, 3, generator=generator, dtype=torch.float64)


def _train(ddp, rank, steps=STEPS, lr=0.01):
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def parity(rank, p, algorithm):
    # DDP starts with one bucket and re-buckets after the first step: its first bucket
    # holds 1 MiB, the rest bucket_cap_mb; 220k float64 parameters (1.7 MB) give several
    theirs = DistributedDataParallel(_model(hidden=20_000), bucket_cap_mb=0.1)
    _train(theirs, rank)
    ours = DistributedDataParallel(_model(hidden=20_000), bucket_cap_mb=0.1)
    state, hook = comm.ddp_comm_hook(algorithm=algorithm)
    ours.register_comm_hook(state, hook)
    _train(ours, rank)
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), _model(hidden=20_000).parameters()))
    return diff, moved, state.steps, state.buckets


def _fixed_batch_losses(ddp, rank, steps=30):
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _batch(rank, 0)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the objective DDP minimises: the mean over ranks' batches
        losses.append(mean.item() / dist.get_world_size())
    return losses


def compressed(rank, p):
    from plait.compress import from_spec

    dense = _fixed_batch_losses(DistributedDataParallel(_model()), rank)
    ddp = DistributedDataParallel(_model())
    state, hook = comm.ddp_comm_hook(algorithm="ring", compression=from_spec("topk:0.3+ef"))
    ddp.register_comm_hook(state, hook)
    losses = _fixed_batch_losses(ddp, rank)
    # replicas stay identical: every rank applies the same averaged (compressed) gradient
    flat = torch.cat([q.detach().reshape(-1) for q in ddp.parameters()])
    gathered = torch.empty(p * flat.numel(), dtype=flat.dtype)
    dist.all_gather_into_tensor(gathered, flat)
    same = all(torch.equal(chunk, flat) for chunk in gathered.chunk(p))
    return losses[0], losses[-1], dense[-1], same, state.steps


class _Bucket:
    """Stands for DDP's GradBucket (buffer(), index(), is_last())."""

    def __init__(self, buffer, index=0):
        self._buffer, self._index = buffer, index

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return True


def mismatched(rank, p):
    state, hook = comm.ddp_comm_hook(algorithm="ring")
    try:
        hook(state, _Bucket(torch.ones(10 + rank, dtype=torch.float64))).wait()
    except ValueError as error:
        message = str(error)
    else:
        message = "no error"
    # the same shapes pass and average
    ok = hook(state, _Bucket(torch.full((4,), float(rank), dtype=torch.float64))).wait()
    return message, ok.tolist()


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
@pytest.mark.parametrize("p", [2, 3])
def test_plait_hook_matches_ddps_own(p, algorithm):
    for diff, moved, steps, buckets in run_distributed(parity, p, algorithm):
        assert steps == STEPS and buckets >= STEPS + 2 * (STEPS - 1)  # >= 3 buckets a step after the first
        assert moved > 1e-3  # training moved the parameters
        assert diff <= 1e-12, diff


def test_compressed_hook_trains_and_keeps_replicas_identical():
    for first, last, dense_last, same, steps in run_distributed(compressed, 3):
        assert same and steps == 30
        # the mean loss over the ranks' batches falls, by at least half as much as with DDP's own hook
        assert first - last >= 0.5 * (first - dense_last) > 0, (first, last, dense_last)


def test_ranks_with_different_buckets_are_named():
    for rank, (message, ok) in enumerate(run_distributed(mismatched, 3)):
        for r in range(3):
            assert f"rank {r}: bucket 0 of {10 + r} elements of float64" in message, message
        assert "same model" in message
        assert ok == [1.0] * 4  # mean of 0, 1, 2


def test_bad_arguments():
    with pytest.raises(TypeError, match="from_spec"):
        comm.ddp_comm_hook(compression="topk:0.01")
    with pytest.raises(TypeError, match="algorithm must be a string"):
        comm.ddp_comm_hook(algorithm=3)
