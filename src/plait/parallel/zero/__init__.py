"""ZeRO sharding (stages 1-3): the ``ZeRO`` module wrapper and the trainer's
``ShardedOptimizer``, over flat units of parameters, their gathering and optimizer-state
offload."""

from plait.parallel.zero.module import ZeRO
from plait.parallel.zero.optimizer import ShardedOptimizer
from plait.parallel.zero.unit_gathering import default_wrap

__all__ = ["ShardedOptimizer", "ZeRO", "default_wrap"]
