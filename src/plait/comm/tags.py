"""Every message tag plait uses on a process group, assigned in one place.

A group can carry several protocols at once (a pipeline's activations beside the
loss all-reduce on the same group; a parameter server's pushes), and gloo matches a
receive to a send by (peer, tag) alone, so each protocol owns a range no other
touches. Tags are non-negative int32 (gloo refuses others). Importing this module
checks that no two ranges overlap.

    COLLECTIVE          schedule messages: (step mod 2^13) << 16 | message index
    COLLECTIVE_PACKED   the same, carrying an in-band header (plait.comm.inband)
    PIPELINE            pipeline activations and gradients: 3·(step slot·2mS + message)
                        + 0 header, 1 payload in the agreed shape, 2 payload in a new
                        shape (plait.parallel.pipeline.messages)
    CHIMERA_REPLICA     Chimera's exchange of a replicated stage's gradients
    EVALUATION          forward-only evaluation's activations: 2·stage (+1 payload)
    PARAMETER_SERVER    push, reply and data (+ tensor index) messages
    COMM_CONTROL        a call's first header, communicator creation and the set-up of
                        its shared-memory transport
"""

from __future__ import annotations

COLLECTIVE = range(0, 1 << 29)
COLLECTIVE_PACKED = range(1 << 29, 1 << 30)
PIPELINE = range(1 << 30, (1 << 30) + (1 << 29))
CHIMERA_REPLICA = range(0x6000_0000, 0x6000_0001)
EVALUATION = range(0x6000_0010, 0x6000_0010 + (1 << 16))
PARAMETER_SERVER = range(0x7000_0000, 0x7000_1000)
COMM_CONTROL = range(0x7FFF_0000, 0x7FFF_0005)

COLLECTIVE_HEADER = COMM_CONTROL.start
CREATE = COMM_CONTROL.start + 1
CREATE_REPLY = COMM_CONTROL.start + 2
SHM_SETUP = COMM_CONTROL.start + 3
SHM_SETUP_REPLY = COMM_CONTROL.start + 4

RANGES = {"collective": COLLECTIVE, "collective packed": COLLECTIVE_PACKED, "pipeline": PIPELINE,
          "chimera replica": CHIMERA_REPLICA, "evaluation": EVALUATION, "parameter server": PARAMETER_SERVER,
          "comm control": COMM_CONTROL}


def overlaps() -> list[tuple[str, str]]:
    """Pairs of ranges that share a tag (empty: the assignment is sound)."""
    items = sorted(RANGES.items(), key=lambda item: item[1].start)
    return [(a, b) for (a, ra), (b, rb) in zip(items, items[1:]) if ra.stop > rb.start]


def check() -> None:
    problems = overlaps()
    assert not problems, f"plait.comm.tags: overlapping tag ranges {problems}"
    assert all(0 <= r.start and r.stop <= 2**31 for r in RANGES.values()), "tags must be non-negative int32"


check()

__all__ = ["CHIMERA_REPLICA", "COLLECTIVE", "COLLECTIVE_HEADER", "COLLECTIVE_PACKED", "COMM_CONTROL", "CREATE",
           "CREATE_REPLY", "EVALUATION", "PARAMETER_SERVER", "PIPELINE", "RANGES", "SHM_SETUP", "SHM_SETUP_REPLY", "check", "overlaps"]
