"""The device mesh: world ranks laid out on a dp × tp × pp grid, one process group
per line of each axis.

``ParallelDims(dp=2, tp=2, pp=2, order="tp,dp,pp")`` lists the axes from the
innermost (consecutive ranks) to the outermost. With the default order the tp
ranks of a group are consecutive, so on a node of g processes a tp group of
size <= g never leaves the node (tensor parallelism talks every layer; data
parallelism once a step; pipeline parallelism only at stage boundaries):

    rank = tp_rank + tp · (dp_rank + dp · pp_rank)

``DeviceMesh.create(dims)`` builds every group of every axis (torch.distributed
requires each rank to take part in every new_group call, in the same order) and
keeps this rank's. Groups of size one are real groups too, so code never has to
treat "no group" (which in torch.distributed means the whole world) specially.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.names.axes import AXES, DEFAULT_ORDER, DP, PP, TP


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of the three axes and their order, innermost first."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    order: str = DEFAULT_ORDER

    def __post_init__(self):
        problems = [f"{axis}={getattr(self, axis)!r} must be a positive int" for axis in AXES
                    if isinstance(getattr(self, axis), bool) or not isinstance(getattr(self, axis), int)
                    or getattr(self, axis) < 1]
        axes = [part.strip() for part in str(self.order).split(",")]
        if sorted(axes) != sorted(AXES):
            problems.append(f"order={self.order!r} must list dp, tp and pp once each, innermost first "
                            f"(e.g. {DEFAULT_ORDER!r})")
        if problems:
            raise ValueError("invalid ParallelDims: " + "; ".join(problems))

    @property
    def axes(self) -> tuple[str, ...]:
        """Axes from innermost to outermost."""
        return tuple(part.strip() for part in self.order.split(","))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.world_size} != world_size"
                             f"({world_size}): launch {self.world_size} processes, or choose sizes whose product "
                             f"is {world_size} (each from {divisors})")

    def strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for axis in self.axes:
            strides[axis] = stride
            stride *= self.size(axis)
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """{"dp": i, "tp": j, "pp": k} of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        strides = self.strides()
        return {axis: rank // strides[axis] % self.size(axis) for axis in AXES}

    def rank_of(self, *, dp: int = 0, tp: int = 0, pp: int = 0) -> int:
        strides = self.strides()
        coords = {DP: dp, TP: tp, PP: pp}
        for axis, value in coords.items():
            if not 0 <= value < self.size(axis):
                raise ValueError(f"{axis}={value} is not in [0, {self.size(axis)})")
        return sum(coords[axis] * strides[axis] for axis in AXES)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis``: the ranks that differ only in that coordinate,
        ordered by it (so a rank's index in its group is its coordinate)."""
        if axis not in AXES:
            raise ValueError(f"axis {axis!r} must be one of {AXES}")
        others = [a for a in AXES if a != axis]
        result = []
        for first in range(self.size(others[0])):
            for second in range(self.size(others[1])):
                fixed = {others[0]: first, others[1]: second}
                result.append([self.rank_of(**fixed, **{axis: i}) for i in range(self.size(axis))])
        return sorted(result)

    def group_of(self, axis: str, rank: int) -> list[int]:
        return next(group for group in self.groups(axis) if rank in group)

    def describe(self, stage_layers: dict[int, str] | None = None, shard_note: str = "") -> str:
        """One line per rank: its coordinates, its tp/dp/pp peers and, if given, what
        its pipeline rank holds (``stage_layers[pp_rank]``)."""
        lines = [f"mesh dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.world_size} processes "
                 f"(order {self.order}, innermost first)"]
        for rank in range(self.world_size):
            c = self.coords(rank)
            holds = f"  stage {stage_layers[c['pp']]}" if stage_layers else ""
            shard = f"  tp shard {c['tp'] + 1}/{self.tp}{shard_note}" if self.tp > 1 else ""
            lines.append(f"  rank {rank:>3}: dp {c['dp']} tp {c['tp']} pp {c['pp']}{holds}{shard}  "
                         f"(tp group {self.group_of('tp', rank)}, dp group {self.group_of('dp', rank)}, "
                         f"pp group {self.group_of('pp', rank)})")
        return "\n".join(lines)


@dataclass
class DeviceMesh:
    """This rank's place in the mesh and its three process groups."""

    dims: ParallelDims
    rank: int
    coords: dict[str, int]
    group: dict[str, object] = field(default_factory=dict)  # axis -> torch.distributed group holding this rank
    ranks: dict[str, list[int]] = field(default_factory=dict)  # axis -> the global ranks of that group

    @classmethod
    def create(cls, dims: ParallelDims) -> "DeviceMesh":
        """Build every group of every axis (collectively: all ranks must call this
        with the same dims) and return this rank's mesh."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DeviceMesh.create needs torch.distributed initialised (run under torchrun)")
        dims.check_world_size(dist.get_world_size())
        rank = dist.get_rank()
        mesh = cls(dims=dims, rank=rank, coords=dims.coords(rank))
        for axis in AXES:
            for ranks in dims.groups(axis):
                group = dist.new_group(ranks)
                if rank in ranks:
                    mesh.group[axis], mesh.ranks[axis] = group, ranks
        return mesh

    def size(self, axis: str) -> int:
        return self.dims.size(axis)
