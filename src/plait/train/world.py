"""Joining the torchrun world a ``plait train`` rank runs in: the process group
(gloo on CPU, NCCL on GPU, from torchrun's environment, a key space per restart
attempt) and the CPU threads each local process gets."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.names.transports import AUTO, GLOO, NCCL


def init_distributed(timeout_s: float, backend: str = "auto") -> torch.device:
    """Join the torchrun world (env://) unless already in one. ``backend`` "auto": NCCL
    with one GPU per local rank when CUDA is available, gloo on CPU otherwise; "gloo" on
    a GPU machine puts local rank r on GPU r mod (GPUs), so ranks may share a GPU (their
    messages pass through host memory, plait.comm.transport.stages_through_host)."""
    use_cuda = torch.cuda.is_available()
    if backend == NCCL and not use_cuda:
        raise ValueError("backend='nccl' needs CUDA GPUs and this machine has none: use backend='gloo' or 'auto'")
    device = torch.device("cpu")
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank % torch.cuda.device_count() if backend == GLOO else local_rank)
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    if backend == AUTO:
        backend = NCCL if use_cuda else GLOO
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return device
    # Under torchrun the store outlives a restart: the killed attempt's keys (gloo
    # addresses of dead processes, one set per new_group) would be read by the new
    # one. Every attempt gets its own key space.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"plait/attempt_{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    return device


def threads_per_process() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // max(local, 1))
