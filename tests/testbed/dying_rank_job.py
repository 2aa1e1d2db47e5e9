"""A job for `plait testbed run` (tests/testbed/test_testbed.py) in which rank 3 dies:
after a barrier it exits without a word, and every other rank runs a plait ring
all-reduce (20 s deadline) and writes what the collective raised to
<argv[1]>/rank<r>.txt the moment it is raised."""

import os
import sys

import torch
import torch.distributed as dist

import plait.comm as comm

dist.init_process_group("gloo")
rank = dist.get_rank()
comm.init_communicator(None, comm.CommConfig(timeout_s=20.0))
dist.barrier()
if rank == 3:
    os._exit(3)
try:
    comm.all_reduce(torch.ones(1 << 18), algorithm="ring")
    outcome = "finished"
except comm.CommError as error:
    outcome = str(error)
with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as out:
    out.write(outcome)
sys.exit(1)
