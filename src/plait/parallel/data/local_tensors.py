"""DTensor parameters (torch's own tensor parallelism) as plait's wrappers see them.

A model parallelised with ``torch.distributed.tensor.parallel.parallelize_module``
(``ColwiseParallel``/``RowwiseParallel`` on the tp dimension of a 2-D mesh, the FSDP2 +
TP pattern) holds DTensor parameters: each rank keeps its local shard
(``param.to_local()``) and torch's own collectives on the tp mesh make the forward and
backward right. Data parallelism over the other dimension (``mesh["dp"]``) then works
on the local shards: every rank of a dp group holds the *same* shard of each
parameter, so averaging each local gradient over the dp group is the dp average of
that shard, exactly as for a plain tensor.

What must hold for that: the dp group and each DTensor's mesh meet in this rank only
(:func:`check_dtensor_groups`); with the whole world as the dp group, ranks holding
*different* shards would be averaged together.

Whether a tensor is a DTensor: plait.comm.layout.is_dtensor (which imports nothing
heavy).
"""

from __future__ import annotations

import sys

import torch

from plait.comm.layout import DTENSOR_MODULE, is_dtensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of a DTensor (sharing its storage; no autograd), else
    the tensor itself."""
    if is_dtensor(tensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def grad_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """What ``param.grad`` is set to when its local gradient is ``local``: a DTensor on
    the parameter's mesh and placements around ``local`` (sharing its storage) for a
    DTensor parameter, else ``local`` itself."""
    if is_dtensor(param):
        dtensor = sys.modules[DTENSOR_MODULE].DTensor
        return dtensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return local


def check_dtensor_groups(named, group_ranks: list[int], owner: str) -> None:
    """A ValueError when a DTensor parameter's mesh holds another rank of the data-parallel
    group (global ranks ``group_ranks``): that rank holds a different shard (or is the
    same replica twice), so averaging them is wrong. The fix: the other dimension of the
    mesh (``mesh["dp"]`` when the parameters live on ``mesh["tp"]``)."""
    members = set(group_ranks)
    for name, tensor in named:
        if not is_dtensor(tensor):
            continue
        mesh_ranks = set(tensor.device_mesh.mesh.flatten().tolist())
        shared = sorted(mesh_ranks & members)
        if len(shared) > 1:
            raise ValueError(
                f"{owner}: parameter {name!r} is a DTensor on a mesh of global ranks {sorted(mesh_ranks)} "
                f"({tensor.placements}), which shares ranks {shared} with the data-parallel group {group_ranks}: "
                "pass the mesh's other dimension as group= (e.g. mesh['dp'] when the model was parallelised on "
                "mesh['tp'])")
