"""reshard_steps' axis-by-axis paths, checked by simulating every rank of a mesh in one
process: each step is applied to every line of ranks along its axis with the plain
tensor operation its collective computes (sum, cat, chunk), and the ranks must end
holding exactly the shards the destination layout names (torch DTensor's nesting: a
dim sharded on both axes splits over axis 0 first). Every pair of layouts of a 2-d
tensor on the 2x2 and 2x3 meshes (and 1-D meshes), partial sums included. Exact
(integer-valued float64: sums are exact).
"""

import itertools

import pytest
import torch

from plait.names.placements import PARTIAL, REPLICATE, is_shard, shard_dim
from plait.parallel.auto.execute_views import shard_for
from plait.parallel.auto.reshard_steps import reshard_steps

PLACEMENTS = ("R", "P", "S0", "S1")


def _lines(mesh_shape, axis):
    """Coordinates of each line of ranks along ``axis`` (in coordinate order)."""
    others = [range(size) for a, size in enumerate(mesh_shape) if a != axis]
    for rest in itertools.product(*others):
        line = []
        for coord in range(mesh_shape[axis]):
            coords = list(rest)
            coords.insert(axis, coord)
            line.append(tuple(coords))
        yield line


def _start(whole, layout, mesh_shape, generator):
    """Every rank's local tensor of ``whole`` under ``layout``; a P axis splits the value
    into random integer summands along its lines."""
    local = {coords: shard_for(whole, [p if p != PARTIAL else REPLICATE for p in layout], coords, mesh_shape).clone()
             for coords in itertools.product(*(range(size) for size in mesh_shape))}
    for axis, placement in enumerate(layout):
        if placement != PARTIAL:
            continue
        for line in _lines(mesh_shape, axis):
            total = local[line[0]]
            parts = [torch.randint(-5, 6, total.shape, generator=generator).double() for _ in line[1:]]
            local[line[0]] = total - sum(parts)
            for coords, part in zip(line[1:], parts):
                local[coords] = part
    return local


def _step(local, mesh_shape, axis, src, dst):
    for line in _lines(mesh_shape, axis):
        tensors = [local[coords] for coords in line]
        p = len(line)
        if src == PARTIAL:
            tensors = [sum(tensors)] * p
        elif is_shard(src):
            tensors = [torch.cat(tensors, dim=shard_dim(src))] * p
        if dst == REPLICATE:
            out = tensors
        elif is_shard(dst):
            out = [tensor.chunk(p, dim=shard_dim(dst))[coord] for coord, tensor in enumerate(tensors)]
        else:  # R -> P
            out = [tensors[0] if coord == 0 else torch.zeros_like(tensors[0]) for coord in range(p)]
        for coords, tensor in zip(line, out):
            local[coords] = tensor


def _finish(local, layout, mesh_shape):
    """Sum the P axes' summands back (for the comparison)."""
    local = dict(local)
    for axis, placement in enumerate(layout):
        if placement == PARTIAL:
            for line in _lines(mesh_shape, axis):
                total = sum(local[coords] for coords in line)
                for coords in line:
                    local[coords] = total
    return local


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2), (2, 3)])
def test_every_layout_pair_reaches_its_shards(mesh_shape):
    generator = torch.Generator().manual_seed(0)
    whole = torch.arange(12 * 12, dtype=torch.float64).reshape(12, 12)
    layouts = list(itertools.product(PLACEMENTS, repeat=len(mesh_shape)))
    for src, dst in itertools.product(layouts, layouts):
        local = _start(whole, src, mesh_shape, generator)
        steps = reshard_steps(src, dst)
        for axis, before, after in steps:
            _step(local, mesh_shape, axis, before, after)
        done = _finish(local, dst, mesh_shape)
        for coords, tensor in done.items():
            want = shard_for(whole, [p if p != PARTIAL else REPLICATE for p in dst], coords, mesh_shape)
            assert torch.equal(tensor, want), f"{src} -> {dst} via {steps}: rank {coords} holds the wrong block"


def test_order_gathers_inner_first_and_slices_outer_first():
    """DTensor's nesting: (S0,S0) -> (R,R) gathers axis 1 first, (R,R) -> (S0,S0) slices axis
    0 first, and an axis-0 change of a dim axis 1 shards first takes axis 1 to R."""
    assert reshard_steps(("S0", "S0"), ("R", "R")) == ((1, "S0", "R"), (0, "S0", "R"))
    assert reshard_steps(("R", "R"), ("S0", "S0")) == ((0, "R", "S0"), (1, "R", "S0"))
    assert reshard_steps(("S0", "S0"), ("S1", "S0")) == ((1, "S0", "R"), (0, "S0", "S1"), (1, "R", "S0"))
    assert reshard_steps(("S1",), ("P",)) == ((0, "S1", "R"), (0, "R", "P"))
