"""plait.comm: collective communication built on point-to-point send/recv.

Schedules are data (``plait.comm.schedule``), built by the algorithms in
``plait.comm.algorithms``, run by the virtual executor (``plait.comm.virtual``) in
tests and by the torch executor on real ranks. The collectives below mirror
torch.distributed's signatures and add ``algorithm=``.
"""

from plait.comm.algorithms import ALGORITHMS, COLLECTIVES, algorithms_for, build_schedule, describe
from plait.comm.collectives import (
    ReduceOp,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    default_algorithm,
    default_device,
    gather,
    reduce,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
    synchronize,
)
from plait.comm.ddp_hook import DDPHookState, ddp_comm_hook
from plait.comm.engine import CONFIG, Handle, configure, enqueue, reset_stats, stats, unchecked
from plait.comm.errors import CommError, CommTimeoutError, MismatchError
from plait.comm.list_collectives import all_gather, all_to_all, reduce_scatter
from plait.comm.p2p import Message, irecv, isend, recv, send
from plait.comm.schedule import Schedule, Step, Transfer

__all__ = [
    "ALGORITHMS", "COLLECTIVES", "CONFIG", "CommError", "CommTimeoutError", "DDPHookState", "Handle",
    "MismatchError", "ddp_comm_hook",
    "ReduceOp", "Schedule", "Step", "Transfer", "algorithms_for", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_reduce", "all_to_all", "all_to_all_single", "barrier", "broadcast", "build_schedule",
    "configure", "default_algorithm", "default_device", "describe", "enqueue", "gather", "irecv", "isend", "Message", "recv", "reduce", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor", "reset_stats", "scatter", "send", "stats", "synchronize", "unchecked",
]
