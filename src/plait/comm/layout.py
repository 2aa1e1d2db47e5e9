"""How each collective lays its tensors out in the one flat buffer a schedule works on.

``prepare_*`` validates a rank's arguments the way torch.distributed does, at call
time, and returns a :class:`Prepared` whose ``build()`` makes the flat buffer (a view
of the caller's tensor when possible, so results land in place) and whose
``finish(buffer)`` copies results back and applies AVG's division. ``build`` runs
when the collective itself runs: an async collective queued behind others reads
its inputs only after they have finished, as torch's do.

Tensors are detached first (same storage), so parameters that require grad can be
reduced in place, as with torch.distributed. A torch DTensor is refused by name: which
elements a rank holds is its placements' business (``to_local()`` is this rank's shard).
``torch.distributed.tensor`` costs ~0.6 s to import, so it is not imported here: a
DTensor can only exist once its module is loaded, and :func:`is_dtensor` looks it up
in ``sys.modules`` (no module is loaded, nothing is stored).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a torch DTensor (never true before torch.distributed.tensor
    has been imported by whoever made one)."""
    module = sys.modules.get(DTENSOR_MODULE)
    return module is not None and isinstance(tensor, module.DTensor)


@dataclass
class Prepared:
    numel: int  # elements of the flat buffer
    build: Callable[[], torch.Tensor]  # -> 1-D contiguous buffer the schedule runs on
    finish: Callable[[torch.Tensor], None]


def _flat(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(1-D contiguous buffer, whether it is a copy that must be written back)."""
    if tensor.is_contiguous():
        return tensor.view(-1), False
    return tensor.reshape(-1).clone(), True


def check_tensor(tensor, name: str, collective: str) -> torch.Tensor:
    """``tensor`` detached, or a TypeError naming the argument (a list, a number or a
    NumPy array given where a collective takes a tensor, as torch refuses it)."""
    if not isinstance(tensor, torch.Tensor):
        hint = ""
        if isinstance(tensor, (list, tuple)) or hasattr(tensor, "__array__") or isinstance(tensor, (int, float)):
            hint = " (wrap the data in one: torch.tensor(...) or torch.as_tensor(...))"
        raise TypeError(f"{collective}: {name} must be a torch.Tensor, got {type(tensor).__name__}{hint}")
    if is_dtensor(tensor):  # plait would run on its local shard on some ranks and its dispatch on others
        raise TypeError(f"{collective}: {name} is a DTensor ({tuple(tensor.placements)} on {tensor.device_mesh}); "
                        f"plait's collectives take plain tensors: pass {name}.to_local() (this rank's shard), or "
                        "use the DTensor's own redistribute() / full_tensor()")
    return tensor.detach()


def _average(view: torch.Tensor, op: str, world_size: int) -> None:
    if op == "avg":
        view.div_(world_size)


def prepare_all_reduce(tensor, rank: int, p: int, op: str) -> Prepared:
    tensor = check_tensor(tensor, "tensor", "all_reduce")
    copied = not tensor.is_contiguous()

    def finish(buffer):
        _average(buffer, op, p)
        if copied:
            tensor.copy_(buffer.view_as(tensor))

    return Prepared(tensor.numel(), lambda: _flat(tensor)[0], finish)


def _check_dtypes(output, input, collective: str) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{collective}: output dtype {output.dtype} != input dtype {input.dtype}; use one dtype")


def prepare_reduce_scatter(output, input, rank: int, p: int, op: str) -> Prepared:
    output = check_tensor(output, "output", "reduce_scatter")
    input = check_tensor(input, "input", "reduce_scatter")
    _check_dtypes(output, input, "reduce_scatter")
    m = output.numel()
    if input.numel() != p * m:
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, but it must hold world_size * output "
            f"= {p} * {m} = {p * m}"
        )

    def finish(buffer):
        mine = buffer[rank * m : (rank + 1) * m]
        _average(mine, op, p)
        output.copy_(mine.view_as(output))

    # the input is left untouched, as in torch: the schedule runs on a copy
    return Prepared(p * m, lambda: input.reshape(-1).clone(), finish)


def prepare_all_gather(output, input, rank: int, p: int) -> Prepared:
    output = check_tensor(output, "output", "all_gather")
    input = check_tensor(input, "input", "all_gather")
    _check_dtypes(output, input, "all_gather")
    m = input.numel()
    if output.numel() != p * m:
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, but it must hold world_size * input "
            f"= {p} * {m} = {p * m}"
        )
    copied = not output.is_contiguous()

    def build():
        buffer = _flat(output)[0]
        buffer[rank * m : (rank + 1) * m].copy_(input.reshape(-1))
        return buffer

    def finish(buffer):
        if copied:
            output.copy_(buffer.view_as(output))

    return Prepared(p * m, build, finish)


def prepare_broadcast(tensor, rank: int, p: int, root: int) -> Prepared:
    tensor = check_tensor(tensor, "tensor", "broadcast")
    copied = not tensor.is_contiguous()

    def finish(buffer):
        if copied and rank != root:
            tensor.copy_(buffer.view_as(tensor))

    return Prepared(tensor.numel(), lambda: _flat(tensor)[0], finish)


def prepare_reduce(tensor, rank: int, p: int, root: int, op: str) -> Prepared:
    tensor = check_tensor(tensor, "tensor", "reduce")
    copied = rank == root and not tensor.is_contiguous()

    def build():
        if rank == root:
            return _flat(tensor)[0]
        # partial results pass through non-root ranks; their tensors stay as they were
        return tensor.reshape(-1).clone()

    def finish(buffer):
        if rank == root:
            _average(buffer, op, p)
            if copied:
                tensor.copy_(buffer.view_as(tensor))

    return Prepared(tensor.numel(), build, finish)


def _check_list(tensors, tensor, p: int, name: str, collective: str, needed: bool) -> list | None:
    if not needed:
        if tensors:
            raise ValueError(f"{collective}: {name} must be None or empty on non-root ranks")
        return None
    if tensors is None or len(tensors) != p:
        got = "None" if tensors is None else f"{len(tensors)} tensors"
        raise ValueError(f"{collective}: the root's {name} must hold world_size = {p} tensors, got {got}")
    checked = []
    for i, item in enumerate(tensors):
        item = check_tensor(item, f"{name}[{i}]", collective)
        if item.numel() != tensor.numel() or item.dtype != tensor.dtype:
            raise ValueError(
                f"{collective}: {name}[{i}] has {item.numel()} elements of {item.dtype}; "
                f"every entry must match the tensor ({tensor.numel()} of {tensor.dtype})"
            )
        checked.append(item)
    return checked


def prepare_gather(tensor, gather_list, rank: int, p: int, root: int) -> Prepared:
    tensor = check_tensor(tensor, "tensor", "gather")
    gather_list = _check_list(gather_list, tensor, p, "gather_list", "gather", rank == root)
    m = tensor.numel()

    def build():
        buffer = torch.empty(p * m, dtype=tensor.dtype, device=tensor.device)
        buffer[rank * m : (rank + 1) * m].copy_(tensor.reshape(-1))
        return buffer

    def finish(buffer):
        if rank == root:
            for i, item in enumerate(gather_list):
                item.copy_(buffer[i * m : (i + 1) * m].view_as(item))

    return Prepared(p * m, build, finish)


def prepare_scatter(tensor, scatter_list, rank: int, p: int, root: int) -> Prepared:
    tensor = check_tensor(tensor, "tensor", "scatter")
    scatter_list = _check_list(scatter_list, tensor, p, "scatter_list", "scatter", rank == root)
    m = tensor.numel()

    def build():
        buffer = torch.empty(p * m, dtype=tensor.dtype, device=tensor.device)
        if rank == root:
            for i, item in enumerate(scatter_list):
                buffer[i * m : (i + 1) * m].copy_(item.reshape(-1))
        return buffer

    def finish(buffer):
        tensor.copy_(buffer[rank * m : (rank + 1) * m].view_as(tensor))

    return Prepared(p * m, build, finish)


def prepare_all_to_all(output, input, rank: int, p: int) -> Prepared:
    output = check_tensor(output, "output", "all_to_all")
    input = check_tensor(input, "input", "all_to_all")
    _check_dtypes(output, input, "all_to_all_single")
    if output.numel() != input.numel():
        raise ValueError(
            f"all_to_all_single: output has {output.numel()} elements and input {input.numel()}; "
            "with equal splits they must be the same size"
        )
    if input.numel() % p:
        raise ValueError(
            f"all_to_all_single: input of {input.numel()} elements does not split into world_size = {p} "
            "equal chunks; pad it, or pass split sizes (which use algorithm='torch')"
        )
    m = input.numel() // p

    def build():
        # buffer = [input | output]: rank s's input chunk d lands in rank d's output chunk s
        buffer = torch.empty(2 * p * m, dtype=input.dtype, device=input.device)
        flat = input.reshape(-1)
        buffer[: p * m].copy_(flat)
        buffer[p * m + rank * m : p * m + (rank + 1) * m].copy_(flat[rank * m : (rank + 1) * m])
        return buffer

    def finish(buffer):
        output.copy_(buffer[p * m :].view_as(output))

    return Prepared(2 * p * m, build, finish)


def prepare_barrier(device) -> Prepared:
    return Prepared(1, lambda: torch.zeros(1, dtype=torch.int32, device=device), lambda buffer: None)


def check_split_sizes(name: str, sizes, tensor, p: int) -> None:
    """torch's rules for one side of an uneven all-to-all, checked before any message: None
    (equal chunks of dim 0), or p whole numbers >= 0 adding up to the tensor's dim 0."""
    if sizes is None or (isinstance(sizes, (list, tuple)) and len(sizes) == 0):
        if tensor.dim() == 0 or tensor.shape[0] % p:
            raise ValueError(f"all_to_all: {name} not given, so dim 0 of the tensor ({tuple(tensor.shape)}) must "
                             f"split into {p} equal chunks; give {name} (p = {p} sizes)")
        return
    if not isinstance(sizes, (list, tuple)):
        raise TypeError(f"all_to_all: {name} must be a list of {p} whole numbers (rows of dim 0 per rank), got "
                        f"{type(sizes).__name__}")
    bad = [value for value in sizes if isinstance(value, bool) or not isinstance(value, int) or value < 0]
    if bad:
        raise ValueError(f"all_to_all: {name}={list(sizes)!r} holds {bad[0]!r}: every size is a whole number of "
                         "rows >= 0")
    if len(sizes) != p:
        raise ValueError(f"all_to_all: {name} has {len(sizes)} sizes for a group of {p} ranks: give one per rank")
    rows = tensor.shape[0] if tensor.dim() else 1
    if sum(sizes) != rows:
        raise ValueError(f"all_to_all: {name}={list(sizes)!r} adds up to {sum(sizes)} rows, but dim 0 of the "
                         f"tensor has {rows}: they must be equal")


def group_root(communicator, global_root, group_root, name: str) -> int:
    """The group rank of a rooted collective's root: torch's ``src``/``dst`` are global
    ranks, ``group_src``/``group_dst`` group ranks (give one of them)."""
    if global_root is not None and group_root is not None:
        raise ValueError(f"{name}={global_root} and group_{name}={group_root} both given: pass the global rank as "
                         f"{name} or the group rank as group_{name}, not both")
    if group_root is not None:
        if isinstance(group_root, bool) or not isinstance(group_root, int):
            raise TypeError(f"group_{name} must be an int group rank, got {type(group_root).__name__}")
        if not 0 <= group_root < communicator.size:
            raise ValueError(f"group_{name}={group_root} is not a rank of this group of {communicator.size} ranks "
                             f"(0..{communicator.size - 1})")
        return group_root
    root = 0 if global_root is None else global_root
    if isinstance(root, bool) or not isinstance(root, int):
        raise TypeError(f"{name} must be an int rank, got {type(root).__name__}")
    if root not in communicator.ranks:
        raise ValueError(f"{name}={root} (a global rank) is not a member of this {communicator.describe()}; "
                         f"pass one of its global ranks, or its group rank as group_{name}=")
    return communicator.ranks.index(root)
