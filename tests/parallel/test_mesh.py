"""ParallelDims (the rank <-> (dp, tp, pp) layout, pure arithmetic) and
DeviceMesh.create in a real 4-process gloo world.

Oracles: the layout is rebuilt here independently by enumerating the grid in the
mesh order (outermost axis slowest), so the k-th tuple enumerated is rank k; the
groups a real world builds are read back from torch.distributed
(get_process_group_ranks) and, as a second oracle, with an all_gather over each group.
"""

from __future__ import annotations

import itertools
import re

import pytest

from plait.parallel.mesh import AXES, DEFAULT_ORDER, DeviceMesh, ParallelDims
from plait.testing import run_distributed, run_fresh_world

ORDERS = [",".join(permutation) for permutation in itertools.permutations(AXES)]
# (dp, tp, pp): non-powers of two, size-1 axes, and the all-ones mesh.
SHAPES = [(1, 1, 1), (2, 3, 1), (3, 1, 2), (2, 2, 2), (1, 5, 3), (4, 3, 2)]


def expected_layout(dp: int, tp: int, pp: int, order: str) -> list[dict[str, int]]:
    """coords of every rank, by enumeration: the innermost axis (first in order) moves fastest."""
    sizes = {"dp": dp, "tp": tp, "pp": pp}
    axes = order.split(",")
    outermost_first = list(reversed(axes))
    layout = []
    for values in itertools.product(*(range(sizes[axis]) for axis in outermost_first)):
        layout.append(dict(zip(outermost_first, values)))
    return layout


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field, value", [("dp", 0), ("tp", -1), ("pp", 2.0), ("dp", True), ("tp", "2"),
                                          ("pp", None)])
def test_bad_size_names_the_axis_and_value(field, value):
    with pytest.raises(ValueError) as error:
        ParallelDims(**{field: value})
    message = str(error.value)
    assert message.startswith("invalid ParallelDims: ")
    assert f"{field}={value!r} must be a positive int" in message


def test_every_bad_size_is_reported_at_once():
    with pytest.raises(ValueError) as error:
        ParallelDims(dp=0, tp=-2, pp=1, order="tp,dp")
    message = str(error.value)
    assert "dp=0 must be a positive int" in message
    assert "tp=-2 must be a positive int" in message
    assert "pp=1" not in message
    assert "order='tp,dp' must list dp, tp and pp once each" in message


@pytest.mark.parametrize("order", ["tp,dp", "tp,dp,dp", "tp,dp,pp,dp", "x,y,z", "", "tp;dp;pp", "TP,DP,PP"])
def test_bad_order_names_it_and_shows_the_default(order):
    with pytest.raises(ValueError) as error:
        ParallelDims(order=order)
    message = str(error.value)
    assert f"order={order!r} must list dp, tp and pp once each, innermost first" in message
    assert repr(DEFAULT_ORDER) in message


@pytest.mark.parametrize("order", ORDERS + ["tp, dp , pp"])
def test_every_permutation_is_a_valid_order(order):
    dims = ParallelDims(dp=2, tp=3, pp=1, order=order)
    assert dims.axes == tuple(part.strip() for part in order.split(","))
    assert sorted(dims.axes) == sorted(AXES)


def test_defaults_and_world_size():
    dims = ParallelDims()
    assert (dims.dp, dims.tp, dims.pp, dims.order) == (1, 1, 1, "tp,dp,pp")
    assert dims.world_size == 1
    for dp, tp, pp in SHAPES:
        dims = ParallelDims(dp=dp, tp=tp, pp=pp)
        assert dims.world_size == dp * tp * pp
        assert {axis: dims.size(axis) for axis in AXES} == {"dp": dp, "tp": tp, "pp": pp}


def test_dims_are_frozen():
    dims = ParallelDims(dp=2)
    with pytest.raises(AttributeError):
        dims.dp = 3


def test_check_world_size_names_the_product_and_the_fix():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    dims.check_world_size(8)  # matches: no error
    with pytest.raises(ValueError) as error:
        dims.check_world_size(6)
    message = str(error.value)
    assert "dp(2) * tp(2) * pp(2) = 8 != world_size(6)" in message
    assert "launch 8 processes" in message
    assert "sizes whose product is 6" in message
    assert "[1, 2, 3, 6]" in message  # the sizes that can divide 6


def test_check_world_size_too_small():
    with pytest.raises(ValueError, match=re.escape("dp(1) * tp(3) * pp(1) = 3 != world_size(4)")):
        ParallelDims(tp=3).check_world_size(4)


# --------------------------------------------------------------------------- layout
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dp, tp, pp", SHAPES)
def test_coords_and_rank_of_are_inverse_bijections(dp, tp, pp, order):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, order=order)
    layout = expected_layout(dp, tp, pp, order)
    assert len(layout) == dims.world_size
    seen = set()
    for rank in range(dims.world_size):
        coords = dims.coords(rank)
        assert coords == layout[rank], f"rank {rank}"
        assert set(coords) == set(AXES)
        assert dims.rank_of(**coords) == rank
        seen.add(tuple(coords[axis] for axis in AXES))
    assert len(seen) == dims.world_size  # injective, so a bijection onto the grid
    for dp_rank, tp_rank, pp_rank in itertools.product(range(dp), range(tp), range(pp)):
        rank = dims.rank_of(dp=dp_rank, tp=tp_rank, pp=pp_rank)
        assert dims.coords(rank) == {"dp": dp_rank, "tp": tp_rank, "pp": pp_rank}


@pytest.mark.parametrize("dp, tp, pp", SHAPES)
def test_default_order_puts_tp_ranks_next_to_each_other(dp, tp, pp):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    for dp_rank, tp_rank, pp_rank in itertools.product(range(dp), range(tp), range(pp)):
        assert dims.rank_of(dp=dp_rank, tp=tp_rank, pp=pp_rank) == tp_rank + tp * (dp_rank + dp * pp_rank)
    for group in dims.groups("tp"):
        assert group == list(range(group[0], group[0] + tp))


def test_coords_and_rank_of_reject_out_of_range():
    dims = ParallelDims(dp=2, tp=3, pp=1)
    for rank in (-1, 6, 100):
        with pytest.raises(ValueError, match=re.escape(f"rank {rank} is not in [0, 6)")):
            dims.coords(rank)
    with pytest.raises(ValueError, match=re.escape("tp=3 is not in [0, 3)")):
        dims.rank_of(tp=3)
    with pytest.raises(ValueError, match=re.escape("pp=1 is not in [0, 1)")):
        dims.rank_of(pp=1)
    with pytest.raises(ValueError, match=re.escape("dp=-1 is not in [0, 2)")):
        dims.rank_of(dp=-1)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dp, tp, pp", SHAPES)
def test_groups_partition_the_ranks_along_one_axis(dp, tp, pp, order):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, order=order)
    layout = expected_layout(dp, tp, pp, order)
    for axis in AXES:
        groups = dims.groups(axis)
        assert len(groups) == dims.world_size // dims.size(axis)
        members = sorted(rank for group in groups for rank in group)
        assert members == list(range(dims.world_size)), f"{axis} groups do not partition the ranks"
        others = [other for other in AXES if other != axis]
        for group in groups:
            assert len(group) == dims.size(axis)
            # ordered by the axis coordinate: a rank's index in its group is its coordinate
            assert [layout[rank][axis] for rank in group] == list(range(dims.size(axis)))
            # members differ only in that coordinate
            fixed = {tuple(layout[rank][other] for other in others) for rank in group}
            assert len(fixed) == 1
            for rank in group:
                assert dims.group_of(axis, rank) == group
        # every line of the axis is some group: ranks agreeing off-axis share a group
        for rank, coords in enumerate(layout):
            same_line = [r for r, c in enumerate(layout) if all(c[o] == coords[o] for o in others)]
            assert sorted(dims.group_of(axis, rank)) == same_line


def test_groups_of_a_known_mesh():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    dims = ParallelDims(dp=3, tp=2, pp=1, order="dp,tp,pp")
    assert dims.groups("dp") == [[0, 1, 2], [3, 4, 5]]
    assert dims.groups("tp") == [[0, 3], [1, 4], [2, 5]]
    assert dims.groups("pp") == [[rank] for rank in range(6)]


def test_groups_reject_an_unknown_axis():
    with pytest.raises(ValueError, match="axis 'ep' must be one of"):
        ParallelDims(dp=2).groups("ep")


# --------------------------------------------------------------------------- describe
RANK_LINE = re.compile(r"^  rank +(\d+): dp (\d+) tp (\d+) pp (\d+)")


@pytest.mark.parametrize("dp, tp, pp, order", [(2, 3, 1, "tp,dp,pp"), (3, 1, 2, "pp,tp,dp"), (1, 1, 1, "dp,pp,tp"),
                                               (2, 2, 2, "dp,tp,pp")])
def test_describe_lists_every_rank_once_with_its_coordinates(dp, tp, pp, order):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, order=order)
    text = dims.describe()
    lines = text.splitlines()
    assert lines[0].startswith(f"mesh dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} processes (order {order}")
    ranks = []
    for line in lines[1:]:
        match = RANK_LINE.match(line)
        assert match, line
        rank, dp_rank, tp_rank, pp_rank = map(int, match.groups())
        ranks.append(rank)
        assert dims.coords(rank) == {"dp": dp_rank, "tp": tp_rank, "pp": pp_rank}
        assert f"tp group {dims.group_of('tp', rank)}" in line
        assert f"dp group {dims.group_of('dp', rank)}" in line
        assert f"pp group {dims.group_of('pp', rank)}" in line
        assert ("tp shard" in line) == (tp > 1)
    assert sorted(ranks) == list(range(dims.world_size))


def test_describe_shows_what_each_pipeline_rank_holds():
    dims = ParallelDims(dp=1, tp=2, pp=2)
    text = dims.describe({0: "embedding..block 1", 1: "block 2..head"}, " of every matrix")
    lines = text.splitlines()[1:]
    for line in lines:
        rank = int(RANK_LINE.match(line).group(1))
        coords = dims.coords(rank)
        assert f"stage {['embedding..block 1', 'block 2..head'][coords['pp']]}" in line
        assert f"tp shard {coords['tp'] + 1}/2 of every matrix" in line


# --------------------------------------------------------------------------- DeviceMesh, 4 real processes
def build_mesh_and_read_groups(rank, world_size, dims):
    """DeviceMesh.create, then what torch.distributed says each of this rank's groups holds."""
    import torch
    import torch.distributed as dist

    mesh = DeviceMesh.create(dims)
    report = {"rank": mesh.rank, "coords": mesh.coords, "ranks": dict(mesh.ranks), "group_ranks": {},
              "group_sizes": {}, "gathered": {}}
    for axis in AXES:
        group = mesh.group[axis]
        assert group is not None
        report["group_ranks"][axis] = dist.get_process_group_ranks(group)
        report["group_sizes"][axis] = dist.get_world_size(group)
        # Second oracle: every member of the group contributes its global rank.
        size = dist.get_world_size(group)
        pieces = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(pieces, torch.tensor([rank], dtype=torch.int64), group=group)
        report["gathered"][axis] = [int(piece.item()) for piece in pieces]
    return report


def create_with_wrong_world_size(rank, world_size, dims):
    try:
        DeviceMesh.create(dims)
    except ValueError as error:
        return str(error)
    return None


MESH_DIMS = [ParallelDims(dp=2, tp=2, pp=1), ParallelDims(dp=1, tp=2, pp=2), ParallelDims(dp=1, tp=1, pp=4),
             ParallelDims(dp=2, tp=1, pp=2, order="pp,tp,dp")]


@pytest.mark.slow
@pytest.mark.parametrize("dims", MESH_DIMS, ids=lambda d: f"dp{d.dp}-tp{d.tp}-pp{d.pp}-{d.order.replace(',', '')}")
def test_device_mesh_groups_match_the_layout(dims):
    reports = run_distributed(build_mesh_and_read_groups, 4, dims, timeout_s=60.0)
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        assert report["coords"] == dims.coords(rank)
        for axis in AXES:
            expected = dims.group_of(axis, rank)
            assert report["ranks"][axis] == expected, (rank, axis)
            assert report["group_ranks"][axis] == expected, (rank, axis)
            assert report["gathered"][axis] == expected, (rank, axis)
            assert report["group_sizes"][axis] == dims.size(axis)


@pytest.mark.slow
def test_device_mesh_size_one_axes_are_real_groups_of_one():
    dims = ParallelDims(dp=1, tp=1, pp=4)
    reports = run_distributed(build_mesh_and_read_groups, 4, dims, timeout_s=60.0)
    for rank, report in enumerate(reports):
        for axis in ("dp", "tp"):
            # a real group of size one, not None (which torch.distributed reads as the whole world)
            assert report["group_ranks"][axis] == [rank]
            assert report["group_sizes"][axis] == 1
            assert report["gathered"][axis] == [rank]
        assert report["group_ranks"]["pp"] == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("dims", [ParallelDims(dp=2, tp=2, pp=2), ParallelDims(tp=3)], ids=["8", "3"])
def test_device_mesh_rejects_a_mismatched_world(dims):
    messages = run_distributed(create_with_wrong_world_size, 4, dims, timeout_s=60.0)
    for message in messages:
        assert message is not None, "DeviceMesh.create accepted a world of the wrong size"
        assert f"dp({dims.dp}) * tp({dims.tp}) * pp({dims.pp}) = {dims.world_size} != world_size(4)" in message
        assert f"launch {dims.world_size} processes" in message


def create_without_a_world(rank, world_size):
    try:
        DeviceMesh.create(ParallelDims())
    except RuntimeError as error:
        return str(error)
    return None


def test_device_mesh_create_needs_an_initialised_world():
    """In a fresh process that never initialised torch.distributed (so the check
    cannot be masked by a group some other test left in this one)."""
    (message,) = run_fresh_world(create_without_a_world, 1, init=False, timeout_s=60.0)
    assert message is not None and "needs torch.distributed initialised" in message
