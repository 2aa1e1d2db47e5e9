"""Data parallelism: ``DataParallel`` (bucketed, overlapped gradient all-reduce with any
plait algorithm or compressor), its buckets and its weakly-held autograd hooks."""

from plait.parallel.data.data_parallel import DataParallel, StepStats, verify_replicas

__all__ = ["DataParallel", "StepStats", "verify_replicas"]
