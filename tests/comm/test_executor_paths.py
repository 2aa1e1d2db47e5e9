"""The executor's two ways to run a schedule give the same bits: the lock-step grouped
path (one ``batch_isend_irecv`` per step, NCCL's), run here over gloo on CPU tensors,
and the streaming dataflow (gloo's), both against the virtual executor."""

import pytest
import torch
import torch.distributed as dist

import plait.comm as comm
from plait.comm.algorithms import build_schedule
from plait.comm.ops import COMBINE
from plait.comm.virtual import simulate
from plait.testing import run_distributed

NUMEL = 1001  # not divisible by the group sizes


def _inputs(p):
    return [torch.randn(NUMEL, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + r)) for r in range(p)]


def both_paths(rank, world_size, algorithm):
    group = dist.new_group(list(range(world_size)))
    communicator = comm.Communicator(group, comm.CommConfig(check="off", transport="gloo"))
    communicator.created.wait()
    schedule = build_schedule("all_reduce", algorithm, world_size, NUMEL)
    results = {}
    for grouped in (False, True):
        buffer = _inputs(world_size)[rank].clone()
        sent, messages = communicator.executor.run(schedule, rank, communicator.transport, buffer, COMBINE["sum"],
                                                   timeout_s=60, grouped=grouped, segment_numel=100)
        results[grouped] = (buffer, sent, messages)
    comm.destroy_process_group(group)
    communicator.close()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size,algorithm", [(2, "ring"), (3, "ring"), (3, "recursive_doubling")])
def test_grouped_and_streaming_paths_give_the_virtual_executors_bits(world_size, algorithm):
    expected = simulate("all_reduce", algorithm, _inputs(world_size))
    for rank, results in enumerate(run_distributed(both_paths, world_size, algorithm)):
        streaming, grouped = results[False], results[True]
        assert torch.equal(streaming[0], expected[rank])
        assert torch.equal(grouped[0], expected[rank])
        assert grouped[1] == streaming[1] > 0  # the same bytes sent
