"""Tests of plait.testing: pooled and fresh multi-process worlds and their failure modes.

The helpers below are module-level so the spawned workers can unpickle them. Pools
are reused across tests (world sizes 1, 2, 3); the tests that break a pool use p=2
or p=1 so each rebuild costs one or two torch imports.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from plait.testing import (
    DistributedTimeout,
    RankError,
    WorkerCrashed,
    cached_pool_pids,
    run_distributed,
    run_fresh_world,
    shutdown_pools,
)

pytestmark = pytest.mark.slow


def rank_info(rank: int, world_size: int, tag: str, *, scale: int = 1) -> dict:
    return {
        "rank": rank,
        "world_size": world_size,
        "tag": tag,
        "scale": scale,
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
    }


def all_reduce_ranks(rank: int, world_size: int) -> list[float]:
    tensor = torch.arange(5, dtype=torch.float64) + rank  # shape (5,)
    dist.all_reduce(tensor)
    return tensor.tolist()


def raise_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"bad input on rank {rank}")
    return rank


def raise_before_all_reduce(rank: int, world_size: int) -> float:
    if rank == 1:
        raise KeyError("rank 1 fails before the collective")
    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # rank 0 blocks here: rank 1 never joins
    return tensor.item()


def sleep_on_rank_1(rank: int, world_size: int, sleep_s: float) -> int:
    if rank == 1:
        time.sleep(sleep_s)
    return rank


def exit_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def unpicklable_result(rank: int, world_size: int):
    return lambda: rank


def destroy_group(rank: int, world_size: int) -> int:
    dist.destroy_process_group()
    return rank


def fresh_all_reduce(rank: int, world_size: int) -> tuple[int, float, int]:
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    return os.getpid(), tensor.item(), torch.get_num_threads()


def init_from_env(rank: int, world_size: int) -> dict:
    env = {name: os.environ[name] for name in
           ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method="env://")
    tensor = torch.tensor([float(rank)])
    dist.all_reduce(tensor)
    dist.destroy_process_group()
    return {"env": env, "sum": tensor.item(), "pid": os.getpid()}


def all_reduce_after_peer_exit(rank: int, world_size: int) -> str:
    if rank == 1:
        os._exit(3)
    tensor = torch.ones(1)
    try:
        dist.all_reduce(tensor)
    except RuntimeError as exc:
        return f"gloo raised: {exc}"
    return "no error"


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_in_rank_order(world_size: int) -> None:
    results = run_distributed(rank_info, world_size, "hello", scale=4)
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, result in enumerate(results):
        assert result == {
            "rank": rank, "world_size": world_size, "tag": "hello", "scale": 4,
            "dist_rank": rank, "dist_world_size": world_size, "threads": 1, "omp": "1",
        }


def test_pool_is_reused_between_calls() -> None:
    run_distributed(rank_info, 3, "first")
    pids = cached_pool_pids()[3]
    run_distributed(rank_info, 3, "second")
    assert cached_pool_pids()[3] == pids


def test_all_reduce_inside_fn() -> None:
    results = run_distributed(all_reduce_ranks, 3)
    expected = [3.0 * value + 3.0 for value in range(5)]  # sum over ranks of value + rank
    assert results == [expected] * 3


def test_rank_error_when_others_finish_keeps_pool() -> None:
    run_distributed(rank_info, 3, "warm")
    pids = cached_pool_pids()[3]
    with pytest.raises(RankError) as info:
        run_distributed(raise_on_rank, 3, 1)
    message = str(info.value)
    assert info.value.ranks == [1]
    assert "rank 1" in message and "ValueError" in message and "bad input on rank 1" in message
    assert "raise_on_rank" in message
    assert isinstance(info.value, RuntimeError)
    assert cached_pool_pids()[3] == pids  # every rank answered: the pool is kept
    assert run_distributed(all_reduce_ranks, 3)[0][0] == 3.0


def test_rank_error_when_others_are_stuck_rebuilds_pool() -> None:
    run_distributed(rank_info, 2, "warm")
    pids = cached_pool_pids()[2]
    started_s = time.monotonic()
    with pytest.raises(RankError) as info:
        run_distributed(raise_before_all_reduce, 2, grace_s=0.5)
    assert time.monotonic() - started_s < 10.0
    message = str(info.value)
    assert info.value.ranks == [1]
    assert "rank 1" in message and "KeyError" in message and "fails before the collective" in message
    assert "ranks [0] did not answer" in message and "all_reduce" in message  # rank 0's stack
    assert 2 not in cached_pool_pids()
    assert all(_gone(pid) for pid in pids)
    assert run_distributed(all_reduce_ranks, 2) == [[1.0, 3.0, 5.0, 7.0, 9.0]] * 2


def test_timeout_kills_pool_and_next_call_rebuilds() -> None:
    run_distributed(rank_info, 2, "warm")
    pids = cached_pool_pids()[2]
    started_s = time.monotonic()
    with pytest.raises(DistributedTimeout) as info:
        run_distributed(sleep_on_rank_1, 2, 60.0, timeout_s=2.0)
    assert time.monotonic() - started_s < 10.0
    message = str(info.value)
    assert isinstance(info.value, TimeoutError)
    assert info.value.world_size == 2 and info.value.pending_ranks == [1]
    assert "world_size 2" in message and "sleep_on_rank_1" in message and "ranks [1]" in message
    assert "time.sleep" in message or "sleep_on_rank_1" in message.split("stack when killed")[-1]
    assert all(_gone(pid) for pid in pids)
    assert run_distributed(sleep_on_rank_1, 2, 0.0) == [0, 1]
    assert cached_pool_pids()[2] != pids


def test_worker_crash_names_exit_code_and_pool_is_rebuilt() -> None:
    run_distributed(rank_info, 2, "warm")
    pids = cached_pool_pids()[2]
    with pytest.raises(WorkerCrashed) as info:
        run_distributed(exit_on_rank_1, 2, grace_s=0.5)
    assert info.value.rank == 1 and info.value.exitcode == 3
    assert "rank 1" in str(info.value) and "exit code 3" in str(info.value)
    assert all(_gone(pid) for pid in pids)
    assert run_distributed(all_reduce_ranks, 2)[1] == [1.0, 3.0, 5.0, 7.0, 9.0]


def test_unpicklable_result_is_a_rank_error() -> None:
    with pytest.raises(RankError, match="cannot be pickled"):
        run_distributed(unpicklable_result, 1)
    assert run_distributed(rank_info, 1, "after")[0]["tag"] == "after"


def test_fn_that_destroys_the_group_retires_the_pool() -> None:
    assert run_distributed(destroy_group, 1) == [0]
    assert 1 not in cached_pool_pids()
    assert run_distributed(rank_info, 1, "rebuilt")[0]["dist_world_size"] == 1


def test_bad_arguments_fail_before_spawning() -> None:
    with pytest.raises(TypeError, match="top-level"):
        run_distributed(lambda rank, world_size: rank, 2)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        run_distributed(rank_info, 0, "x")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        run_fresh_world(rank_info, 2, "x", timeout_s=0)


def test_fresh_world_with_init() -> None:
    results = run_fresh_world(fresh_all_reduce, 2)
    assert [(total, threads) for _, total, threads in results] == [(3.0, 1), (3.0, 1)]
    assert all(_gone(pid) for pid, _, _ in results)


def test_fresh_world_without_init_uses_env_rendezvous() -> None:
    results = run_fresh_world(init_from_env, 2, init=False)
    ports = {result["env"]["MASTER_PORT"] for result in results}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, result in enumerate(results):
        assert result["sum"] == 1.0
        assert result["env"] == {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": result["env"]["MASTER_PORT"],
            "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
        }
        assert _gone(result["pid"])


def test_fresh_world_peer_death_is_a_crash() -> None:
    with pytest.raises(WorkerCrashed) as info:
        run_fresh_world(all_reduce_after_peer_exit, 2, grace_s=0.5, timeout_s=60.0)
    assert info.value.rank == 1 and info.value.exitcode == 3


def test_fresh_world_rank_error() -> None:
    with pytest.raises(RankError, match="bad input on rank 0"):
        run_fresh_world(raise_on_rank, 2, 0)


def test_shutdown_pools_reaps_workers() -> None:
    run_distributed(rank_info, 1, "last")
    pids = [pid for pool_pids in cached_pool_pids().values() for pid in pool_pids]
    shutdown_pools()
    assert cached_pool_pids() == {}
    assert all(_gone(pid) for pid in pids)
