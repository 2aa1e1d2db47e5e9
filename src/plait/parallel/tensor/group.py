"""The tensor-parallel group a sharded layer lives in, and how to make one.

``TensorParallel`` carries the process group, the collective algorithm its
mappings use, whether sequence parallelism is on and whether the comm layer
checks each call's arguments. ``group=None`` means a group of one: no
communication at all, the unsharded model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist

from plait.comm import unchecked


@dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """A tensor-parallel group: ``size`` ranks each holding 1/size of every sharded
    layer. ``algorithm`` picks the plait.comm algorithm of every mapping ("auto",
    "ring", "torch", ...). ``sequence_parallel`` shards the LayerNorm/dropout regions
    along the sequence (Korthikanti et al. 2022): the all-reduces become
    reduce-scatter + all-gather pairs. ``check_args=False`` skips the comm layer's
    per-call agreement check (one small all-gather per collective) once the caller
    trusts its shapes."""

    group: object = None
    algorithm: str = "auto"
    sequence_parallel: bool = False
    check_args: bool = True

    def __post_init__(self):
        if not isinstance(self.algorithm, str):
            raise TypeError(f"algorithm must be a string such as 'auto' or 'ring', got {self.algorithm!r}")
        if self.group is not None and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TensorParallel(group=...) needs torch.distributed initialised first")
        if self.group is not None and dist.get_rank(self.group) < 0:
            raise ValueError("this rank is not a member of the tensor-parallel group it was given")

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    def comm_scope(self):
        """The context the mappings run their collectives in."""
        return contextlib.nullcontext() if self.check_args else unchecked()

    def describe(self) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        return f"tp={self.size} (rank {self.rank}, algorithm={self.algorithm}{sp})"


UNSHARDED = TensorParallel()


def new_tensor_parallel(tp: int, *, algorithm: str = "auto", sequence_parallel: bool = False,
                        check_args: bool = True) -> TensorParallel:
    """Split the world into world_size/tp groups of ``tp`` consecutive ranks (ranks
    0..tp-1, tp..2tp-1, ...) and return this rank's. Every rank must call it (it
    creates every group, as torch.distributed.new_group requires)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("new_tensor_parallel needs torch.distributed initialised first (torchrun / plait.testing)")
    world_size = dist.get_world_size()
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    if tp > world_size:
        raise ValueError(f"tp={tp} is larger than the world size {world_size}: use tp <= {world_size} "
                         "or launch more processes")
    if world_size % tp:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"tp={tp} does not divide the world size {world_size}; valid tp values: {valid}")
    if tp == 1:  # a group of one is the unsharded model: no collectives at all
        return TensorParallel(algorithm=algorithm, sequence_parallel=sequence_parallel, check_args=check_args)
    rank = dist.get_rank()
    mine = None
    for start in range(0, world_size, tp):
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return TensorParallel(group=mine, algorithm=algorithm, sequence_parallel=sequence_parallel,
                          check_args=check_args)
