"""The virtual executor: runs a schedule over a list of p buffers in one process.

It is how every algorithm is tested in milliseconds without processes; the torch
executor lands receives with the same function (``ops.apply_receives``), so a real
run gives bit-identical results.
"""

from __future__ import annotations

import torch

from plait.comm import layout
from plait.comm.algorithms import build_schedule
from plait.comm.algorithms.hierarchical import parse_hierarchy
from plait.comm.ops import COMBINE, apply_receives
from plait.comm.schedule import Schedule


def run_schedule(schedule: Schedule, buffers: list[torch.Tensor], op: str = "sum") -> list[torch.Tensor]:
    """Run ``schedule`` in place over ``buffers`` (one flat tensor per rank)."""
    if len(buffers) != schedule.world_size:
        raise ValueError(f"schedule is for {schedule.world_size} ranks, got {len(buffers)} buffers")
    for rank, buffer in enumerate(buffers):
        if buffer.dim() != 1 or buffer.numel() != schedule.buffer_numel:
            raise ValueError(
                f"rank {rank}: buffer of shape {tuple(buffer.shape)}, schedule wants 1-D of {schedule.buffer_numel}"
            )
    combine = COMBINE[op]
    for step in schedule.steps:
        # every send reads the buffers as they were at the start of the step
        payloads = [buffers[t.src][t.src_offset : t.src_offset + t.numel].clone() for t in step.transfers]
        incoming: dict[int, list] = {}
        for transfer, payload in zip(step.transfers, payloads):
            incoming.setdefault(transfer.dst, []).append((transfer, payload))
        for rank, received in incoming.items():
            apply_receives(buffers[rank], rank, received, combine)
    return buffers


def simulate(
    collective: str,
    algorithm: str,
    inputs: list,
    op: str = "sum",
    root: int = 0,
    *,
    segments: int = 1,
    hierarchy=None,
) -> list:
    """Run ``collective`` with ``algorithm`` over one input tensor per rank, in one
    process, through the same buffer layouts the real collectives use.

    Returns one output per rank: all_reduce, broadcast, reduce -> the rank's tensor
    after the call; reduce_scatter, scatter -> its chunk; all_gather -> the gathered
    tensor; gather -> the gathered tensor on the root, None elsewhere; all_to_all ->
    the output tensor; barrier -> None (``inputs`` may then be ``[None] * p``).
    """
    p = len(inputs)
    prepared, outputs = [], []
    for rank, x in enumerate(inputs):
        if collective == "all_reduce":
            out = x.clone()
            prepared.append(layout.prepare_all_reduce(out, rank, p, op))
        elif collective == "reduce_scatter":
            out = x.new_empty(x.numel() // p)
            prepared.append(layout.prepare_reduce_scatter(out, x, rank, p, op))
        elif collective == "all_gather":
            out = x.new_empty(x.numel() * p)
            prepared.append(layout.prepare_all_gather(out, x, rank, p))
        elif collective == "broadcast":
            out = x.clone()
            prepared.append(layout.prepare_broadcast(out, rank, p, root))
        elif collective == "reduce":
            out = x.clone()
            prepared.append(layout.prepare_reduce(out, rank, p, root, op))
        elif collective == "gather":
            out = [x.new_empty(x.numel()) for _ in range(p)] if rank == root else None
            prepared.append(layout.prepare_gather(x, out, rank, p, root))
        elif collective == "scatter":
            out = x.new_empty(x.numel() // p)
            pieces = list(x.chunk(p)) if rank == root else None
            prepared.append(layout.prepare_scatter(out, pieces, rank, p, root))
        elif collective == "all_to_all":
            out = x.new_empty(x.numel())
            prepared.append(layout.prepare_all_to_all(out, x, rank, p))
        elif collective == "barrier":
            out = None
            prepared.append(layout.prepare_barrier("cpu"))
        else:
            raise ValueError(f"unknown collective {collective!r}")
        outputs.append(out)
    tree = parse_hierarchy(hierarchy, p, 1) if algorithm == "hierarchical" else None
    rooted = collective in ("broadcast", "reduce", "gather", "scatter")
    schedule = build_schedule(collective, algorithm, p, prepared[0].numel, root if rooted else None, segments, tree)
    buffers = [item.build() for item in prepared]
    run_schedule(schedule, buffers, "sum" if op == "avg" else op)
    for item, buffer in zip(prepared, buffers):
        item.finish(buffer)
    if collective == "gather":
        return [torch.cat(out) if out is not None else None for out in outputs]
    return outputs
