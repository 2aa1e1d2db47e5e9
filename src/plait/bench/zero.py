"""`plait bench zero`: ZeRO stages 1-3 against plait's DataParallel, torch's
DistributedDataParallel and torch FSDP2 (``fully_shard``) on the same GPT, in one
world of N gloo processes.

Variants (each a fresh model from the same seed, AdamW, one step = forward, loss,
backward, optimizer step, zero_grad, then a barrier so a step ends on every rank):

  dataparallel   plait.parallel.DataParallel (bucketed all-reduce overlapped with backward)
  ddp            torch.nn.parallel.DistributedDataParallel
  zero1          plait.parallel.ZeRO stage 1
  zero2          stage 2 (gradients reduce-scattered during the backward)
  zero3          stage 3 (each block gathered before use and freed after)
  zero1-disk, zero2-disk, zero3-disk
                 the same with offload="disk": the optimizer state in memory-mapped
                 files under the system's temporary directory between steps
  fsdp2          fully_shard on every block and the root (reshard after forward: ~ stage 3)
  fsdp2-keep     the same with reshard_after_forward=False (~ stage 2)

Per round every variant runs ``steps`` timed steps after one warm-up, in an order
rotated each round. Reported per variant: the median step time over rounds (each
round's median step) with its spread; the model state this rank holds in memory
after a step, from live storages (parameters, gradients, optimizer state; DTensors by
their local shards; offloaded state not counted); the resident set after the last step
(VmRSS) and its peak during a step (VmHWM, reset per step), largest rank. Ratios are
per round, plait against its peer run in the same round: zero3 / fsdp2, zero2 /
fsdp2-keep and zero1, zero2 / dataparallel, and each zeroN-disk / zeroN (throughput:
the peer's step time over plait's, so > 1 means plait is faster; for offload, the time
it adds). Each row says what carried its collectives (``transport``): plait.comm's
transport for plait's wrappers (shared memory by default), gloo for DDP and FSDP2.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.models import GPT, GPTConfig
from plait.parallel.data.data_parallel import DataParallel
from plait.parallel.zero.module import ZeRO
from plait.train.memory import read_peak_resident_bytes, read_resident_bytes, reset_peak_resident

VARIANTS = ("dataparallel", "ddp", "zero1", "zero2", "zero3", "fsdp2", "fsdp2-keep", "zero1-disk", "zero2-disk",
            "zero3-disk")
PAIRS = (("zero3", "fsdp2"), ("zero2", "fsdp2-keep"), ("zero1", "dataparallel"), ("zero2", "dataparallel"),
         ("zero1-disk", "zero1"), ("zero2-disk", "zero2"), ("zero3-disk", "zero3"))


@dataclass(frozen=True, kw_only=True)
class ZeroBenchConfig:
    """Flags of `plait bench zero` (one field per flag)."""

    nprocs: int = 4
    variants: tuple[str, ...] = VARIANTS
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq_len: int = 128
    vocab: int = 512
    batch: int = 4  # sequences per rank
    rounds: int = 3
    steps: int = 4
    timeout_s: float = 600.0  # the world's silence limit

    def problems(self) -> list[str]:
        found = []
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            found.append(f"--variants: unknown {', '.join(map(repr, unknown)) or '(none given)'}; valid: "
                         f"{', '.join(VARIANTS)}")
        for name in ("nprocs", "layers", "hidden", "heads", "seq_len", "vocab", "batch", "rounds", "steps"):
            if getattr(self, name) < 1:
                found.append(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.nprocs < 2:
            found.append(f"--nprocs {self.nprocs}: sharding needs at least 2 ranks")
        return found


def _model(config: ZeroBenchConfig) -> GPT:
    return GPT(GPTConfig(layers=config.layers, hidden=config.hidden, heads=config.heads, seq_len=config.seq_len,
                         vocab=config.vocab, tied_head=False), seed=0)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


class _Runner:
    """One variant: the wrapped model, its step and what it holds."""

    def __init__(self, variant: str, config: ZeroBenchConfig):
        self.variant = variant
        model = _model(config)
        self.zero = None
        if variant == "dataparallel":
            self.wrapped = DataParallel(model)
            self.optimizer = _adamw(self.wrapped.parameters())
        elif variant == "ddp":
            self.wrapped = torch.nn.parallel.DistributedDataParallel(model)
            self.optimizer = _adamw(self.wrapped.parameters())
        elif variant.startswith("zero"):
            # the units FSDP2 gets below: the embedding and each block (GPT's final LayerNorm and head
            # are used by the root's own forward, so they stay with the root)
            self.zero = self.wrapped = ZeRO(model, _adamw, stage=int(variant[4]),
                                            wrap=lambda gpt: [gpt.embedding, *gpt.blocks],
                                            offload="disk" if variant.endswith("-disk") else None)
            self.optimizer = None
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            keep = variant == "fsdp2-keep"
            for unit in (model.embedding, *model.blocks):
                fully_shard(unit, mesh=mesh, reshard_after_forward=not keep)
            fully_shard(model, mesh=mesh, reshard_after_forward=not keep)
            self.wrapped = model
            self.optimizer = _adamw(model.parameters())

    def step(self, tokens: torch.Tensor) -> None:
        logits = self.wrapped(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        if self.zero is not None:
            self.zero.step()
            self.zero.zero_grad()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        dist.barrier()

    def transport(self) -> str:
        """What carried this variant's collectives: plait.comm's transport (shared memory by
        default) for plait's wrappers, torch.distributed's gloo for DDP and FSDP2."""
        communicator = getattr(self.zero if self.zero is not None else self.wrapped, "communicator", None)
        if communicator is not None:
            return f"plait.comm: {communicator.transport.description}"
        return f"torch.distributed: {dist.get_backend()}"

    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state this rank holds (live storages, once each)."""
        if self.zero is not None:
            held = self.zero.model_state_bytes()
            return sum(held.values()) - held["offloaded_bytes"]
        tensors = []
        for param in self.wrapped.parameters():
            tensors += [param, param.grad]
        for entry in self.optimizer.state.values():
            tensors += [value for value in entry.values() if torch.is_tensor(value)]
        if isinstance(self.wrapped, DataParallel):
            tensors += [bucket.buffer for bucket in self.wrapped.buckets]
        seen, total = set(), 0
        for tensor in tensors:
            if tensor is None:
                continue
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            storage = local.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total


def _largest(value: float) -> float:
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def run_zero_bench(config: ZeroBenchConfig, *, device=None, emit=None) -> list[dict]:
    """Every variant, ``config.rounds`` rounds; rank 0 emits ("row", dict) per variant per round."""
    del device  # CPU / gloo here
    torch.set_num_threads(1)
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, config.vocab, (config.batch, config.seq_len + 1), generator=generator)
    rows = []
    variants = tuple(config.variants)
    for round_index in range(config.rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            runner = _Runner(variant, config)
            runner.step(tokens)  # warm-up: gradients, buckets and optimizer state allocated
            times, peaks = [], []
            for _ in range(config.steps):
                reset_peak_resident()
                start_s = time.perf_counter()
                runner.step(tokens)
                times.append(time.perf_counter() - start_s)
                peaks.append(read_peak_resident_bytes() or 0)
            row = {"round": round_index, "variant": variant, "step_s": _largest(statistics.median(times)),
                   "state_bytes": _largest(runner.state_bytes()), "resident_peak_bytes": _largest(max(peaks)),
                   "resident_after_bytes": _largest(read_resident_bytes() or 0), "transport": runner.transport()}
            rows.append(row)
            if rank == 0 and emit:
                emit("row", row)
            del runner
    return rows


def summarize(rows: list[dict], variants) -> dict:
    """Per variant medians and spreads; per pair the per-round throughput ratios."""
    by_variant = {variant: [row for row in rows if row["variant"] == variant] for variant in variants}
    table = []
    for variant, mine in by_variant.items():
        if not mine:
            continue
        times = [row["step_s"] for row in mine]
        table.append({"variant": variant, "step_s": statistics.median(times), "step_s_min": min(times),
                      "step_s_max": max(times), "state_bytes": statistics.median(row["state_bytes"] for row in mine),
                      "resident_peak_bytes": statistics.median(row["resident_peak_bytes"] for row in mine),
                      "resident_after_bytes": statistics.median(row["resident_after_bytes"] for row in mine)})
    pairs = []
    for mine, peer in PAIRS:
        if by_variant.get(mine) and by_variant.get(peer):
            peer_by_round = {row["round"]: row["step_s"] for row in by_variant[peer]}
            ratios = [peer_by_round[row["round"]] / row["step_s"] for row in by_variant[mine]
                      if row["round"] in peer_by_round]
            pairs.append({"plait": mine, "peer": peer, "throughput_ratios": ratios,
                          "median": statistics.median(ratios)})
    return {"variants": table, "pairs": pairs}
