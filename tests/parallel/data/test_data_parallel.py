"""DataParallel on real gloo processes against one process training on the whole
batch (DESIGN.md section 4: numerical parity).

Why the tolerances: one process computes the mean gradient of the global batch;
p ranks compute means of their slices and average them. Both are sums of the same
per-sample terms in different association orders, so they differ by rounding only:
a few units of roundoff times the gradient's magnitude per step, compounded over a
handful of steps. float64 (u = 1.1e-16) lands far inside 1e-10; float32
(u = 6e-8) inside 1e-5 for these small models (the issue's tolerances).
"""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.models import build_model
from plait.parallel import DataParallel
from plait.testing import run_distributed, run_fresh_world
from plait.train.data import global_batch, load_digits, rank_batch

GLOBAL_BATCH = 48  # divisible by 2, 3 and 4


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3)


def train_single(model_name, dtype, optimizer_name, steps, accumulate):
    """One process, the whole global batch (``accumulate`` micro-batches per step)."""
    train, _ = load_digits(dtype=dtype)
    model = build_model(model_name, seed=1, dtype=dtype)
    optimizer = _optimizer(optimizer_name, model.parameters())
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulate):
            inputs, labels = global_batch(train, step * accumulate + micro, GLOBAL_BATCH)
            (F.cross_entropy(model(inputs), labels) / accumulate).backward()
        optimizer.step()
    return [param.detach().clone() for param in model.parameters()]


def train_dp(rank, world_size, model_name, dtype, optimizer_name, steps, accumulate, algorithm, bucket_mb,
             compression=None):
    train, _ = load_digits(dtype=dtype)
    model = DataParallel(build_model(model_name, seed=1, dtype=dtype), algorithm=algorithm, bucket_mb=bucket_mb,
                         compression=compression)
    optimizer = _optimizer(optimizer_name, model.parameters())
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulate):
            inputs, labels = rank_batch(train, step * accumulate + micro, GLOBAL_BATCH, rank, world_size)
            last = micro == accumulate - 1
            with model.no_sync() if not last else _nothing():
                (F.cross_entropy(model(inputs), labels) / accumulate).backward()
        optimizer.step()
    stats = model.last_stats
    return [param.detach().clone() for param in model.module.parameters()], stats, len(model.buckets)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _max_relative_error(got, want):
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for g, w in zip(got, want, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_matches_single_process_float64(optimizer_name, accumulate):
    want = train_single("mlp", torch.float64, optimizer_name, 3, accumulate)
    # small buckets: the MLP's 6 tensors land in several buckets, launched during backward
    results = run_distributed(train_dp, 3, "mlp", torch.float64, optimizer_name, 3, accumulate, "ring", 0.1)
    for params, stats, nbuckets in results:
        assert nbuckets > 1
        assert _max_relative_error(params, want) < 1e-10
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0], strict=True))  # identical replicas


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["auto", "halving_doubling", "torch"])
def test_matches_single_process_float32_cnn(algorithm):
    want = train_single("cnn", torch.float32, "adam", 3, 1)
    results = run_distributed(train_dp, 4, "cnn", torch.float32, "adam", 3, 1, algorithm, 25)
    for params, stats, nbuckets in results:
        assert nbuckets == 1
        assert _max_relative_error(params, want) < 1e-5
        assert stats.bytes_sent > 0 and stats.comm_time_s > 0  # overlap itself: test_buckets_overlap_a_slow_backward


SLOW_BACKWARD_S = 0.3


class _SlowBackward(torch.autograd.Function):
    """Identity forward; backward sleeps SLOW_BACKWARD_S (releasing the GIL, as a
    long kernel would) and records in ``log`` when it began and ended."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log["slow_start_s"] = time.perf_counter()
        time.sleep(SLOW_BACKWARD_S)
        ctx.log["slow_end_s"] = time.perf_counter()
        return grad, None


class SlowFirstLayer(nn.Module):
    """Linear(32, 256) whose backward takes SLOW_BACKWARD_S, then 2 fast layers: with
    50 KiB buckets, bucket 0 holds the last layer, the last bucket the first one."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 256)
        self.rest = nn.Sequential(nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        self.log: dict[str, float] = {}

    def forward(self, x):
        return self.rest(_SlowBackward.apply(self.first(x), self.log))


def overlap_times(rank, world_size, steps=2):
    """The timestamps of the last of ``steps`` steps: the slow backward's, the first
    layer's gradient hook's (registered before DataParallel's, so it fires first), and
    each bucket's all-reduce start and end as the comm thread's handles recorded them."""
    torch.manual_seed(0)
    module = SlowFirstLayer()
    hook_s = []
    module.first.weight.register_post_accumulate_grad_hook(lambda param: hook_s.append(time.perf_counter()))
    model = DataParallel(module, bucket_mb=50 / 1024, algorithm="ring")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        optimizer.zero_grad()
        hook_s.clear()
        model(inputs).square().mean().backward()
        optimizer.step()
    stats = model.last_stats
    return dict(buckets=[bucket.names for bucket in model.buckets], started_s=stats.bucket_started_s,
                finished_s=stats.bucket_finished_s, hook_s=hook_s[0], **module.log)


@pytest.mark.slow
def test_buckets_overlap_a_slow_backward():
    """The last layers' bucket is all-reduced while the first layer's 0.3 s backward
    still runs: its comm-side start (and end) precede the slow backward's end and the
    first layer's gradient hook. Launching buckets only after backward fails this."""
    for times in run_distributed(overlap_times, 2, timeout_s=60):
        buckets = times["buckets"]
        assert len(buckets) >= 2 and "rest.3.weight" in buckets[0] and "first.weight" in buckets[-1], buckets
        assert len(times["started_s"]) == len(buckets)
        last_layers_start_s, last_layers_end_s = times["started_s"][0], times["finished_s"][0]
        assert last_layers_start_s < times["slow_end_s"] - SLOW_BACKWARD_S / 2, times
        assert last_layers_start_s < times["hook_s"], times
        assert last_layers_end_s < times["slow_end_s"], times  # wholly hidden behind the slow backward
        assert times["started_s"][-1] >= times["hook_s"], times  # the first layer's bucket waits for its gradient


class Branchy(nn.Module):
    """Rank-dependent use of a parameter: ``extra`` gets no gradient on even ranks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Linear(64, 10).double()
        self.extra = nn.Linear(64, 10).double()
        self.never = nn.Linear(64, 10).double()  # used by no rank

    def forward(self, x, use_extra):
        out = self.body(x)
        return out + self.extra(x) if use_extra else out


def unused_parameters(rank, world_size, find_unused):
    train, _ = load_digits(dtype=torch.float64)
    model = DataParallel(Branchy(), bucket_mb=0.001, find_unused_parameters=find_unused)
    inputs, labels = rank_batch(train, 0, GLOBAL_BATCH, rank, world_size)
    F.cross_entropy(model(inputs, rank % 2 == 1), labels).backward()
    never = model.module.never.weight.grad
    return (model.module.extra.weight.grad.clone(), model.last_stats.unused_parameters,
            None if never is None else float(never.abs().max()))


@pytest.mark.parametrize("find_unused", [False, True])
def test_unused_parameters_contribute_zero(find_unused):
    results = run_distributed(unused_parameters, 3, find_unused, timeout_s=60)
    # rank 1 alone used ``extra``: the average is its gradient / 3
    train, _ = load_digits(dtype=torch.float64)
    reference = Branchy()
    inputs, labels = rank_batch(train, 0, GLOBAL_BATCH, 1, 3)
    F.cross_entropy(reference(inputs, True), labels).backward()
    for rank, (grad, unused, never) in enumerate(results):
        assert unused == (4 if rank % 2 == 0 else 2)  # weight and bias of the unused layers
        assert torch.allclose(grad, reference.extra.weight.grad / 3, rtol=1e-12, atol=1e-15)
        # no rank used ``never``: None with find_unused_parameters (as DDP), else averaged zeros
        assert never is None if find_unused else never == 0.0


def differing_parameters(rank, world_size, init):
    model = build_model("mlp", seed=1 if rank != 1 else 2)
    try:
        wrapped = DataParallel(model, init=init)
    except ValueError as error:
        return str(error)
    return [param.sum().item() for param in wrapped.module.parameters()]


def test_differing_parameters_are_refused_naming_the_ranks():
    messages = run_distributed(differing_parameters, 3, "check", timeout_s=60)
    for message in messages:
        assert "differ from rank 0's on ranks [1]" in message and "init='broadcast'" in message, message
    sums = run_distributed(differing_parameters, 3, "broadcast", timeout_s=60)
    assert sums[0] == sums[1] == sums[2]  # rank 0's values everywhere


def batchnorm_model(rank, world_size, algorithm, init, perturb_buffer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    if perturb_buffer and rank == 2:
        model[1].running_mean.add_(1.0)
    try:
        wrapped = DataParallel(model, algorithm=algorithm, init=init)
    except ValueError as error:
        return str(error)
    train, _ = load_digits()
    for step in range(2):
        inputs, labels = rank_batch(train, step, GLOBAL_BATCH, rank, world_size)
        F.cross_entropy(wrapped(inputs), labels).backward()
    # each forward first re-broadcasts rank 0's buffers (then training-mode BatchNorm
    # updates them from the local batch, as under DDP); an eval forward leaves them as sent
    wrapped.eval()
    with torch.no_grad():
        wrapped(inputs)
    return [buffer.clone() for buffer in wrapped.module.buffers()]


@pytest.mark.slow
def test_buffers_are_checked_and_broadcast():
    # BatchNorm's num_batches_tracked is a 0-dim buffer; halving_doubling has no
    # broadcast, so buffers go by the tuner's choice
    results = run_distributed(batchnorm_model, 3, "halving_doubling", "check", False, timeout_s=60)
    for buffers in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(buffers, results[0], strict=True))
    messages = run_distributed(batchnorm_model, 3, "ring", "check", True, timeout_s=60)
    assert all("buffer values differ from rank 0's on ranks [2]" in message for message in messages), messages


def differing_structure(rank, world_size):
    model = build_model("mlp" if rank < 2 else "cnn")
    try:
        DataParallel(model)
    except ValueError as error:
        return str(error)
    return "no error"


def test_differing_structure_is_refused():
    for message in run_distributed(differing_structure, 3, timeout_s=60):
        assert "differ between ranks [[0, 1], [2]]" in message, message


def test_bad_arguments_name_the_value():
    model = build_model("mlp")
    for bucket_mb in (0, -1, float("nan"), "25"):
        with pytest.raises(ValueError, match="bucket_mb=.* must be a finite number of MiB > 0"):
            DataParallel(model, bucket_mb=bucket_mb)
    with pytest.raises(ValueError, match="algorithm='rign'.*unknown"):
        DataParallel(model, algorithm="rign")
    with pytest.raises(ValueError, match="init='copy' must be one of"):
        DataParallel(model, init="copy")
    with pytest.raises(ValueError, match="compression=42 must be a plait.compress.Compressor"):
        DataParallel(model, compression=42)
    # the MLP's last layer is a 10x256 matrix: its gradient has rank at most 10
    with pytest.raises(ValueError, match=r"PowerSGD rank 16 is larger than the 10x256 gradient of 'net.4.weight'"):
        DataParallel(model, compression="powersgd:16")


def peer_dies_mid_step(rank, world_size):
    comm.init_communicator(None, comm.CommConfig(timeout_s=10.0))
    train, _ = load_digits()
    model = DataParallel(build_model("mlp", seed=1), algorithm="direct")
    inputs, labels = rank_batch(train, 0, GLOBAL_BATCH, rank, world_size)
    loss = F.cross_entropy(model(inputs), labels)
    if rank == 2:
        dist.destroy_process_group()  # its connections close, as when a process dies
        time.sleep(2.0)
        return None
    start = time.monotonic()
    try:
        loss.backward()
    except comm.CommError as error:
        return str(error), time.monotonic() - start
    return "no error", 0.0


@pytest.mark.slow
def test_a_rank_dying_mid_step_is_named():
    results = run_fresh_world(peer_dies_mid_step, 3, timeout_s=90)
    for rank in (0, 1):
        message, elapsed_s = results[rank]
        assert f"rank {rank}" in message and "peer 2" in message, message
        assert elapsed_s < 10.5  # the closed connection or the 10 s deadline, never a hang


def single_rank_is_a_no_op(rank, world_size):
    model = DataParallel(build_model("mlp", seed=1))
    train, _ = load_digits()
    inputs, labels = rank_batch(train, 0, 16, rank, world_size)
    F.cross_entropy(model(inputs), labels).backward()
    return model.last_stats, [param.grad is not None for param in model.parameters()]


def test_world_of_one_is_a_no_op():
    stats, has_grad = run_distributed(single_rank_is_a_no_op, 1)[0]
    assert stats is None and all(has_grad)
