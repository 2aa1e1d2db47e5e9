"""`plait bench dp`: data-parallel training throughput, plait vs torch DDP, and what
each gradient compressor costs and saves.

Every rank runs (``run_dp_bench``):

1. Throughput: ``rounds`` rounds; in each, the same model (same seed) is trained for
   ``warmup`` + ``steps`` steps once with ``plait.parallel.DataParallel`` and once
   with ``torch.nn.parallel.DistributedDataParallel`` (the order alternates between
   rounds, so drift on a shared machine hits both). The timed steps lie between two
   barriers; samples/s = steps x global batch / time. Batches are drawn before the
   clock starts. Reported per mode: the median round.
2. Compression: for each compressor spec, ``DataParallel(compression=...)`` trains
   the small model for ``compression_steps`` steps on the digits; reported: bytes
   sent per step (measured by the comm layer, mean over ranks) and the payload, both
   relative to uncompressed, the mean training loss of the last 10 steps (averaged
   over ranks), and test loss / accuracy. The loss curves go to --plot.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.compress import from_spec
from plait.models import build_model
from plait.models.mlp import MODELS
from plait.parallel import DataParallel
from plait.train.data import load_digits, rank_batch

_MODES = ("plait", "ddp")


@dataclass(frozen=True, kw_only=True)
class DpBenchConfig:
    """Flags of `plait bench dp` (one field per flag)."""

    model: str = "mlp-large"
    batch_size: int = 32  # per rank
    steps: int = 20
    warmup: int = 3
    rounds: int = 3
    algorithm: str = "auto"
    bucket_mb: float = 25.0
    lr: float = 0.05
    compressions: tuple[str, ...] = ()
    compression_model: str = "mlp"
    compression_steps: int = 300
    seed: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        problems = []
        for name in ("model", "compression_model"):
            if getattr(self, name) not in MODELS:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {sorted(MODELS)}")
        for name in ("batch_size", "steps", "rounds", "compression_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            problems.append(f"warmup={self.warmup} must be >= 0")
        if not self.bucket_mb > 0:
            problems.append(f"bucket_mb={self.bucket_mb} must be > 0")
        if not self.lr > 0:
            problems.append(f"lr={self.lr} must be > 0")
        if problems:
            raise ValueError("; ".join(problems))
        if self.compressions:
            from plait.compress import from_spec

            for spec in self.compressions:
                from_spec(spec)  # raises listing the valid forms


def _batches(train, config: DpBenchConfig, count: int, rank: int, world_size: int, offset: int = 0):
    global_batch = config.batch_size * world_size
    return [rank_batch(train, offset + step, global_batch, rank, world_size, seed=config.seed) for step in range(count)]


def _wrap(mode: str, model, config: DpBenchConfig, compression=None):
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=config.bucket_mb)

    return DataParallel(model, algorithm=config.algorithm, bucket_mb=config.bucket_mb, compression=compression)


def _train_steps(model, optimizer, batches) -> list[float]:
    losses = []
    for inputs, labels in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _mean_over_ranks(*values: float) -> list[float]:
    """Bytes differ by rank (a star's root sends p-1 times what a leaf does): report
    the mean over ranks."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def measure_throughput(config: DpBenchConfig, mode: str, train, rank: int, world_size: int) -> dict:
    model = _wrap(mode, build_model(config.model, seed=config.seed), config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    batches = _batches(train, config, config.warmup + config.steps, rank, world_size)
    _train_steps(model, optimizer, batches[: config.warmup])
    if mode == "plait":
        model.history.clear()
    dist.barrier()
    start_s = time.perf_counter()
    _train_steps(model, optimizer, batches[config.warmup :])
    dist.barrier()
    elapsed_s = time.perf_counter() - start_s
    row = {"mode": mode, "time_s": elapsed_s, "step_ms": 1e3 * elapsed_s / config.steps,
           "samples_per_s": config.steps * config.batch_size * world_size / elapsed_s}
    if mode == "plait":
        summary = model.summary()
        row.update(comm_ms=1e3 * summary["comm_time_s"] / config.steps,
                   exposed_ms=1e3 * summary["exposed_comm_s"] / config.steps,
                   hidden_fraction=summary["hidden_fraction"], buckets=summary["buckets"],
                   bytes_per_step=_mean_over_ranks(summary["bytes_sent_per_step"])[0])
        model.remove_hooks()
    return row


def measure_compression(config: DpBenchConfig, spec: str, train, test, rank: int, world_size: int) -> dict:
    compressor = from_spec(spec)
    model = _wrap("plait", build_model(config.compression_model, seed=config.seed), config, compressor)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    batches = _batches(train, config, config.compression_steps, rank, world_size, offset=10_000)
    start_s = time.perf_counter()
    losses = torch.tensor(_train_steps(model, optimizer, batches), dtype=torch.float64)
    elapsed_s = time.perf_counter() - start_s
    dist.all_reduce(losses)  # the curve of the mean loss over ranks
    losses /= world_size
    with torch.no_grad():
        logits = model.module(test.inputs)
        test_loss = F.cross_entropy(logits, test.labels).item()
        accuracy = (logits.argmax(dim=1) == test.labels).double().mean().item()
    summary = model.summary()
    model.remove_hooks()
    bytes_per_step, payload_per_step = _mean_over_ranks(summary.get("bytes_sent_per_step", 0.0),
                                                        summary.get("payload_nbytes_per_step", 0.0))
    return {
        "compression": spec, "describe": compressor.describe() if compressor else "none",
        "bytes_per_step": bytes_per_step, "payload_per_step": payload_per_step,
        "final_loss": losses[-10:].mean().item(), "test_loss": test_loss, "test_accuracy": accuracy,
        "step_ms": 1e3 * elapsed_s / config.compression_steps, "losses": losses.tolist(),
    }


def run_dp_bench(config: DpBenchConfig, *, device=None, emit=None) -> list[dict]:
    """Each rank's part; rank 0 emits ("row", dict) as results arrive and returns them."""
    del device  # CPU models; NCCL would move them, left for the GPU benchmark
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train, test = load_digits(seed=config.seed)
    rows = []
    for round_index in range(config.rounds):
        for mode in (_MODES if round_index % 2 == 0 else _MODES[::-1]):
            row = measure_throughput(config, mode, train, rank, world_size)
            row.update(kind="throughput", round=round_index)
            rows.append(row)
            if emit:
                emit("row", row)
    for spec in config.compressions:
        row = measure_compression(config, spec, train, test, rank, world_size)
        row.update(kind="compression")
        rows.append(row)
        if emit:
            emit("row", row)
    return rows


def median_by_mode(rows: list[dict]) -> dict[str, dict]:
    """Per mode, the round with the median samples/s."""
    result = {}
    for mode in _MODES:
        mine = sorted((row for row in rows if row.get("kind") == "throughput" and row["mode"] == mode),
                      key=lambda row: row["samples_per_s"])
        if mine:
            result[mode] = mine[len(mine) // 2]
    return result


def summary_numbers(rows: list[dict]) -> dict:
    medians = median_by_mode(rows)
    out = {mode: row["samples_per_s"] for mode, row in medians.items()}
    if "plait" in medians and "ddp" in medians:
        out["ratio"] = medians["plait"]["samples_per_s"] / medians["ddp"]["samples_per_s"]
        out["ratio_rounds"] = statistics.median(
            p["samples_per_s"] / d["samples_per_s"]
            for p, d in zip([r for r in rows if r.get("mode") == "plait"], [r for r in rows if r.get("mode") == "ddp"]))
    return out
