"""The logical device mesh an auto-parallel plan lays tensors on (1 or 2 axes), torch-free:
which ranks form each axis's groups, for the planner's prices and the executor's groups."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AutoMesh"]


@dataclass(frozen=True)
class AutoMesh:
    """A logical device mesh of ``shape`` (1 or 2 axes) over ranks ``first_rank`` ..
    ``first_rank + prod(shape) - 1`` of a Cluster, row-major: rank = first_rank +
    i0·shape[1] + i1. Axis 0's groups are ranks shape[1] apart, axis 1's consecutive
    (so on a cluster of nodes, axis 1 stays inside a node when it fits)."""

    shape: tuple[int, ...]
    first_rank: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.shape, tuple) and 1 <= len(self.shape) <= 2
                and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in self.shape)):
            raise ValueError(f"mesh shape={self.shape!r} must be a tuple of 1 or 2 whole numbers >= 1, e.g. (4,) or "
                             "(2, 2)")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axis: int) -> int:
        return self.shape[axis]

    def axis_stride(self, axis: int) -> int:
        """Rank distance between neighbours along ``axis`` (what Cluster.collective_time_s takes)."""
        return math.prod(self.shape[axis + 1:])

    def coords(self, rank: int) -> tuple[int, ...]:
        offset = rank - self.first_rank
        if not 0 <= offset < self.size:
            raise ValueError(f"rank {rank} is not in the mesh of ranks {self.first_rank}..{self.first_rank + self.size - 1}")
        return tuple((offset // self.axis_stride(axis)) % size for axis, size in enumerate(self.shape))

    def axis_group(self, rank: int, axis: int) -> list[int]:
        """The global ranks along ``axis`` through ``rank`` (its group for that axis)."""
        coords = self.coords(rank)
        stride = self.axis_stride(axis)
        base = rank - coords[axis] * stride
        return [base + i * stride for i in range(self.shape[axis])]

    def text(self) -> str:
        return "x".join(map(str, self.shape))
