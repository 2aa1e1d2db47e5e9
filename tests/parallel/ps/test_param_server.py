"""Tests of plait.parallel.ParameterServer: sharding, config errors, sync parity with a
single process (SGD, Adam; float64 and float32), async stale-synchronous bounds and
determinism, compression, and a worker dying or hanging mid-step.

Workers are group ranks 0..W-1 and train on ``rank_batch(.., w, W)``, so together
they see the global batch the single-process reference trains on. The helpers are
module-level so the spawned ranks can unpickle them.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from plait import comm
from plait.models import build_model
from plait.parallel.ps.worker import (
    ParameterServer,
    ParameterServerConfig,
    shard_by_size,
)
from plait.testing import RankError, run_distributed, run_fresh_world
from plait.train.data import global_batch, load_digits, rank_batch

BATCH = 48  # divisible by 2 and 3 workers


def make_optimizer(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1)
    if name == "momentum":
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return lambda params: torch.optim.Adam(params, lr=1e-3)


def make_compressor(name: str | None):
    if name is None:
        return None
    from plait.compress.cast import FP16
    from plait.compress.feedback import ErrorFeedback
    from plait.compress.sparse import TopK

    return {"fp16": FP16(), "topk-ef": ErrorFeedback(TopK(0.05))}[name]


def reference_parameters(optimizer: str, dtype: torch.dtype, steps: int) -> dict[str, torch.Tensor]:
    """Single process on the whole global batch."""
    model = build_model("mlp", seed=0, dtype=dtype)
    opt = make_optimizer(optimizer)(list(model.parameters()))
    train, _ = load_digits(dtype=dtype)
    for step in range(steps):
        inputs, labels = global_batch(train, step, BATCH)
        opt.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def compressed_reference(compressor: str, workers: int, steps: int) -> dict[str, torch.Tensor]:
    """The compressed data-parallel math in one process: every worker's gradient
    (flattened in registration order) compressed with its own compressor, then the
    aggregate of all payloads in worker order as the gradient of one SGD step."""
    model = build_model("mlp", seed=0, dtype=torch.float64)
    params = list(model.parameters())
    opt = make_optimizer("sgd")(params)
    compressors = [make_compressor(compressor) for _ in range(workers)]
    train, _ = load_digits(dtype=torch.float64)
    for step in range(steps):
        payloads = []
        for worker in range(workers):
            inputs, labels = rank_batch(train, step, BATCH, worker, workers)
            model.zero_grad()
            F.cross_entropy(model(inputs), labels).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            payloads.append(compressors[worker].compress(flat, rank=worker, step=step, key=0))
        average = compressors[0].aggregate(payloads)
        offset = 0
        for p in params:
            p.grad = average[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train_rank(rank: int, world_size: int, *, optimizer: str = "sgd", dtype=torch.float64, steps: int = 3,
               steps_by_worker=None, delay_s_by_worker=None, compressor=None, **ps_kwargs) -> dict:
    """Build the model and a ParameterServer; servers serve, workers train ``steps``."""
    model = build_model("mlp", seed=0, dtype=dtype)
    ps = ParameterServer(model, make_optimizer(optimizer), compression=make_compressor(compressor), **ps_kwargs)
    if ps.is_server:
        stats = ps.serve()
        return {"role": "server", "stats": stats, "params": ps.server_parameters(), "shards": ps.shards,
                "optimizer_state": sorted(len(state) for state in ps.optimizer.state.values())}
    train, _ = load_digits(dtype=dtype)
    steps = steps_by_worker[rank] if steps_by_worker else steps
    for step in range(steps):
        if delay_s_by_worker:
            time.sleep(delay_s_by_worker[rank])
        inputs, labels = rank_batch(train, step, BATCH, rank, ps.num_workers)
        ps.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        ps.step()
    ps.close()
    return {"role": "worker", "stats": ps.stats(), "optimizer": ps.optimizer,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def server_view(results: list[dict]) -> dict[str, torch.Tensor]:
    """The model as the servers hold it (union of their shards)."""
    merged = {}
    for result in results:
        if result["role"] == "server":
            merged.update(result["params"])
    return merged


def assert_close(actual: dict, expected: dict, tolerance: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        error = (actual[name] - expected[name]).abs().max().item()
        assert error <= tolerance, f"{name}: max error {error:.3g} > {tolerance:g}"


def assert_bounded_staleness(log, max_staleness: int, steps_by_worker: dict[int, int]) -> None:
    """Independent check of the push log: when worker w's step s is applied, every other
    worker v has had min(s - max_staleness, its step count) pushes applied, i.e. w
    computed step s with every update older than s - max_staleness."""
    applied = {w: 0 for w in steps_by_worker}
    for record in log:
        assert record.step == applied[record.worker]
        for other, count in applied.items():
            assert count >= min(record.step - max_staleness, steps_by_worker[other]), (record, applied)
        applied[record.worker] += 1
    assert applied == steps_by_worker


# ---- single process -------------------------------------------------------------


def test_shard_by_size_is_greedy_largest_first():
    # 40 -> s0, 30 -> s1, 20 -> s1, 10 -> s0, 5 -> s0: loads 55 and 50
    assert shard_by_size([10, 40, 30, 20, 5], 2) == ((0, 1, 4), (2, 3))
    assert shard_by_size([7, 7, 7], 3) == ((0,), (1,), (2,))
    assert shard_by_size([3, 1], 1) == ((0, 1),)
    mlp = [p.numel() * 8 for p in build_model("mlp", dtype=torch.float64).parameters()]
    # the 256x256 weight alone outweighs the rest (an optimal split: tensors stay whole)
    assert shard_by_size(mlp, 2) == ((2,), (0, 1, 3, 4, 5))


def test_config_errors_name_every_bad_value():
    with pytest.raises(ValueError, match=r"max_staleness must be an int >= 0.*got -1"):
        ParameterServerConfig(mode="async", max_staleness=-1)
    with pytest.raises(ValueError) as info:
        ParameterServerConfig(num_servers=0, mode="bulk", max_staleness=1.5, order="random")
    message = str(info.value)
    for fragment in ("num_servers must be an int >= 1, got 0", "mode must be one of ('sync', 'async'), got 'bulk'",
                     "got 1.5", "order must be 'arrival' or an int seed, got 'random'"):
        assert fragment in message
    with pytest.raises(ValueError, match=r"max_staleness=2 only applies to mode='async'"):
        ParameterServerConfig(max_staleness=2)
    with pytest.raises(ValueError, match=r"order=7 only applies to mode='async'"):
        ParameterServerConfig(order=7)
    with pytest.raises(ValueError, match=r"num_servers=4 >= world_size=4 leaves no workers; use 1\.\.3"):
        ParameterServerConfig(num_servers=4).check_world_size(4)
    with pytest.raises(ValueError, match=r"needs >= 2 ranks"):
        ParameterServerConfig().check_world_size(1)
    ParameterServerConfig(num_servers=3, mode="async", max_staleness=2, order=0).check_world_size(4)


# ---- multi-process ----------------------------------------------------------------


def bad_inputs_rank(rank: int, world_size: int) -> list[str]:
    """Every rank hits the same errors before any message is sent."""
    from plait.compress.powersgd import PowerSGD

    model = build_model("mlp", seed=0, dtype=torch.float64)
    sgd = make_optimizer("sgd")
    attempts = [
        dict(num_servers=world_size),
        dict(num_servers=2, module=torch.nn.Linear(4, 2, bias=False)),
        dict(mode="async", max_staleness=-2),
        dict(compression=PowerSGD(rank=2)),
        dict(compression="fp16"),
    ]
    messages = []
    for kwargs in attempts:
        try:
            ParameterServer(kwargs.pop("module", model), sgd, **kwargs)
        except (ValueError, TypeError) as error:
            messages.append(f"{type(error).__name__}: {error}")
        else:
            messages.append("no error")
    return messages


@pytest.mark.slow
def test_bad_inputs_raise_before_communicating():
    messages = run_distributed(bad_inputs_rank, 3)
    assert all(m == messages[0] for m in messages)
    too_many, too_few_params, staleness, powersgd, not_compressor = messages[0]
    assert "ValueError: num_servers=3 >= world_size=3 leaves no workers; use 1..2" == too_many
    assert "num_servers=2 > 1 trainable parameter tensors" in too_few_params
    assert "max_staleness must be an int >= 0" in staleness and "got -2" in staleness
    assert powersgd.startswith("ValueError") and "DataParallel" in powersgd and "PowerSGD" in powersgd
    assert not_compressor.startswith("TypeError") and "PayloadCompressor" in not_compressor


@pytest.mark.slow
@pytest.mark.parametrize("world_size, num_servers", [(3, 1), (4, 2)])
def test_sync_matches_single_process(world_size, num_servers):
    steps = 3
    for optimizer in ("sgd", "adam"):
        for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
            results = run_distributed(train_rank, world_size, optimizer=optimizer, dtype=dtype, steps=steps,
                                      num_servers=num_servers)
            expected = reference_parameters(optimizer, dtype, steps)
            workers = [r for r in results if r["role"] == "worker"]
            assert len(workers) == world_size - num_servers
            for worker in workers:  # every worker holds the final model after its last pull
                assert_close(worker["params"], expected, tolerance)
            assert_close(server_view(results), expected, tolerance)
    servers = [r for r in results if r["role"] == "server"]
    assert all(r["optimizer"] is None for r in workers)  # optimiser state lives on the servers only
    shards = servers[0]["shards"]
    assert [s.server for s in shards] == list(range(world_size - num_servers, world_size))
    assert sorted(n for s in shards for n in s.names) == sorted(expected)
    for server, shard in zip(servers, shards):
        assert server["optimizer_state"] == [3] * len(shard.names)  # Adam: step, exp_avg, exp_avg_sq per tensor
        stats = server["stats"]
        workers_count = world_size - num_servers
        assert stats.updates == steps and stats.pushes == steps * workers_count
        assert stats.max_steps_ahead == 0 and stats.max_update_staleness == 0
        # float32 dense pushes and pulls of the shard, plus small headers
        assert stats.bytes_received >= steps * workers_count * shard.numel * 4
        assert stats.bytes_sent >= steps * workers_count * shard.numel * 4


def async_rank(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    return [train_rank(rank, world_size, **run) for run in runs]


@pytest.mark.slow
def test_async_seeded_is_deterministic_and_bounded():
    """World 4: one server, three workers of 3, 4 and 5 steps (early closers release
    the others), seeded order; two runs per bound must agree bit for bit."""
    steps_by_worker = {0: 3, 1: 4, 2: 5}
    runs = [dict(mode="async", max_staleness=bound, order=seed, steps_by_worker=steps_by_worker)
            for bound in (0, 1, 2) for seed in (11, 11, 12)]
    results = run_distributed(async_rank, 4, runs)
    server = [by_rank[3] for by_rank in zip(*results)]
    for index, bound in enumerate((0, 1, 2)):
        first, again, other_seed = server[3 * index : 3 * index + 3]
        for run in (first, other_seed):
            stats = run["stats"]
            assert_bounded_staleness(stats.push_log, bound, steps_by_worker)
            assert stats.max_steps_ahead <= bound
            assert stats.max_update_staleness <= (2 * bound + 1) * 2
            assert stats.pushes == stats.updates == sum(steps_by_worker.values())
        assert first["stats"].push_log == again["stats"].push_log
        assert_close(first["params"], again["params"], 0.0)
        if bound:
            # the bound is reached, and a different seed serves in a different order
            assert first["stats"].max_steps_ahead == bound
            assert first["stats"].push_log != other_seed["stats"].push_log
    for by_rank in zip(*results):  # workers see their own staleness in the replies
        for rank in range(3):
            assert by_rank[rank]["stats"].pushes == steps_by_worker[rank]


@pytest.mark.slow
def test_async_two_servers_serve_in_the_same_order():
    results = run_distributed(train_rank, 4, mode="async", max_staleness=1, order=5, num_servers=2, steps=4)
    logs = [[(r.worker, r.step) for r in results[rank]["stats"].push_log] for rank in (2, 3)]
    assert logs[0] == logs[1]
    assert_bounded_staleness(results[2]["stats"].push_log, 1, {0: 4, 1: 4})


@pytest.mark.slow
def test_async_zero_staleness_sgd_equals_sync():
    """With max_staleness=0 every worker's gradient of step t is taken at the same
    parameters, and W plain-SGD updates of g_w/W sum to one update of the mean: the
    same model as sync up to rounding. (Not so for momentum or Adam, whose W small
    steps differ from one averaged step.)"""
    sync = run_distributed(train_rank, 3, steps=4)
    lock_step = run_distributed(train_rank, 3, steps=4, mode="async", max_staleness=0)
    assert_close(server_view(lock_step), server_view(sync), 1e-10)
    momentum = [run_distributed(train_rank, 3, steps=4, optimizer="momentum", **kwargs)
                for kwargs in ({}, dict(mode="async", max_staleness=0))]
    error = max((a - b).abs().max().item()
                for a, b in zip(server_view(momentum[0]).values(), server_view(momentum[1]).values()))
    assert error > 1e-6


@pytest.mark.slow
def test_async_arrival_order_respects_the_bound_with_a_slow_worker():
    steps_by_worker = {0: 6, 1: 6}
    results = run_distributed(train_rank, 3, mode="async", max_staleness=1, steps=6,
                              delay_s_by_worker={0: 0.0, 1: 0.05})
    stats = results[2]["stats"]
    assert_bounded_staleness(stats.push_log, 1, steps_by_worker)
    assert stats.max_steps_ahead == 1  # worker 0 runs ahead, then waits for worker 1
    assert results[0]["stats"].max_steps_ahead == 1 and results[0]["stats"].wait_time_s > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("compressor", ["fp16", "topk-ef"])
def test_sync_with_compression_matches_the_compressed_math(compressor):
    steps = 3
    results = run_distributed(train_rank, 3, steps=steps, compressor=compressor)
    expected = compressed_reference(compressor, 2, steps)
    assert_close(server_view(results), expected, 1e-10)
    assert_close(results[0]["params"], expected, 1e-10)
    dense = build_model("mlp").parameters()
    numel = sum(p.numel() for p in dense)
    pushed = results[2]["stats"].bytes_received
    assert pushed < steps * 2 * numel * 8 * (0.3 if compressor == "fp16" else 0.2)


def lose_a_worker_rank(rank: int, world_size: int, how: str, mode: str) -> str:
    """Worker 1 stops after 2 steps: returning ends its process (its connections
    close: a death as its peers see it) or it hangs. The others must raise, naming it."""
    comm.init_communicator(None, comm.CommConfig(timeout_s=2.0))
    model = build_model("mlp", seed=0, dtype=torch.float64)
    ps = ParameterServer(model, make_optimizer("sgd"), mode=mode, max_staleness=1 if mode == "async" else 0)
    if ps.is_server:
        ps.serve()
        return "served"
    train, _ = load_digits(dtype=torch.float64)
    for step in range(6):
        if rank == 1 and step == 2:
            if how == "hang":
                time.sleep(30)
            return "gone"
        inputs, labels = rank_batch(train, step, BATCH, rank, ps.num_workers)
        ps.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        ps.step()
    ps.close()
    return "finished"


@pytest.mark.slow
@pytest.mark.parametrize("how, mode", [("die", "sync"), ("hang", "async")])
def test_losing_a_worker_raises_naming_it_on_every_other_rank(how, mode):
    start_s = time.monotonic()
    with pytest.raises(RankError) as info:
        run_fresh_world(lose_a_worker_rank, 3, how, mode, timeout_s=60, grace_s=2)
    assert time.monotonic() - start_s < 40
    failures = info.value.failures
    assert sorted(failures) == [0, 2], str(info.value)
    server_type, server_text = failures[2]
    worker_type, worker_text = failures[0]
    assert "no push from worker rank 1" in server_text
    if how == "hang":
        assert server_type == "CommTimeoutError" and "timed out after 2s" in server_text
    assert worker_type == "CommError"
    assert "server rank 2 gave up: worker rank 1" in worker_text
    expected = "sent nothing within 2s" if how == "hang" else "lost its connection"
    assert expected in worker_text


def raise_in_worker_rank(rank: int, world_size: int) -> str:
    model = build_model("mlp", seed=0, dtype=torch.float64)
    train, _ = load_digits(dtype=torch.float64)

    def train_fn(ps: ParameterServer) -> str:
        for step in range(4):
            if rank == 1 and step == 2:
                raise ValueError("bad batch on worker 1")
            inputs, labels = rank_batch(train, step, BATCH, rank, ps.num_workers)
            ps.zero_grad()
            F.cross_entropy(model(inputs), labels).backward()
            ps.step()
        return "trained"

    return ParameterServer(model, make_optimizer("sgd")).run(train_fn)


@pytest.mark.slow
def test_a_worker_that_raises_stops_the_server_and_the_others_at_once():
    """ps.run: the raising worker tells the server (ABORT), which tells worker 0."""
    start_s = time.monotonic()
    with pytest.raises(RankError) as info:
        run_distributed(raise_in_worker_rank, 3, timeout_s=60)
    assert time.monotonic() - start_s < 20  # not a timeout
    failures = info.value.failures
    assert failures[1][0] == "ValueError"
    assert failures[2][0] == "CommError" and "worker rank 1 aborted (it raised an exception" in failures[2][1]
    assert failures[0][0] == "CommError" and "server rank 2 gave up: worker rank 1 aborted" in failures[0][1]
