"""The planner's "fused" slices: a linear whose output is cut into k equal parts along its
last dim (HF GPT-2's c_attn -> q, k, v), column-parallel on a mesh axis with every part
keeping the shard (Megatron's fused qkv, ``ColwiseParallel(fused=k)``). The shard is
BLOCKED: on that axis rank r holds, of each part j of length L, the elements
[j·L + r·L/p, j·L + (r+1)·L/p), so the linear's weight rows (and bias) are stored per
part, the linear's local output is k blocks of L/p, and each slice takes its block
[j·L/p, (j+1)·L/p) locally: no communication, exact. Checked here: every consumer of
the linear is such a slice (step 1, equal lengths tiling the dim, each length divisible
by the axis size), the linear is column-parallel on that axis and its parameters are
read by it alone and sharded on no other axis; anything else is refused by name.
"""

from __future__ import annotations

import torch

from plait.names.placements import REPLICATE, shard, shard_dim
from plait.parallel.auto.execute_rules import LayoutRefused

__all__ = ["FusedPlan", "find_fused", "blocked_shard", "unblock"]


class FusedPlan:
    """``linears``: linear name -> {axis: k parts}; ``slices``: slice name -> {axis: p};
    ``params``: parameter name -> (dim, {axis: k})."""

    def __init__(self):
        self.linears: dict[str, dict[int, int]] = {}
        self.slices: dict[str, dict[int, int]] = {}
        self.params: dict[str, tuple[int, dict[int, int]]] = {}

    def divisor(self, slice_name: str) -> int:
        count = 1
        for size in self.slices.get(slice_name, {}).values():
            count *= size
        return count


def _is_fused(node, layout, axis: int) -> bool:
    placement = layout.inputs[0][axis] if layout.inputs else REPLICATE
    return (node.kind == "view" and node.attr("op") in ("slice", "narrow") and shard_dim(placement) is not None
            and shard_dim(placement) == node.attr("dim") and layout.output[axis] == placement)


def find_fused(graph, layouts: dict, mesh_shape) -> FusedPlan:
    """The fused slices of ``layouts`` and what they make blocked; LayoutRefused naming
    the node when a fused slice's producer or siblings do not fit."""
    plan = FusedPlan()
    readers: dict[str, int] = {}
    for node in graph.nodes:
        for name in node.params:
            readers[name] = readers.get(name, 0) + 1
    for node in graph.nodes:
        layout = layouts.get(node.name)
        for axis in range(len(mesh_shape)):
            if layout is None or not _is_fused(node, layout, axis):
                continue
            producer = graph.node(node.inputs[0])
            where = f"fused slice {node.name!r} of {producer.name!r} on mesh axis {axis}"
            if producer.name in plan.linears and axis in plan.linears[producer.name]:
                continue
            parts = graph.consumers(producer.name)
            p = mesh_shape[axis]
            if not all(layouts.get(part.name) is not None and _is_fused(part, layouts[part.name], axis)
                       for part in parts):
                raise LayoutRefused(f"{where}: every consumer of {producer.name!r} must take the fused shard on "
                                    f"this axis (got {[part.name for part in parts]}); the blocked output cannot "
                                    "be resharded: gather it before the slices instead")
            spans = sorted((part.attr("start"), part.attr("end"), part.attr("step", 1)) for part in parts)
            length = spans[0][1] - spans[0][0]
            tiled = [(j * length, (j + 1) * length, 1) for j in range(len(parts))] == spans
            if producer.kind != "linear" or not tiled or length % p or len(parts) * length != producer.shape[-1]:
                raise LayoutRefused(f"{where}: the slices must tile a linear's last dim in equal parts of a "
                                    f"length divisible by {p} (got {spans} of {producer.kind} {producer.shape})")
            producer_layout = layouts[producer.name]
            out_dim = producer.attr("weight_out_dim", 0)
            named = {producer.attr("weight"): out_dim}
            if producer.attr("bias"):
                named[producer.attr("bias")] = 0
            params = dict(producer_layout.params)
            for name, dim in named.items():
                others = [a for a, placement in enumerate(params[name]) if a != axis and placement != REPLICATE]
                if params[name][axis] != shard(dim) or others or readers[name] > 1:
                    raise LayoutRefused(f"{where}: {name!r} must be column-sharded (S{dim}) on this axis only and "
                                        f"read by {producer.name!r} alone (got {params[name]}, {readers[name]} "
                                        "readers)")
                entry = plan.params.setdefault(name, (dim, {}))
                entry[1][axis] = len(parts)
            plan.linears.setdefault(producer.name, {})[axis] = len(parts)
            for part in parts:
                plan.slices.setdefault(part.name, {})[axis] = p
    return plan


def blocked_shard(tensor: torch.Tensor, dim: int, parts: int, size: int, coord: int) -> torch.Tensor:
    """Rank ``coord`` of ``size``'s blocks: its 1/size of each of ``parts`` equal parts."""
    return torch.cat([part.chunk(size, dim=dim)[coord] for part in tensor.chunk(parts, dim=dim)], dim=dim)


def unblock(gathered: torch.Tensor, dim: int, parts: int, size: int) -> torch.Tensor:
    """The inverse of gathering blocked shards in rank order: rank r's block of part j
    (at r·parts + j) goes to j·size + r."""
    pieces = gathered.chunk(parts * size, dim=dim)
    return torch.cat([pieces[r * parts + j] for j in range(parts) for r in range(size)], dim=dim)
