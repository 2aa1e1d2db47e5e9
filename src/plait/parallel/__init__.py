"""plait.parallel: data parallelism (DataParallel, ParameterServer) and Megatron
tensor parallelism (``plait.parallel.tensor``); pipeline and hybrid parallelism follow."""

from plait.parallel.data import DataParallel, StepStats
from plait.parallel.param_server import ParameterServer
from plait.parallel.ps_config import ParameterServerConfig, ParameterServerStats, shard_by_size

__all__ = ["DataParallel", "ParameterServer", "ParameterServerConfig", "ParameterServerStats", "StepStats",
           "shard_by_size"]
