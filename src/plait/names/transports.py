"""Process-group backends and plait's transports, as the CLI flags and configs spell
them. ``auto``: the backend picks itself (NCCL with CUDA, gloo otherwise); the
transport picks shared memory when the whole group is on one host."""

from __future__ import annotations

AUTO = "auto"
GLOO = "gloo"
NCCL = "nccl"
SHM = "shm"
BACKENDS = (AUTO, NCCL, GLOO)
TRANSPORTS = (AUTO, SHM, GLOO)

__all__ = ["AUTO", "BACKENDS", "GLOO", "NCCL", "SHM", "TRANSPORTS"]
