"""The virtual executor: runs a schedule over a list of p buffers in one process.

It is how every algorithm is tested in milliseconds without processes; the torch
executor lands receives with the same function (``ops.apply_receives``), so a real
run gives bit-identical results.
"""

from __future__ import annotations

import torch

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
