"""torch.distributed's list forms: ``all_gather``, ``reduce_scatter``, ``all_to_all``.

Each takes a list of p tensors where torch does and flattens it into one buffer, so
plait's single-tensor collective runs on it with ``algorithm=``: equal entries of m
elements give a buffer of p·m and the cost of that collective (e.g. ring all-gather
(p-1) a + (p-1)/p · p m b) plus one local copy. Uneven entries (as NCCL allows them):
all_gather and reduce_scatter pad every entry to the largest, M, and run on p·M (the
padding travels; pad values are discarded); all_to_all passes the entries' sizes as
split sizes to ``all_to_all_single``, which runs torch.distributed's own
all_to_all_single for them (gloo's list all_to_all refuses uneven entries; its
single-tensor one does not).

With ``async_op=True`` the whole call (flatten, collective, copy back) is queued on the
comm thread (``Communicator.enqueue``); the Handle's future holds the output list
(``tensor_list`` / ``[output]`` / ``output_tensor_list``), as torch's Work does.
"""

from __future__ import annotations

import torch

from plait.comm.algorithms import DEFAULT_NAMES, TORCH
from plait.comm.collectives import ReduceOp, all_gather_single, all_to_all_single, reduce_scatter_single
from plait.comm.communicator import communicator_for


def _check_list(tensors, p: int, name: str, collective: str) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{collective}: {name} must be a list of {p} tensors, got {type(tensors).__name__}")
    if len(tensors) != p:
        raise ValueError(f"{collective}: {name} must hold world_size = {p} tensors, got {len(tensors)}")
    for i, item in enumerate(tensors):
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"{collective}: {name}[{i}] must be a torch.Tensor, got {type(item).__name__}")
    return [item.detach() for item in tensors]


def _check_dtypes(tensors, dtype, names, collective: str) -> None:
    bad = [f"{name} is {t.dtype}" for name, t in zip(names, tensors) if t.dtype != dtype]
    if bad:
        raise TypeError(f"{collective}: every tensor must be {dtype}, but {', '.join(bad)}; use one dtype")


def _run(communicator, job, description: str, async_op: bool, output: list):
    """Run ``job`` now (its plait collectives keep program order with queued ones), or
    queue all of it on the group's comm thread and return its Handle."""
    if async_op:
        handle = communicator.enqueue(job, description)
        handle.output = output
        return handle
    job()
    return None


def _copy_out(flat: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    for target in targets:
        n = target.numel()
        target.copy_(flat[offset : offset + n].view(target.shape))
        offset += n


def all_gather(tensor_list, tensor, group=None, async_op=False, *, algorithm=None):
    """Gather every rank's ``tensor`` into ``tensor_list`` (entry r from rank r).

    Equal entries: plait's all-gather of p·m elements into one buffer, then a copy
    into the list. Uneven entries (entry r is rank r's size): each rank pads to the
    largest, M, and the all-gather moves p·M."""
    communicator = communicator_for(group)
    if communicator is None:
        return None
    rank, p = communicator.rank, communicator.size
    targets = _check_list(tensor_list, p, "tensor_list", "all_gather")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_gather: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    source = tensor.detach()
    _check_dtypes(targets, source.dtype, [f"tensor_list[{i}]" for i in range(p)], "all_gather")
    sizes = [t.numel() for t in targets]
    if sizes[rank] != source.numel():
        raise ValueError(
            f"all_gather: tensor has {source.numel()} elements but tensor_list[{rank}] (this rank's entry) has "
            f"{sizes[rank]}; entry r must be the size of rank r's tensor"
        )
    widest = max(sizes)  # M: every rank sends M elements, padded

    def job():
        flat = torch.empty(p * widest, dtype=source.dtype, device=source.device)
        mine = source.reshape(-1)
        if mine.numel() < widest:
            mine = torch.cat([mine, mine.new_zeros(widest - mine.numel())])
        all_gather_single(flat, mine, group, algorithm=algorithm)
        for r, target in enumerate(targets):
            target.copy_(flat[r * widest : r * widest + sizes[r]].view(target.shape))

    return _run(communicator, job, f"all_gather(list, algorithm={algorithm})", async_op, list(tensor_list))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm=None):
    """Reduce ``input_list`` elementwise across ranks; rank r gets the reduction of
    every rank's ``input_list[r]`` in ``output``.

    Equal entries: the list is concatenated (p·m elements) and plait's reduce-scatter
    runs on it (ring: (p-1) a + (p-1)/p · p m b). Uneven entries are zero-padded to
    the largest, M, and the reduce-scatter runs on p·M."""
    communicator = communicator_for(group)
    if communicator is None:
        return None
    rank, p = communicator.rank, communicator.size
    sources = _check_list(input_list, p, "input_list", "reduce_scatter")
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"reduce_scatter: output must be a torch.Tensor, got {type(output).__name__}")
    target = output.detach()
    _check_dtypes(sources, target.dtype, [f"input_list[{i}]" for i in range(p)], "reduce_scatter")
    sizes = [t.numel() for t in sources]
    if sizes[rank] != target.numel():
        raise ValueError(
            f"reduce_scatter: output has {target.numel()} elements but input_list[{rank}] (this rank's share) has "
            f"{sizes[rank]}; they must match"
        )
    widest = max(sizes)

    def job():
        # the inputs are read when the collective runs, as torch's are; entries padded to M
        flat = torch.zeros(p * widest, dtype=target.dtype, device=target.device)
        for r, source in enumerate(sources):
            flat[r * widest : r * widest + sizes[r]].copy_(source.reshape(-1))
        # flat 1-D output: torch's reduce_scatter_tensor (algorithm="torch") wants
        # input.shape[0] == p * output.shape[0]
        mine = target.new_empty(widest)
        reduce_scatter_single(mine, flat, op, group, algorithm=algorithm)
        target.copy_(mine[: sizes[rank]].view(target.shape))

    return _run(communicator, job, f"reduce_scatter(list, algorithm={algorithm})", async_op, [output])


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, *, algorithm=None):
    """Rank s's ``input_tensor_list[d]`` lands in rank d's ``output_tensor_list[s]``.

    Equal entries: flattened into p·m elements for plait's all_to_all_single
    (direct: one round, (p-1) m elements sent per rank). Uneven entries: their sizes
    become split sizes of torch.distributed's all_to_all_single."""
    communicator = communicator_for(group)
    if communicator is None:
        return None
    p = communicator.size
    targets = _check_list(output_tensor_list, p, "output_tensor_list", "all_to_all")
    sources = _check_list(input_tensor_list, p, "input_tensor_list", "all_to_all")
    dtype = sources[0].dtype
    _check_dtypes(sources + targets, dtype,
                  [f"input_tensor_list[{i}]" for i in range(p)] + [f"output_tensor_list[{i}]" for i in range(p)],
                  "all_to_all")
    in_sizes = [t.numel() for t in sources]
    out_sizes = [t.numel() for t in targets]
    even = len(set(in_sizes + out_sizes)) == 1
    if not even and algorithm not in DEFAULT_NAMES and algorithm != TORCH:
        raise ValueError(
            f"all_to_all: algorithm={algorithm!r} takes equal-sized entries (input sizes {in_sizes}, output sizes "
            f"{out_sizes}); make every entry the same size, or leave algorithm unset (or 'torch') to use "
            "torch.distributed's all_to_all_single with split sizes"
        )

    def job():
        flat_in = torch.cat([t.reshape(-1) for t in sources])
        flat_out = flat_in.new_empty(sum(out_sizes))
        if even:
            all_to_all_single(flat_out, flat_in, group=group, algorithm=algorithm)
        else:
            all_to_all_single(flat_out, flat_in, out_sizes, in_sizes, group=group, algorithm=algorithm)
        _copy_out(flat_out, targets)

    return _run(communicator, job, f"all_to_all(list, algorithm={algorithm})", async_op, list(output_tensor_list))
