"""The check that a view or permute node runs exactly on local shards: move an index
tensor. Each input is filled with distinct integers (its global element ids), the
node runs once on the whole tensors and once per mesh coordinate on that
coordinate's shards (local target shapes); the local result must equal the
coordinate's shard of the whole result, element for element. That covers every
data-moving op (view, reshape, flatten, split + getitem, slice, select, cat,
transpose, permute, expand, unsqueeze, ...) with one rule, at the cost of running
the node on integer tensors of its global size once per coordinate, at build time.
"""

from __future__ import annotations

import itertools

import torch

from plait.names.placements import PARTIAL, is_shard, shard_dim
from plait.parallel.auto.execute_node import NodeContext, run_members
from plait.parallel.auto.execute_rules import LayoutRefused

__all__ = ["shard_for", "check_view"]


def shard_for(tensor: torch.Tensor, layout, coords, mesh_shape) -> torch.Tensor:
    """The block of the whole ``tensor`` that mesh coordinates ``coords`` hold under
    ``layout`` (R and P: the whole; S<d>: axis 0's chunk, then axis 1's within it)."""
    for placement, coord, size in zip(layout, coords, mesh_shape):
        if is_shard(placement):
            tensor = tensor.chunk(size, dim=shard_dim(placement))[coord]
    return tensor


def check_view(node, layout, input_shapes, fx_nodes, order, mesh_shape, positions) -> None:
    """LayoutRefused unless ``node`` (kind view or permute) gives, on every mesh
    coordinate, the shard ``layout.output`` says of its whole result. ``positions``:
    fx name of each producer's value -> its index in ``node.inputs``."""
    for axis in range(len(mesh_shape)):
        partial_in = [inp[axis] == PARTIAL for inp in layout.inputs]
        if (layout.output[axis] == PARTIAL) != (any(partial_in) and all(partial_in)):
            raise LayoutRefused(f"node {node.name!r} ({node.kind}, {node.target}) on mesh axis {axis}: inputs "
                                f"{[inp[axis] for inp in layout.inputs]} give output {layout.output[axis]}; a view "
                                "keeps a partial sum partial and never makes one")
    offset, wholes = 0, []
    for shape in input_shapes:
        count = 1
        for size in shape:
            count *= size
        wholes.append(torch.arange(offset, offset + count, dtype=torch.int64).reshape(shape))
        offset += count
    def lookup_for(tensors):
        def lookup(fx_node):
            return tensors[positions[fx_node.name]]
        return lookup

    whole_ctx = NodeContext(node, layout, fx_nodes, order, (0,) * len(mesh_shape), mesh_shape, None)
    expected_whole = run_members(whole_ctx, lookup_for(wholes), whole=True)
    for coords in itertools.product(*(range(size) for size in mesh_shape)):
        shards = [shard_for(whole, inp, coords, mesh_shape) for whole, inp in zip(wholes, layout.inputs)]
        ctx = NodeContext(node, layout, fx_nodes, order, coords, mesh_shape, None)
        try:
            got = run_members(ctx, lookup_for(shards))
        except (RuntimeError, IndexError) as error:
            raise LayoutRefused(f"node {node.name!r} ({node.kind}, {node.target}): inputs "
                                f"{list(layout.inputs)} -> output {layout.output} does not run on local shards "
                                f"({str(error).splitlines()[0]}); choose layouts that do not shard a dim it "
                                "slices, splits or merges into an inner position") from None
        want = shard_for(expected_whole, layout.output, coords, mesh_shape)
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
            raise LayoutRefused(f"node {node.name!r} ({node.kind}, {node.target}): inputs {list(layout.inputs)} -> "
                                f"output {layout.output} moves the wrong elements on mesh coordinates {coords} (a "
                                "sharded dim is sliced, split, concatenated or merged into an inner position); "
                                "choose other layouts or reshard before it")

