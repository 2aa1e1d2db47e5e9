"""plait.testing: the one multi-process test harness (DESIGN.md section 4).

- `run_distributed(fn, world_size, *args, timeout_s=120.0, grace_s=3.0, **kwargs)`
  calls `fn(rank, world_size, *args, **kwargs)` on a cached pool of spawned gloo
  workers (default process group already initialised) and returns the results in
  rank order.
- `run_fresh_world(fn, world_size, *args, timeout_s=120.0, init=True, grace_s=3.0,
  **kwargs)` does the same in brand-new processes, for tests that own init/teardown
  or may break the group.
- Failures raise `RankError` (a rank raised), `DistributedTimeout` (deadline passed)
  or `WorkerCrashed` (a rank process died); stuck or dead pools are killed by pid and
  rebuilt on the next call.
- `shutdown_pools()` (alias `pool_session_finish`) stops the cached pools; it also
  runs at interpreter exit.

`fn` must be a picklable top-level function, e.g.::

    def all_reduce_rank(rank, world_size):
        tensor = torch.tensor([float(rank)])
        torch.distributed.all_reduce(tensor)
        return tensor.item()

    assert run_distributed(all_reduce_rank, 3) == [3.0, 3.0, 3.0]
"""

from plait.testing.pool import (
    cached_pool_pids,
    pool_session_finish,
    run_distributed,
    shutdown_pools,
)
from plait.testing.world import (
    DistributedTimeout,
    RankError,
    WorkerCrashed,
    free_port,
    run_fresh_world,
)

__all__ = [
    "DistributedTimeout",
    "RankError",
    "WorkerCrashed",
    "cached_pool_pids",
    "free_port",
    "pool_session_finish",
    "run_distributed",
    "run_fresh_world",
    "shutdown_pools",
]
