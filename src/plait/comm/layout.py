"""How each collective lays its tensors out in the one flat buffer a schedule works on.

``prepare_*`` validates a rank's arguments the way torch.distributed does, returns the
flat buffer (a view of the caller's tensor when possible, so results land in place)
and a ``finish`` callback that copies results back and applies AVG's division.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Prepared:
    buffer: torch.Tensor  # 1-D, contiguous: what the schedule runs on
    finish: Callable[[], None]
    nbytes: int  # the collective's size as nccl-tests counts it


def _flat_view(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(1-D contiguous buffer, whether it is a copy that must be written back)."""
    if tensor.is_contiguous():
        return tensor.view(-1), False
    return tensor.reshape(-1).clone(), True


def _check_tensor(tensor, name: str, collective: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{collective}: {name} must be a torch.Tensor, got {type(tensor).__name__}")


def _average(view: torch.Tensor, op: str, world_size: int) -> None:
    if op == "avg":
        view.div_(world_size)


def prepare_all_reduce(tensor, rank: int, p: int, op: str) -> Prepared:
    _check_tensor(tensor, "tensor", "all_reduce")
    buffer, copied = _flat_view(tensor)

    def finish():
        _average(buffer, op, p)
        if copied:
            tensor.copy_(buffer.view_as(tensor))

    return Prepared(buffer, finish, buffer.numel() * buffer.element_size())


def _check_pair(output, input, p: int, collective: str, out_factor: int, in_factor: int) -> None:
    _check_tensor(output, "output", collective)
    _check_tensor(input, "input", collective)
    if output.dtype != input.dtype:
        raise TypeError(f"{collective}: output dtype {output.dtype} != input dtype {input.dtype}; use one dtype")
    if output.numel() * out_factor != input.numel() * in_factor:
        want = "p * output" if in_factor == 1 else "p * input"
        raise ValueError(
            f"{collective}: input has {input.numel()} elements and output {output.numel()}, "
            f"but {'input' if in_factor == 1 else 'output'} must have {want} = "
            f"{p} * {output.numel() if in_factor == 1 else input.numel()} elements (p = {p})"
        )


def prepare_reduce_scatter(output, input, rank: int, p: int, op: str) -> Prepared:
    _check_pair(output, input, p, "reduce_scatter", p, 1)
    buffer = input.reshape(-1).clone()  # the input is left untouched, as in torch
    m = output.numel()

    def finish():
        mine = buffer[rank * m : (rank + 1) * m]
        _average(mine, op, p)
        output.copy_(mine.view_as(output))

    return Prepared(buffer, finish, buffer.numel() * buffer.element_size())


def prepare_all_gather(output, input, rank: int, p: int) -> Prepared:
    _check_pair(output, input, p, "all_gather", 1, p)
    buffer, copied = _flat_view(output)
    m = input.numel()
    buffer[rank * m : (rank + 1) * m].copy_(input.reshape(-1))

    def finish():
        if copied:
            output.copy_(buffer.view_as(output))

    return Prepared(buffer, finish, buffer.numel() * buffer.element_size())


def prepare_broadcast(tensor, rank: int, p: int, root: int) -> Prepared:
    _check_tensor(tensor, "tensor", "broadcast")
    buffer, copied = _flat_view(tensor)

    def finish():
        if copied and rank != root:
            tensor.copy_(buffer.view_as(tensor))

    return Prepared(buffer, finish, buffer.numel() * buffer.element_size())


def prepare_reduce(tensor, rank: int, p: int, root: int, op: str) -> Prepared:
    _check_tensor(tensor, "tensor", "reduce")
    if rank == root:
        buffer, copied = _flat_view(tensor)
    else:  # partial sums pass through non-root ranks; their tensors stay as they were
        buffer, copied = tensor.reshape(-1).clone(), False

    def finish():
        if rank == root:
            _average(buffer, op, p)
            if copied:
                tensor.copy_(buffer.view_as(tensor))

    return Prepared(buffer, finish, buffer.numel() * buffer.element_size())


def _check_list(tensors, tensor, p: int, name: str, collective: str, needed: bool) -> None:
    if not needed:
        if tensors:
            raise ValueError(f"{collective}: {name} must be None or empty on non-root ranks")
        return
    if tensors is None or len(tensors) != p:
        got = "None" if tensors is None else f"{len(tensors)} tensors"
        raise ValueError(f"{collective}: the root's {name} must hold world_size = {p} tensors, got {got}")
    for i, item in enumerate(tensors):
        _check_tensor(item, f"{name}[{i}]", collective)
        if item.numel() != tensor.numel() or item.dtype != tensor.dtype:
            raise ValueError(
                f"{collective}: {name}[{i}] has {item.numel()} elements of {item.dtype}; "
                f"every entry must match the tensor ({tensor.numel()} of {tensor.dtype})"
            )


def prepare_gather(tensor, gather_list, rank: int, p: int, root: int) -> Prepared:
    _check_tensor(tensor, "tensor", "gather")
    _check_list(gather_list, tensor, p, "gather_list", "gather", rank == root)
    m = tensor.numel()
    buffer = torch.empty(p * m, dtype=tensor.dtype, device=tensor.device)
    buffer[rank * m : (rank + 1) * m].copy_(tensor.reshape(-1))

    def finish():
        if rank == root:
            for i, item in enumerate(gather_list):
                item.copy_(buffer[i * m : (i + 1) * m].view_as(item))

    return Prepared(buffer, finish, buffer.numel() * buffer.element_size())


def prepare_scatter(tensor, scatter_list, rank: int, p: int, root: int) -> Prepared:
    _check_tensor(tensor, "tensor", "scatter")
    _check_list(scatter_list, tensor, p, "scatter_list", "scatter", rank == root)
    m = tensor.numel()
    buffer = torch.empty(p * m, dtype=tensor.dtype, device=tensor.device)
    if rank == root:
        for i, item in enumerate(scatter_list):
            buffer[i * m : (i + 1) * m].copy_(item.reshape(-1))

    def finish():
        tensor.copy_(buffer[rank * m : (rank + 1) * m].view_as(tensor))

    return Prepared(buffer, finish, buffer.numel() * buffer.element_size())


def prepare_all_to_all(output, input, rank: int, p: int) -> Prepared:
    _check_pair(output, input, p, "all_to_all", 1, 1)
    if input.numel() % p:
        raise ValueError(
            f"all_to_all_single: input of {input.numel()} elements does not split into world_size = {p} "
            "equal chunks; pad it, or pass split sizes with algorithm='torch'"
        )
    m = input.numel() // p
    # buffer = [input | output]: rank s's input chunk d lands in rank d's output chunk s
    buffer = torch.empty(2 * p * m, dtype=input.dtype, device=input.device)
    buffer[: p * m].copy_(input.reshape(-1))
    buffer[p * m + rank * m : p * m + (rank + 1) * m].copy_(input.reshape(-1)[rank * m : (rank + 1) * m])

    def finish():
        output.copy_(buffer[p * m :].view_as(output))

    return Prepared(buffer, finish, p * m * buffer.element_size())


def prepare_barrier(device) -> Prepared:
    buffer = torch.zeros(1, dtype=torch.int32, device=device)
    return Prepared(buffer, lambda: None, 0)
