"""plait.parallel: data parallelism (DataParallel, ParameterServer); tensor, pipeline
and hybrid parallelism follow."""

from plait.parallel.data import DataParallel, StepStats

__all__ = ["DataParallel", "ParameterServer", "StepStats"]


def __getattr__(name):
    if name == "ParameterServer":
        from plait.parallel.param_server import ParameterServer

        return ParameterServer
    raise AttributeError(f"module 'plait.parallel' has no attribute {name!r}")
