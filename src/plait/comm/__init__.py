"""plait.comm: collective communication built on point-to-point send/recv.

Schedules are data (``plait.comm.schedule``), built by the algorithms in
``plait.comm.algorithms``, run by the virtual executor (``plait.comm.virtual``) in
tests and by the torch executor on real ranks. Each process group has its own
:class:`Communicator` (configuration, comm thread, counters). The collectives below
mirror torch.distributed's signatures and add ``algorithm=``; their ``group=`` is a
process group (None: the world) or a Communicator.
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
    default_device,
    enqueue,
    gather,
    reduce,
    reduce_scatter_single,
    reduce_scatter_tensor,
    reset_stats,
    scatter,
    stats,
    synchronize,
)
from plait.comm.choice import auto_algorithm, default_algorithm
from plait.comm.communicator import (Communicator, all_communicators, communicator_for, destroy_process_group,
                                     init_communicator)
from plait.comm.config import CommConfig
from plait.comm.ddp_hook import DDPHookState, ddp_comm_hook
from plait.comm.engine import Handle
from plait.comm.errors import CommError, CommTimeoutError, MismatchError
from plait.comm.list_collectives import all_gather, all_to_all, reduce_scatter
from plait.comm.p2p import Message, P2POp, batch_isend_irecv, irecv, isend, link_for, recv, send
from plait.comm.schedule import Schedule, Step, Transfer

__all__ = [
    "ALGORITHMS", "COLLECTIVES", "CommConfig", "CommError", "CommTimeoutError", "Communicator", "DDPHookState",
    "Handle", "Message", "MismatchError", "P2POp", "ReduceOp", "Schedule", "Step", "Transfer", "algorithms_for",
    "all_communicators", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "all_to_all",
    "all_to_all_single", "auto_algorithm", "barrier", "batch_isend_irecv", "broadcast", "build_schedule",
    "communicator_for", "ddp_comm_hook", "default_algorithm", "default_device",
    "describe", "destroy_process_group", "enqueue", "gather", "init_communicator", "irecv", "isend", "link_for", "recv",
    "reduce", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "reset_stats", "scatter", "send", "stats", "synchronize",
]
