"""The parameter server: workers push gradients to server ranks, which update their shard
and reply with parameters. ``config`` (the configuration, statistics and sharding) stays
torch-free, so the names below load on first use."""

from __future__ import annotations

import importlib

_LAZY = {"ParameterServer": "plait.parallel.ps.worker", "ParameterServerConfig": "plait.parallel.ps.config",
         "ParameterServerStats": "plait.parallel.ps.config", "shard_by_size": "plait.parallel.ps.config"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
