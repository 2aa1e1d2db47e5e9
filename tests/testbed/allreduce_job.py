"""A job for `plait testbed run` (tests/testbed/test_testbed.py). Every rank reports
its host and the address it reaches the rendezvous host from; an all-reduce is
checked; 5 MiB are sent from rank 0 to a rank on its own host and to one on the
other host, each timed between barriers. Rank 0 writes it all to argv[1]."""

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((os.environ["MASTER_ADDR"], 9))  # no packet is sent: this only picks the route
mine = {"rank": rank, "host": int(os.environ["PLAIT_TESTBED_HOST"]), "address": probe.getsockname()[0]}
everyone = [None] * world
dist.all_gather_object(everyone, mine)
payload = torch.zeros(5 * 2**20 // 4)


def timed_send(destination: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        dist.send(payload, destination)
    elif rank == destination:
        dist.recv(payload, 0)
    dist.barrier()
    return time.perf_counter() - start


other_host = next(entry["rank"] for entry in everyone if entry["host"] != everyone[0]["host"])
same_host = next((entry["rank"] for entry in everyone[1:] if entry["host"] == everyone[0]["host"]), None)
seconds = {"other_host": timed_send(other_host), "same_host": timed_send(same_host) if same_host else None}
if rank == 0:
    with open(sys.argv[1], "w") as out:
        json.dump({"world": world, "sum": float(value), "ranks": everyone, "send_5MiB_s": seconds}, out)
dist.destroy_process_group()
