"""The parameter server's wire protocol, shared by both sides (``plait.parallel.ps.worker``
sends pushes and reads replies, ``plait.parallel.ps.server`` the reverse): the tags its
messages travel on, the message kinds a header names, the reasons an ABORT gives, and
the deadline rule behind the server's receives. Torch-free: plain numbers and names.

Protocol (point-to-point with deadlines, ``plait.comm.isend/irecv``; tags sit above
the collectives' range): every message starts with an int64 header
``[kind, step, a, b, mask(p)]``. Worker -> server: PUSH (a = shard numel, b = payload
bytes) followed by the payload's tensors (one message each, in name order), CLOSE
(done), ABORT (the worker raised). Server -> worker: REPLY (a = server version,
b = steps ahead of the slowest) followed by the shard's flat parameters, or ABORT
(a = reason, b = timeout in ms, mask = the culprit worker ranks). A server that loses
a worker (dead connection, no push within the group's ``CommConfig.timeout_s``, or an ABORT)
tells every other open worker who it was and raises; workers wait for replies up to
twice the deadline, so that message, naming the culprit, arrives before they time
out on their own. The server enforces its deadline itself (the gloo wait runs on a
helper thread with a later deadline): a gloo timeout closes all of a rank's
connections, and the others could no longer be told. ``timeout_s`` must therefore
exceed one step's compute time; after a failure the group is not reusable.

A PUSH's payload tensors go on ``DATA_TAG + index``.
"""

from __future__ import annotations

from plait.comm import tags

__all__ = ["ABORT", "BROKE_PROTOCOL", "CLOSE", "DATA_TAG", "DISCONNECTED", "GLOO_FALLBACK_FACTOR", "KIND_NAMES",
           "PUSH", "PUSH_TAG", "RAISED", "REASONS", "REPLY", "REPLY_TAG", "TIMED_OUT"]

# ----- tags: above the torch executor's (< 2**30), so parameter-server traffic never
# matches a collective's message; plait.comm.tags assigns the range
PUSH_TAG = tags.PARAMETER_SERVER.start  # worker -> server headers: PUSH, CLOSE, ABORT
REPLY_TAG = tags.PARAMETER_SERVER.start + 1  # server -> worker headers: REPLY, ABORT
DATA_TAG = tags.PARAMETER_SERVER.start + 0x100  # + index of the payload tensor

# ----- message kinds (a header's first field)
PUSH, CLOSE, REPLY, ABORT = 1, 2, 3, 4
KIND_NAMES = {PUSH: "push", CLOSE: "close", REPLY: "reply", ABORT: "abort"}

# ----- why a server aborts (an ABORT header's ``a`` field), as its message says it
TIMED_OUT, DISCONNECTED, RAISED, BROKE_PROTOCOL = 1, 2, 3, 4
REASONS = {
    TIMED_OUT: "sent nothing within {timeout_s:g}s (it died or hung)",
    DISCONNECTED: "lost its connection (it died)",
    RAISED: "aborted (it raised an exception; see its traceback)",
    BROKE_PROTOCOL: "broke the protocol (ranks built different models or configs)",
}

# ----- deadlines: the server's receives from workers carry gloo deadlines this many
# times comm's, as a fallback behind the server's own (see ParameterServer._wait)
GLOO_FALLBACK_FACTOR = 3
