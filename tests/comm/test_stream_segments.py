"""The segment size of a call's streamed messages: a quarter of a shared-memory ring
at most where shared memory may carry them (a frame larger than its ring streams
half-duplex), the configured size elsewhere; the same on every rank of a group."""

import plait.comm as comm
from plait.comm.transport import RING_FRAMES, stream_segment_bytes


def test_segments_are_a_quarter_ring_at_most_on_shared_memory_and_as_configured_elsewhere():
    default = comm.CommConfig()
    assert default.segment_bytes == 4 << 20 and default.shm_ring_bytes == 4 << 20
    assert stream_segment_bytes(default, "gloo") == (4 << 20) // RING_FRAMES == 1 << 20
    assert stream_segment_bytes(comm.CommConfig(shm_ring_bytes=64 << 20), "gloo") == 4 << 20  # the setting is lower
    assert stream_segment_bytes(comm.CommConfig(shm_ring_bytes=4096), "gloo") == 1024
    assert stream_segment_bytes(comm.CommConfig(shm_ring_bytes=4096, segment_bytes=100), "gloo") == 100
    assert stream_segment_bytes(comm.CommConfig(segment_bytes=0), "gloo") == 0  # never split stays never split
    assert stream_segment_bytes(comm.CommConfig(transport="gloo"), "gloo") == 4 << 20  # no shared memory
    assert stream_segment_bytes(default, "nccl") == 4 << 20  # NCCL's grouped steps: no rings
