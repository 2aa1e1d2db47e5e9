"""Reducing straight from a shared-memory ring (``ShmTransport.recv_reduce``): the
bits are those of combining a copied-out payload (``ops.COMBINE``'s operand order),
also when the message wraps around the ring's end and streams through a ring smaller
than itself; a held (unexpected) message, a larger message and one that is not whole
elements; and a real all-reduce over shared memory, bit for bit the virtual
executor's, whose received chunks were reduced from the rings."""

import pytest
import torch
import torch.distributed as dist

import plait.comm as comm
from plait.comm.algorithms import build_schedule
from plait.comm.ops import COMBINE
from plait.comm.virtual import simulate
from plait.testing import run_distributed
from tests.comm.test_shm import assert_wrapped_within, drive, mesh, offset_the_ring


@pytest.fixture
def pair(tmp_path):
    transports = mesh(tmp_path, 2)  # 4 KiB rings
    yield transports
    for transport in transports:
        transport.close()


def _operands(numel, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    local = (torch.randn(numel, generator=generator) * 100).to(dtype)
    incoming = (torch.randn(numel, generator=generator) * 100).to(dtype)
    return local, incoming


@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.bfloat16, "sum"), (torch.float64, "prod"),
                                      (torch.float32, "max"), (torch.int64, "bxor"), (torch.float16, "min")])
@pytest.mark.parametrize("payload_bytes", [4000, 20_000])  # one frame that wraps; one streaming through the ring
def test_a_reduce_from_the_ring_gives_the_bits_of_a_copied_out_payload(pair, dtype, op, payload_bytes):
    writer, reader = offset_the_ring(pair)  # the next frame starts 192 bytes into the 4 KiB ring: it wraps
    numel = payload_bytes // dtype.itemsize
    local, incoming = _operands(numel, dtype, numel)
    expected = local.clone()
    COMBINE[op](expected, incoming)
    start = writer.tail()
    target = local.clone()
    drive(pair, [pair[0].send(incoming, 1, 7), pair[1].recv_reduce(target, 0, 7, COMBINE[op])])
    assert torch.equal(target, expected)
    assert pair[1].payload_bytes_reduced == incoming.numel() * incoming.element_size()
    assert_wrapped_within(reader, start, reader.head())  # a piece passed the ring's end while being reduced


def test_a_held_message_is_reduced_when_its_reducing_receive_is_posted(pair):
    local, incoming = _operands(300, torch.float32, 3)
    sends = [pair[0].send(incoming, 1, 1), pair[0].send(torch.arange(4.0), 1, 2)]
    later = torch.zeros(4)
    drive(pair, [pair[1].recv(later, 0, 2), *sends])  # tag 1 is held aside to let tag 2 through
    target = local.clone()
    drive(pair, [pair[1].recv_reduce(target, 0, 1, COMBINE["sum"])])
    assert torch.equal(target, local + incoming) and not pair[1]._unexpected[0]


def test_a_larger_or_ragged_message_fails_the_reducing_receive_and_the_stream_stays_framed(pair):
    too_big = pair[1].recv_reduce(torch.zeros(2), 0, 1, COMBINE["sum"])
    ragged = pair[1].recv_reduce(torch.zeros(4), 0, 2, COMBINE["sum"])
    after = torch.zeros(2)
    next_one = pair[1].recv(after, 0, 3)
    sends = [pair[0].send(torch.ones(1000), 1, 1), pair[0].send(torch.ones(3, dtype=torch.uint8), 1, 2),
             pair[0].send(torch.full((2,), 5.0), 1, 3)]
    drive(pair, [*sends, too_big, ragged, next_one])
    with pytest.raises(RuntimeError, match="4000 bytes .* reducing receive of 8 bytes"):
        too_big.wait()
    with pytest.raises(RuntimeError, match=r"3 bytes .*not whole 4-byte elements"):
        ragged.wait()
    assert after.tolist() == [5.0, 5.0]


NUMEL = 30_011  # 120 KB of float32: past the in-band packed form, many laps of a 16 KiB ring


def _all_reduce_through_small_rings(rank, world_size, algorithm):
    group = dist.new_group(list(range(world_size)))
    communicator = comm.init_communicator(group, comm.CommConfig(transport="shm", shm_ring_bytes=16384,
                                                                 segment_bytes=4096))
    communicator.created.wait()
    inputs = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(7 + r)) for r in range(world_size)]
    buffer = inputs[rank].clone()
    shm = communicator.transport.shm
    before = shm.payload_bytes_reduced
    comm.all_reduce(buffer, algorithm=algorithm, group=group)
    reduced_bytes = shm.payload_bytes_reduced - before
    comm.destroy_process_group(group)
    return buffer, reduced_bytes


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_all_reduce_reduced_from_the_rings_is_bit_for_bit_the_virtual_executors(world_size):
    algorithm = "ring"
    inputs = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(7 + r)) for r in range(world_size)]
    expected = simulate("all_reduce", algorithm, inputs)
    schedule = build_schedule("all_reduce", algorithm, world_size, NUMEL)
    for rank, (buffer, reduced_bytes) in enumerate(run_distributed(_all_reduce_through_small_rings,
                                                                          world_size, algorithm)):
        assert torch.equal(buffer, expected[rank])
        # every received reduction but the first segment from each peer (it carries the in-band header and goes
        # through scratch) was reduced straight from a ring
        reduced_elements = sum(t.numel for sends, recvs in schedule.rank_steps(rank) for t in recvs if t.reduce)
        assert reduced_elements * 4 - (world_size - 1) * 4096 <= reduced_bytes <= reduced_elements * 4
        assert reduced_bytes > 0
