"""plait.parallel, one package a concept: ``data`` (DataParallel), ``zero`` (ZeRO,
ShardedOptimizer), ``ps`` (ParameterServer), ``tensor`` (Megatron tensor parallelism),
``pipeline`` (schedules, replay, engine, split), ``mesh`` and ``hybrid`` (3D).

The names below load on first use (module ``__getattr__``), so importing a
torch-free submodule, e.g. ``plait.parallel.pipeline.schedules`` from ``plait.plan``,
does not import torch or torch.distributed."""

from __future__ import annotations

import importlib

_LAZY = {"DataParallel": "plait.parallel.data.data_parallel", "StepStats": "plait.parallel.data.data_parallel",
         "ParameterServer": "plait.parallel.ps.worker",
         "ParameterServerConfig": "plait.parallel.ps.config", "ParameterServerStats": "plait.parallel.ps.config",
         "shard_by_size": "plait.parallel.ps.config", "ZeRO": "plait.parallel.zero.module",
         "ShardedOptimizer": "plait.parallel.zero.optimizer"}

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
