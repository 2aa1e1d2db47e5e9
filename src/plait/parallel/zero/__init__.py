"""ZeRO sharding (stages 1-3): two fronts, the ``ZeRO`` module wrapper and the trainer's
``ShardedOptimizer``, over one engine (``engine``: backward, reduce, step, gathers) that
drives flat units of parameters (``flat_units``), their gathering around modules
(``unit_gathering``) and optimizer-state offload (``state_offload``); the user's param groups
(``param_groups``) and FSDP2's mixed-precision policy (``mixed_precision``)."""

from plait.parallel.zero.mixed_precision import MixedPrecisionPolicy
from plait.parallel.zero.module import ZeRO
from plait.parallel.zero.optimizer import ShardedOptimizer
from plait.parallel.zero.unit_gathering import default_wrap

__all__ = ["MixedPrecisionPolicy", "ShardedOptimizer", "ZeRO", "default_wrap"]
