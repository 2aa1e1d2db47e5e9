"""Which slice of the unsharded tensor each parameter holds, and moving whole
state dicts in and out of a sharded model.

A sharded parameter carries ``param.tp_shard = ShardSpec(dim, full_size)``: rank r
of p holds rows [r*c, (r+1)*c) along ``dim`` of the full tensor zero-padded to
p*c rows, c = ceil(full_size / p) (only the vocabulary is ever padded; Megatron
pads it the same way). A fused projection (q|k|v in one matrix) carries
``ShardSpec(dim, full_size, parts=(q, k, v))``: rank r holds its 1/p of every part,
concatenated (q_r | k_r | v_r), so it keeps whole heads of each; ``gather`` puts the
parts back in the unsharded order. Parameters without ``tp_shard`` are replicated. Because
the layout is data on the parameter, ``shard_state_dict``, ``gather_state_dict``
and ``init_from_full`` work for any module built from plait's parallel layers.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from plait.parallel.tensor.group import TensorParallel
from plait.parallel.tensor.mappings import all_gather_dim0


@dataclass(frozen=True)
class ShardSpec:
    """Split along ``dim``; the unsharded tensor has ``full_size`` there. ``parts``:
    the sizes of a fused layout's parts along ``dim`` (they sum to ``full_size`` and
    each divides by p), each split on its own."""

    dim: int
    full_size: int
    parts: tuple[int, ...] | None = None

    def shard_size(self, tp_size: int) -> int:
        return -(-self.full_size // tp_size)

    def padded_size(self, tp_size: int) -> int:
        return self.shard_size(tp_size) * tp_size


def mark_sharded(param: nn.Parameter, dim: int, full_size: int, parts: tuple[int, ...] | None = None) -> nn.Parameter:
    param.tp_shard = ShardSpec(dim, full_size, parts)
    return param


def fused_gather_index(parts: tuple[int, ...], size: int) -> torch.Tensor:
    """Indices taking the rank-order concatenation of ``size`` fused shards
    (q_0 k_0 v_0 q_1 k_1 v_1 ...) to the unsharded order (q_0 q_1 ... k_0 k_1 ... v_0 ...)."""
    local = sum(parts) // size
    offsets = [sum(parts[:j]) // size for j in range(len(parts))]
    index = [rank * local + offsets[j] + i for j, part in enumerate(parts) for rank in range(size)
             for i in range(part // size)]
    return torch.tensor(index, dtype=torch.long)


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    return getattr(param, "tp_shard", None)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the unsharded tensor ``param`` is a slice of."""
    spec = shard_spec(param)
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = spec.full_size
    return tuple(shape)


def shard_tensor(full: torch.Tensor, spec: ShardSpec | None, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s slice of the unsharded ``full`` (zero rows where it is padded)."""
    if spec is None or size == 1:
        return full
    if full.shape[spec.dim] != spec.full_size:
        raise ValueError(f"expected size {spec.full_size} along dim {spec.dim}, got shape {tuple(full.shape)}")
    if spec.parts is not None:
        if any(part % size for part in spec.parts):
            raise ValueError(f"fused parts {spec.parts} do not each divide by tp={size}")
        pieces = full.split(list(spec.parts), dim=spec.dim)
        return torch.cat([piece.chunk(size, dim=spec.dim)[rank] for piece in pieces], dim=spec.dim)
    pad = spec.padded_size(size) - spec.full_size
    if pad:
        shape = list(full.shape)
        shape[spec.dim] = pad
        full = torch.cat([full, full.new_zeros(shape)], dim=spec.dim)
    return full.chunk(size, dim=spec.dim)[rank]


def _sharded_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by state-dict name (a tied parameter appears under each name)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    return {name: tensor for name, tensor in named.items() if name in model.state_dict()}


def shard_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor], tp: TensorParallel) -> None:
    """Load an unsharded state dict into the sharded ``model``: each rank copies its slice."""
    tensors = _sharded_tensors(model)
    missing = sorted(set(tensors) - set(full_state))
    unexpected = sorted(set(full_state) - set(tensors))
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            want = full_shape(tensor)
            given = tuple(full_state[name].shape)
            if given != want:
                raise ValueError(f"{name}: the unsharded tensor has shape {given}, the model expects {want}")
            tensor.copy_(shard_tensor(full_state[name], shard_spec(tensor), tp.rank, tp.size))


def gather_tensor(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The unsharded tensor, on every rank (an all-gather for sharded parameters)."""
    spec = shard_spec(tensor)
    if spec is None or tp.size == 1:
        return tensor.detach().clone()
    moved = tensor.detach().movedim(spec.dim, 0)
    gathered = all_gather_dim0(moved, tp)[: spec.full_size]
    if spec.parts is not None:
        gathered = gathered.index_select(0, fused_gather_index(spec.parts, tp.size).to(gathered.device))
    return gathered.movedim(0, spec.dim).contiguous()


def gather_state_dict(model: nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on every rank of the group (same keys and shapes as
    the model built with no tensor parallelism)."""
    tensors = _sharded_tensors(model)
    return {name: gather_tensor(tensors[name], tp) for name in model.state_dict()}


def gather_grads(model: nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor | None]:
    """Every parameter's unsharded gradient (None where it has none), by name."""
    out = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            out[name] = None
            continue
        grad = param.grad.detach()
        spec = shard_spec(param)
        if spec is not None:
            grad = grad.clone()
            grad.tp_shard = spec
        out[name] = gather_tensor(grad, tp)
    return out


def seed_for(seed: int, name: str) -> int:
    """A per-parameter seed: independent of construction order and of tp."""
    return zlib.crc32(f"{seed}:{name}".encode())


def init_from_full(model: nn.Module, tp: TensorParallel, seed: int,
                   draw: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]) -> None:
    """Initialise every parameter as the slice of an unsharded tensor drawn from a
    generator seeded by (seed, name): a model sharded p ways holds exactly the
    shards of the unsharded model with the same seed. ``draw(name, shape,
    generator)`` returns the full float64 tensor on the CPU (each rank draws the
    full tensor and keeps its slice: memory of one full parameter at a time)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            generator = torch.Generator().manual_seed(seed_for(seed, name))
            full = draw(name, full_shape(param), generator)
            param.copy_(shard_tensor(full, shard_spec(param), tp.rank, tp.size))
