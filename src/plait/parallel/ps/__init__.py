"""The parameter server: workers push gradients to server ranks, which update their shard
and reply with parameters. ``protocol`` (tags, message kinds, wire constants) is what
both sides import; ``config`` holds the configuration, statistics and sharding rule."""

from plait.parallel.ps.config import ParameterServerConfig, ParameterServerStats, shard_by_size
from plait.parallel.ps.worker import ParameterServer

__all__ = ["ParameterServer", "ParameterServerConfig", "ParameterServerStats", "shard_by_size"]
