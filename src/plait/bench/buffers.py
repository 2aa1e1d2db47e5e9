"""Benchmark buffers, seeded rank-distinct inputs and the locally computed oracle.

Every rank rebuilds all ranks' inputs from fixed seeds (rank r draws from
Generator(seed * 1_000_003 + r)) and checks its own output against
plait.comm.reference (float64/int64 expected values and an error bound derived
from the dtype's unit roundoff; integers exactly, with the dtype's wrap-around).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.comm.algorithms import COLLECTIVES as ALL_COLLECTIVES
from plait.comm.algorithms import REDUCING, ROOTED
from plait.comm.reference import count_wrong as reference_count_wrong
from plait.comm.reference import reference

TORCH_ALGORITHM = "torch"

COLLECTIVES = ALL_COLLECTIVES
# Size = p * chunk; count printed = chunk (nccl-tests' "paramcount").
CHUNKED_COLLECTIVES = frozenset({"reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"})
ROOTED_COLLECTIVES = frozenset(ROOTED)
REDUCING_COLLECTIVES = frozenset(REDUCING)

OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int8": torch.int8, "uint8": torch.uint8,
           "int32": torch.int32, "int64": torch.int64}
_DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "bf16": "bfloat16",
                  "int": "int32", "long": "int64"}
# The names nccl-tests prints in its "type" column.
NCCL_TYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half",
                   "bfloat16": "bfloat16", "int8": "int8", "uint8": "uint8",
                   "int32": "int32", "int64": "int64"}
DTYPE_NAMES = tuple(_DTYPES)


def canonical_dtype_name(name: str) -> str:
    """'float' -> 'float32' etc.; raises ValueError listing the valid names."""
    key = name.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in _DTYPES:
        valid = ", ".join([*_DTYPES, *_DTYPE_ALIASES])
        raise ValueError(f"unknown dtype {name!r}; valid: {valid}")
    return key


def parse_dtype(name: str) -> torch.dtype:
    return _DTYPES[canonical_dtype_name(name)]


@dataclass
class Buffers:
    """tensor: the input (in place for all_reduce/broadcast/reduce; the output of
    scatter); output: the separate output of reduce_scatter/all_gather/all_to_all;
    chunks: gather_list / scatter_list on the root (None elsewhere)."""

    tensor: torch.Tensor
    output: torch.Tensor | None = None
    chunks: list[torch.Tensor] | None = None

    def zero_(self) -> None:
        self.tensor.zero_()
        if self.output is not None:
            self.output.zero_()
        for chunk in self.chunks or []:
            chunk.zero_()


def make_buffers(collective: str, count: int, dtype: torch.dtype, device: torch.device,
                 rank: int, world_size: int, root: int) -> Buffers:
    """Zeroed buffers for one call; count is the per-rank chunk for chunked collectives."""

    def zeros(numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    p = world_size
    if collective in ("all_reduce", "broadcast", "reduce"):
        return Buffers(zeros(count))
    if collective == "reduce_scatter":  # input [p * count] -> output [count]
        return Buffers(zeros(p * count), output=zeros(count))
    if collective == "all_gather":  # input [count] -> output [p * count]
        return Buffers(zeros(count), output=zeros(p * count))
    if collective == "all_to_all":  # input [p * count] -> output [p * count]
        return Buffers(zeros(p * count), output=zeros(p * count))
    if collective in ("gather", "scatter"):  # root holds p chunks of [count]
        chunks = list(zeros(p * count).chunk(p)) if rank == root else None
        return Buffers(zeros(count), chunks=chunks)
    if collective == "barrier":
        return Buffers(zeros(0))
    raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")


def rank_input(collective: str, rank: int, count: int, world_size: int, dtype: torch.dtype,
               seed: int) -> torch.Tensor:
    """The seeded CPU input of `rank`: [p * count] for reduce_scatter, all_to_all and
    scatter (the root's p chunks), else [count]. Floats uniform in [-1, 1), integers
    in [-8, 8] ([0, 8] unsigned)."""
    numel = world_size * count if collective in ("reduce_scatter", "all_to_all", "scatter") else count
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    if dtype.is_floating_point:
        values = torch.rand(numel, generator=generator, dtype=torch.float64) * 2 - 1
    else:
        low = 0 if dtype == torch.uint8 else -8
        values = torch.randint(low, 9, (numel,), generator=generator, dtype=torch.int64)
    return values.to(dtype)


def fill_inputs(buffers: Buffers, collective: str, rank: int, world_size: int, count: int,
                seed: int) -> None:
    """Load this rank's seeded input; outputs keep zeros, non-root broadcast ranks
    hold their own data, so a call that does nothing is caught."""
    if collective == "barrier":
        return
    values = rank_input(collective, rank, count, world_size, buffers.tensor.dtype, seed)
    if collective == "scatter":
        if buffers.chunks is not None:
            for index, chunk in enumerate(buffers.chunks):
                chunk.copy_(values[index * count:(index + 1) * count])
        buffers.tensor.fill_(0)
    else:
        buffers.tensor.copy_(values)


def expected_output(collective: str, op: str, rank: int, world_size: int, root: int, count: int,
                    dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(expected, allowed error) for this rank's output in float64/int64 from
    plait.comm.reference, or None where the rank's output is unspecified (non-root
    ranks of reduce and gather)."""
    if (collective == "reduce" or collective == "gather") and rank != root:
        return None
    inputs = [rank_input(collective, source, count, world_size, dtype, seed) for source in range(world_size)]
    expected, bounds = reference(collective, inputs, op, root)
    result = expected[rank]
    if not dtype.is_floating_point:  # wrap around exactly as the dtype does
        result = result.to(dtype).to(torch.int64)
    return result, bounds[rank]


def count_wrong(buffers: Buffers, collective: str, op: str, rank: int, world_size: int, root: int,
                count: int, seed: int) -> int:
    """Elements of this rank's output outside the tolerance (NaN counts as wrong)."""
    if collective == "barrier":
        return 0
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        result = buffers.output
    elif collective == "gather":
        result = torch.cat(buffers.chunks) if buffers.chunks is not None else None
    else:
        result = buffers.tensor
    oracle = expected_output(collective, op, rank, world_size, root, count, buffers.tensor.dtype, seed)
    if oracle is None or result is None:
        return 0
    expected, bound = oracle
    return reference_count_wrong(result.detach().cpu(), expected, bound)
