"""Row shards: a ZeRO unit's flat buffer (arbitrary ranges of it per rank) seen as
each parameter cut by rows, torch's ``Shard(0)`` DTensor layout, which
``torch.distributed.checkpoint`` saves once per row and reshards onto any number of
ranks. Used by ZeRO's model state dict (``plait.parallel.zero.state_dicts``) and its
optimizer's (``plait.parallel.zero.param_optimizer``)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from plait import comm


def row_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows of a dim-0 ``Shard(0)`` of ``rows`` rows (torch.chunk's cut)."""
    chunk = -(-rows // world_size)
    start = min(rows, chunk * rank)
    return start, min(rows, start + chunk)


def dim0_piece(full: torch.Tensor, mesh: DeviceMesh, world_size: int, rank: int) -> torch.Tensor:
    """This rank's rows of ``full`` as a ``Shard(0)`` DTensor (a 0-dim tensor stays whole)."""
    if full.dim() == 0:
        return full.clone()
    start, end = row_range(full.shape[0], world_size, rank)
    return DTensor.from_local(full[start:end].clone(), mesh, [Shard(0)], run_check=False, shape=full.shape,
                              stride=full.contiguous().stride())


def whole(value: torch.Tensor) -> torch.Tensor:
    """A state dict value as a whole tensor (a DTensor's ``full_tensor()``: collective)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def gather_flat(unit, tensor: torch.Tensor, group) -> torch.Tensor:
    """A shard-shaped ``tensor`` (the master shard or a state tensor of it) all-gathered
    into the unit's whole padded flat buffer, in ``tensor``'s dtype."""
    if unit.world_size == 1:
        return tensor.detach().clone()
    flat = torch.empty(unit.padded, dtype=tensor.dtype, device=tensor.device)
    comm.all_gather_into_tensor(flat, tensor.detach().contiguous(), group=group)
    return flat


def param_views(unit, flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter of ``unit`` as a view into its whole ``flat`` buffer."""
    return [flat[offset:offset + param.numel()].view(param.shape) for param, offset in zip(unit.params, unit.offsets)]


def own_range(unit, flat: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a whole flat buffer."""
    start = unit.rank * unit.shard_numel
    return flat[start:start + unit.shard_numel]
