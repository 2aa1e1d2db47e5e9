"""The shared-memory transport in one process: several ranks' transports over real
segments and doorbells in a temporary directory, driven by hand (a wait makes
progress for its own rank only, so the test moves every rank in turn)."""

import os
import time

import pytest
import torch

from plait.comm.shm_ring import FRAME_HEADER_BYTES, Segment, frame_bytes
from plait.comm.shm_setup import (ALONE, NO_DIRECTORY, OK, TOO_SMALL, _decide_hosts, _directory_state, attach_peers,
                                  connect, create_own, reclaim_stale)

NONCE = 0x1234_5678


def mesh(directory, n, ring_bytes=4096, spin_s=0.0):
    """n transports of one process, as establish() connects them; the files are
    unlinked once every rank is attached, as there."""
    created, own = [], {}
    for rank in range(n):
        own[rank] = create_own(str(directory), NONCE, rank, n - 1, ring_bytes, created)
    transports = []
    for rank in range(n):
        opened, bells = {}, {}
        attach_peers(str(directory), NONCE, [peer for peer in range(n) if peer != rank], opened, bells)
        transports.append(connect(rank, list(range(n)), own[rank][0], opened, own[rank][1], bells, spin_s))
    for path in created:
        os.unlink(path)
    return transports


def drive(transports, works, limit_s=10.0):
    """Make progress on every rank until every work is done."""
    deadline = time.monotonic() + limit_s
    while not all(work.done for work in works):
        assert time.monotonic() < deadline, "no progress"
        for transport in transports:
            transport.progress()


@pytest.fixture
def pair(tmp_path):
    transports = mesh(tmp_path, 2)
    yield transports
    for transport in transports:
        transport.close()


def test_the_directory_is_empty_once_connected(tmp_path):
    transports = mesh(tmp_path, 3)
    assert os.listdir(tmp_path) == []
    for transport in transports:
        transport.close()


def offset_the_ring(pair):
    """Send rank 1 a 100-byte message (a 192-byte frame) and read it, so that the next
    frame starts mid-buffer: without it every lap of the stream starts at the buffer's
    start (a lock-step sender fills the ring to exactly its end) and no copy ever passes
    the end. Returns the rings of 0 -> 1: rank 0's (the writer's) and rank 1's (the reader's)."""
    opening = torch.arange(100, dtype=torch.uint8)
    drive(pair, [pair[0].send(opening, 1, 6), pair[1].recv(torch.zeros_like(opening), 0, 6)])
    writer, reader = pair[0].outbound[1], pair[1].inbound[0]
    assert writer.tail() % writer.capacity == 192 and writer.wraps == reader.wraps == 0
    return writer, reader


def assert_wrapped_within(ring, start, end):
    """The ring's own account: a copy began inside stream bytes [start, end), mid-buffer,
    and went on at the buffer's start."""
    assert ring.wraps >= 1, f"no copy passed the end of the {ring.capacity}-byte ring"
    assert start <= ring.last_wrap_at < end and ring.last_wrap_at % ring.capacity != 0


@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 1000, 4096, 10_000, 50_001])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bfloat16, torch.bool])
def test_messages_arrive_bit_for_bit_through_a_small_ring(pair, numel, dtype):
    # a 4 KiB ring: a message longer than the rest of the buffer passes its end mid-copy
    # (writing and reading), and one longer than the ring streams through it
    writer, reader = offset_the_ring(pair)
    generator = torch.Generator().manual_seed(numel)
    source = (torch.randn(numel, generator=generator) * 100).to(dtype)
    target = torch.zeros(numel, dtype=dtype)
    start = writer.tail()
    works = [pair[0].send(source, 1, 7), pair[1].recv(target, 0, 7)]
    drive(pair, works)
    assert torch.equal(source, target)
    payload_bytes = numel * source.element_size()
    if start % writer.capacity + FRAME_HEADER_BYTES + payload_bytes > writer.capacity:
        assert_wrapped_within(writer, start, writer.tail())
        assert_wrapped_within(reader, start, reader.head())
    else:
        assert writer.wraps == reader.wraps == 0


def test_messages_of_one_tag_arrive_in_order_and_the_ring_wraps(pair):
    writer, reader = offset_the_ring(pair)
    start = writer.tail()
    sent = [torch.full((100 + k,), float(k)) for k in range(40)]  # ~24 KiB of frames through a 4 KiB ring
    received = [torch.zeros(100 + k) for k in range(40)]
    works = [pair[0].send(tensor, 1, 3) for tensor in sent] + [pair[1].recv(tensor, 0, 3) for tensor in received]
    drive(pair, works)
    assert all(torch.equal(a, b) for a, b in zip(sent, received))
    assert writer.tail() - start > 5 * writer.capacity  # the stream went round the ring 5 times and more
    assert_wrapped_within(writer, start, writer.tail())
    assert_wrapped_within(reader, start, reader.head())


def test_a_later_tag_overtakes_a_message_whose_receive_is_not_posted(pair):
    first, second = torch.arange(3000.0), torch.arange(5.0) + 0.5
    sends = [pair[0].send(first, 1, 1), pair[0].send(second, 1, 2)]
    later = torch.zeros(5)
    waiting = pair[1].recv(later, 0, 2)  # tag 2 first: tag 1 is held aside to let it through
    drive(pair, [waiting, *sends])
    assert torch.equal(later, second)
    assert len(pair[1]._unexpected[0]) == 1
    earlier = torch.zeros(3000)
    drive(pair, [pair[1].recv(earlier, 0, 1)])
    assert torch.equal(earlier, first)
    assert not pair[1]._unexpected[0]


def test_a_message_without_a_posted_receive_waits_in_the_ring(pair):
    message = torch.arange(10.0)
    send = pair[0].send(message, 1, 9)
    for _ in range(3):
        pair[1].progress()
    assert not pair[1]._unexpected[0]  # nobody asked for anything from rank 0: not copied out
    assert send.done  # it fitted in the ring: the sender's tensor is free again
    target = torch.zeros(10)
    drive(pair, [pair[1].recv(target, 0, 9)])
    assert torch.equal(target, message)


def test_a_receive_from_any_rank_names_the_sender(tmp_path):
    transports = mesh(tmp_path, 3)
    target = torch.zeros(4)
    receive = transports[0].recv(target, None, 11)
    drive(transports, [transports[2].send(torch.ones(4) * 2, 0, 11), receive])
    assert receive._source_rank() == 2 and torch.equal(target, torch.full((4,), 2.0))
    for transport in transports:
        transport.close()


def test_a_smaller_message_fills_the_front_and_a_larger_one_fails_naming_both_sizes(pair):
    target = torch.full((8,), -1.0)
    drive(pair, [pair[0].send(torch.ones(3), 1, 1), pair[1].recv(target, 0, 1)])
    assert target.tolist() == [1.0] * 3 + [-1.0] * 5
    small = torch.zeros(2)
    too_big = pair[1].recv(small, 0, 2)
    after = torch.zeros(2)
    next_one = pair[1].recv(after, 0, 3)
    drive(pair, [pair[0].send(torch.ones(1000), 1, 2), pair[0].send(torch.full((2,), 5.0), 1, 3), too_big, next_one])
    with pytest.raises(RuntimeError, match="4000 bytes .* receive of 8 bytes"):
        too_big.wait()
    assert after.tolist() == [5.0, 5.0]  # the stream stayed framed past the refused message


def test_a_wait_times_out_naming_the_message(pair):
    receive = pair[1].recv(torch.zeros(1), 0, 4)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 0.2s waiting for a receive of up to 4 bytes from rank 0"):
        receive.wait(timeout=__import__("datetime").timedelta(seconds=0.2))
    assert time.monotonic() - start < 2.0


def test_a_closed_peer_fails_the_wait_naming_it(pair):
    receive = pair[1].recv(torch.zeros(1), 0, 4)
    pair[0].close()
    with pytest.raises(RuntimeError, match="rank 0 closed its shared-memory transport"):
        receive.wait(timeout=__import__("datetime").timedelta(seconds=10))


def test_a_message_sent_just_before_its_sender_closed_is_still_received(pair):
    """The liveness check (the wait calls it after a look at the rings finds nothing)
    first takes in what the peer wrote before closing: no message is lost to the race
    of a peer that sends its last message and exits in between."""
    target = torch.zeros(5, dtype=torch.int64)
    receive = pair[1].recv(target, 0, 7)
    assert pair[0].send(torch.arange(5), 1, 7).done  # a small message is in the ring at once
    pair[0].close()
    pair[1]._check_peers()  # the check, as the wait makes it, before its next look at the rings
    receive.wait(timeout=__import__("datetime").timedelta(seconds=10))
    assert torch.equal(target, torch.arange(5))


def _rung(transport) -> bool:
    """Whether a peer rang ``transport``'s doorbell since it was last read (drains it)."""
    try:
        return len(os.read(transport.bell, 4096)) > 0
    except BlockingIOError:
        return False


def test_a_reader_rings_a_sleeping_sender_only_while_it_wants_room(pair):
    """Consuming bytes wakes the sender only if it waits for room in the ring: a
    sender asleep for another reason (its own receive) is not woken for nothing."""
    sender, owner = pair
    _rung(sender)
    assert sender.send(torch.arange(8), 1, 1).done  # fits: nothing waits for room
    sender.inbox.set_sleeping(True)  # as if blocked on its doorbell, waiting for something else
    receive = owner.recv(torch.zeros(8, dtype=torch.int64), 0, 1)
    assert receive.done and not _rung(sender)
    big = torch.arange(3000)  # 24000 bytes through a 4096-byte ring
    send = sender.send(big, 1, 2)
    assert not send.done and sender.outbound[1].room_wanted()
    target = torch.zeros(3000, dtype=torch.int64)
    receive = owner.recv(target, 0, 2)  # takes in what fits, freeing room
    assert _rung(sender)
    sender.inbox.set_sleeping(False)
    drive(pair, [send, receive])
    assert torch.equal(target, big) and not sender.outbound[1].room_wanted()


def test_a_frame_is_its_header_and_its_padded_payload():
    assert frame_bytes(0) == 64 and frame_bytes(1) == 128 and frame_bytes(64) == 128 and frame_bytes(65) == 192


def test_a_stale_segment_is_reclaimed_and_never_attached(tmp_path):
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)  # a pid that is surely gone now
    stale = tmp_path / f"plait-shm-00000000000000aa-0-p{dead}"
    Segment.create(str(stale), 0xAA, 1, 4096).close()
    live = tmp_path / f"plait-shm-00000000000000bb-0-p{os.getpid()}"
    live.write_bytes(b"")
    with pytest.raises(ValueError, match="stale or foreign"):
        Segment.attach(str(stale), NONCE)  # another group's nonce: never read as this group's
    assert reclaim_stale(str(tmp_path)) == [str(stale)]
    assert sorted(os.listdir(tmp_path)) == [live.name]


def test_rank_zero_groups_ranks_by_host_and_refuses_a_small_directory():
    rows = [[7, OK, 10**9], [7, OK, 10**9], [9, OK, 10**9], [7, OK, 10**9]]
    answer = _decide_hosts(rows, 4096)
    hosts, reasons = answer[2:6], answer[6:]
    assert hosts[0] == hosts[1] == hosts[3] >= 0 and hosts[2] == -1
    assert reasons == [OK, OK, ALONE, OK]
    need = answer[1]
    assert need == 3 * (4096 + 2 * (4096 + 4096))  # three segments of two rings each
    pair_need = 2 * (4096 + 4096 + 4096)  # two segments of one ring each
    enough = _decide_hosts([[7, OK, pair_need], [7, OK, 10**9]], 4096)
    assert enough[2:4] == [0, 0] and enough[1] == pair_need
    small = _decide_hosts([[7, OK, pair_need - 1], [7, OK, 10**9]], 4096)  # the smallest free space decides
    assert small[2:4] == [-1, -1] and small[4:] == [TOO_SMALL, TOO_SMALL]


def test_a_missing_directory_is_reported(tmp_path):
    assert _directory_state(str(tmp_path / "absent"))[0] == NO_DIRECTORY
    assert _directory_state(str(tmp_path))[0] == OK


def test_a_doorbell_past_file_descriptor_1024_still_blocks(tmp_path):
    # long-lived processes (test workers, a trainer with many groups) hold many fds:
    # select() refuses any at 1024 or above, so the doorbell must not rely on it
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        transports = mesh(tmp_path, 2)
        assert transports[1].bell >= 1024
        receive = transports[1].recv(torch.zeros(1), 0, 4)
        with pytest.raises(RuntimeError, match="timed out"):  # it napped on the doorbell, then gave up
            receive.wait(timeout=__import__("datetime").timedelta(seconds=0.05))
        assert transports[1].naps >= 1
        sent = torch.ones(1)
        late = transports[1].recv(torch.zeros(1), 0, 5)
        drive(transports, [transports[0].send(sent, 1, 5), late])
        for transport in transports:
            transport.close()
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
