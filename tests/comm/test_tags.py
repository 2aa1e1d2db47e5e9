"""Every protocol's tags in one module, none overlapping; each user draws from its range."""

from plait.comm import tags
from plait.comm.inband import HEADER_TAG, PACKED_TAG_OFFSET
from plait.parallel.ps import protocol


def test_no_two_protocols_share_a_tag():
    assert tags.overlaps() == []
    widened = dict(tags.RANGES, pipeline=range(tags.PIPELINE.start, tags.CHIMERA_REPLICA.start + 1))
    original = tags.RANGES
    try:
        tags.RANGES = widened  # the check sees an overlap when there is one
        assert tags.overlaps() == [("pipeline", "chimera replica")]
    finally:
        tags.RANGES = original


def test_users_take_their_tags_from_the_ranges():
    assert HEADER_TAG in tags.COMM_CONTROL
    assert tags.COLLECTIVE.start + PACKED_TAG_OFFSET == tags.COLLECTIVE_PACKED.start
    assert (8191 << 16 | 65535) in tags.COLLECTIVE  # the executor's largest tag
    for tag in (protocol.PUSH_TAG, protocol.REPLY_TAG, protocol.DATA_TAG + 255):
        assert tag in tags.PARAMETER_SERVER
