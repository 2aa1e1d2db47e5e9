"""Rank functions for the gloo tests (top-level so the harness can pickle them).

Each rank rebuilds every rank's input from seeds, runs plait's collective on its own
input and checks three oracles: the float64 reference within the unit-roundoff bound,
the virtual executor (bit for bit: same schedule, same reduction order) and
torch.distributed's own collective (within the bound, twice: both may round).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import plait.comm as comm
from plait.comm.algorithms import REDUCING, ROOTED
from plait.comm.reference import count_wrong, rank_inputs, reference
from plait.comm.virtual import simulate

CHUNKED = ("reduce_scatter", "scatter", "all_to_all")
DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
}


def call(collective, algorithm, x, rank, p, op, root, group=None):
    """Run one plait (or torch, algorithm="torch") collective on this rank's input
    (on ``group``, a Communicator, or the world)."""
    if collective == "all_reduce":
        out = x.clone()
        extra = {"hierarchy": _hierarchy(p)} if algorithm == "hierarchical" else {}
        comm.all_reduce(out, op, algorithm=algorithm, group=group, **extra)
    elif collective == "reduce_scatter":
        out = x.new_empty(x.numel() // p)
        comm.reduce_scatter_single(out, x, op, algorithm=algorithm, group=group)
    elif collective == "all_gather":
        out = x.new_empty(x.numel() * p)
        comm.all_gather_single(out, x, algorithm=algorithm, group=group)
    elif collective == "broadcast":
        out = x.clone()
        comm.broadcast(out, root, algorithm=algorithm, group=group)
    elif collective == "reduce":
        out = x.clone()
        comm.reduce(out, root, op, algorithm=algorithm, group=group)
    elif collective == "gather":
        pieces = [x.new_empty(x.numel()) for _ in range(p)] if rank == root else None
        comm.gather(x, pieces, root, algorithm=algorithm, group=group)
        out = torch.cat(pieces) if pieces is not None else None
    elif collective == "scatter":
        out = x.new_empty(x.numel() // p)
        comm.scatter(out, list(x.chunk(p)) if rank == root else None, root, algorithm=algorithm, group=group)
    elif collective == "all_to_all":
        out = x.new_empty(x.numel())
        comm.all_to_all_single(out, x, algorithm=algorithm, group=group)
    else:
        comm.barrier(algorithm=algorithm, group=group)
        out = None
    return out


def _host(out):
    return None if out is None else out.cpu()


def check_collective(rank, p, collective, dtype_name, sizes, ops=None, device="cpu", config=None):
    """All algorithms (and torch) of one collective for one dtype; returns failures.
    ``device="cuda"``: every rank's tensors live on the GPU (ranks may share one), as
    plait.comm moves them over gloo through host memory; torch's own collective is then
    only compared where gloo runs it on CUDA tensors. ``config``: run on a group of
    its own with ``CommConfig(**config)`` (e.g. another transport), destroyed at the end."""
    if config is None:
        return _check_collective(rank, p, collective, dtype_name, sizes, ops, device, None)
    group = comm.init_communicator(dist.new_group(list(range(p))), comm.CommConfig(**config))
    try:
        return _check_collective(rank, p, collective, dtype_name, sizes, ops, device, group)
    finally:
        comm.destroy_process_group(group)


def _check_collective(rank, p, collective, dtype_name, sizes, ops, device, group):
    dtype = DTYPES[dtype_name]
    failures = []
    if ops is None:
        ops = ["sum", "avg", "min", "max", "prod"] if collective in REDUCING else ["sum"]
    ops = [op for op in ops if op != "avg" or dtype.is_floating_point]
    roots = sorted({0, p - 1}) if collective in ROOTED else [0]
    for size in sizes:
        numel = size * p if collective in CHUNKED else size
        for op in ops:
            for root in roots:
                inputs = rank_inputs(collective, p, numel, dtype, op, seed=11)
                expected, bounds = reference(collective, inputs, op, root)
                try:
                    torch_out = _host(call(collective, "torch", inputs[rank].clone().to(device), rank, p, op, root, group))
                except RuntimeError as error:  # gloo lacks some dtype/op pairs
                    torch_out, torch_error = None, str(error).splitlines()[0]
                else:
                    torch_error = None
                for algorithm in comm.algorithms_for(collective):
                    where = (collective, algorithm, dtype_name, size, op, root, rank)
                    out = _host(call(collective, algorithm, inputs[rank].clone().to(device), rank, p, op, root, group))
                    if collective == "barrier":
                        continue
                    wrong = count_wrong(out, expected[rank], bounds[rank])
                    if wrong:
                        failures.append((*where, f"{wrong} wrong vs reference"))
                    virtual = simulate(collective, algorithm, [x.clone() for x in inputs], op, root,
                                       segments=_segments(numel, dtype, group), hierarchy=_hierarchy(p))[rank]
                    if (out is None) != (virtual is None) or (out is not None and not torch.equal(out, virtual)):
                        failures.append((*where, "differs from the virtual executor"))
                    if torch_out is not None and out is not None:
                        twice = None if bounds[rank] is None else 2 * bounds[rank]
                        if count_wrong(out, torch_out.to(expected[rank].dtype).reshape(-1), twice):
                            failures.append((*where, "differs from torch.distributed"))
                if torch_error and dtype in (torch.float32, torch.float64, torch.int64) and device == "cpu":
                    failures.append((collective, "torch", dtype_name, size, op, root, rank, torch_error))
    return failures


def _segments(numel, dtype, group=None):
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return max(1, min(64, nbytes // comm.communicator_for(group).config.pipeline_segment_bytes))


def _hierarchy(p):
    return "1+" + str(p - 1) if p > 2 else None
