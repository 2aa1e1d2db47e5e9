"""plait.parallel: data parallelism (DataParallel, ParameterServer), Megatron tensor
parallelism (``plait.parallel.tensor``), pipeline (``plait.parallel.pipeline``) and
hybrid parallelism, ZeRO (``ZeRO``, ``ShardedOptimizer``).

The names below load on first use (module ``__getattr__``), so importing a
torch-free submodule, e.g. ``plait.parallel.pipeline.schedules`` from ``plait.plan``,
does not import torch or torch.distributed."""

from __future__ import annotations

import importlib

_LAZY = {"DataParallel": "plait.parallel.data", "StepStats": "plait.parallel.data",
         "ParameterServer": "plait.parallel.param_server",
         "ParameterServerConfig": "plait.parallel.ps_config", "ParameterServerStats": "plait.parallel.ps_config",
         "shard_by_size": "plait.parallel.ps_config", "ZeRO": "plait.parallel.zero",
         "ShardedOptimizer": "plait.parallel.sharded_optimizer"}

__all__ = ["DataParallel", "ParameterServer", "ParameterServerConfig", "ParameterServerStats", "ShardedOptimizer",
           "StepStats", "ZeRO", "shard_by_size"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
