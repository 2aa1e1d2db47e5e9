"""Memory of a training rank, measured rather than assumed.

Per step, three figures from three independent sources:

- **saved activations**: the peak bytes of live storages autograd holds for the
  backward, from a ``SavedTensorMeter`` whose hooks the pipeline engine composes with
  its own (weak references on what autograd keeps: a storage counts while autograd
  holds a tensor on it, whatever the schedule says; parameters and the batch never
  count). Recomputation's kept block inputs and the tensors a recompute regenerates
  pass through the same hooks, so they count for as long as they live;
- **the engine's figure**: the schedule-driven bookkeeping (bytes counted at each
  forward, dropped at its backward), for comparison with the measurement;
- **resident memory**: on CPU the process's peak resident set (``VmHWM`` from
  ``/proc/self/status``, reset at each step through ``/proc/self/clear_refs``), on a
  GPU ``torch.cuda.max_memory_allocated`` (reset each step).

Model state is read from live storages once after the first step: parameters,
gradients and optimizer state (each storage once).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from plait.memory.saved_memory import SavedTensorMeter

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None or not torch.is_tensor(tensor):
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes(params: list[torch.nn.Parameter], optimizer) -> dict[str, int]:
    """Bytes of the parameters, their gradients and the optimizer's state in memory,
    and of optimizer state offloaded to files (each storage once)."""
    state = [value for entry in optimizer.state.values() for value in entry.values() if torch.is_tensor(value)]
    offload = getattr(optimizer, "offload", None)
    in_files = [offload is not None and offload.owns(value) for value in state]
    return {"params_bytes": _storage_bytes(params), "grads_bytes": _storage_bytes(param.grad for param in params),
            "optimizer_bytes": _storage_bytes(value for value, filed in zip(state, in_files) if not filed),
            "offloaded_bytes": _storage_bytes(value for value, filed in zip(state, in_files) if filed)}


def read_peak_resident_bytes() -> int | None:
    """This process's peak resident set since the last reset (Linux), or None."""
    return _status_bytes("VmHWM")


def read_resident_bytes() -> int | None:
    """This process's resident set now (Linux), or None."""
    return _status_bytes("VmRSS")


def _status_bytes(key: str) -> int | None:
    try:
        match = re.search(key + r":\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def reset_peak_resident() -> bool:
    """Start a new resident-set peak (Linux >= 4.0: writing 5 to clear_refs)."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class MemoryMonitor:
    """One rank's per-step memory figures (see the module docstring). ``meter`` goes to
    the PipelineEngine; ``begin_step`` / ``end_step`` bracket each training step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.meter = SavedTensorMeter()
        self.meter.enabled = True
        self.steps: list[dict] = []
        self.model_state: dict[str, int] | None = None

    def begin_step(self, exclude) -> None:
        self.meter.reset(exclude=exclude)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_resident()

    def end_step(self, engine_peak_bytes: int, params, optimizer) -> dict:
        if self.device.type == "cuda":
            resident = int(torch.cuda.max_memory_allocated(self.device))
        else:
            resident = read_peak_resident_bytes()
        figures = {"saved_peak_bytes": self.meter.peak_bytes, "engine_peak_bytes": int(engine_peak_bytes),
                   "resident_peak_bytes": resident}
        self.steps.append(figures)
        if self.model_state is None:  # after the first step: gradients and optimizer state exist
            self.model_state = model_state_bytes(list(params), optimizer)
        return figures

    def summary(self) -> dict:
        """Peaks over the steps run (the first step included) and the model state."""
        def peak(key):
            values = [step[key] for step in self.steps if step[key] is not None]
            return max(values) if values else None

        return {"saved_activations_peak_bytes": peak("saved_peak_bytes"),
                "engine_activations_peak_bytes": peak("engine_peak_bytes"),
                "resident_peak_bytes": peak("resident_peak_bytes"),
                "resident_source": ("torch.cuda.max_memory_allocated" if self.device.type == "cuda"
                                    else "VmHWM (/proc/self/status), reset each step"),
                **(self.model_state or {})}


MEMORY_COLUMNS = ("saved_activations_peak_bytes", "engine_activations_peak_bytes", "params_bytes", "grads_bytes",
                  "optimizer_bytes", "offloaded_bytes", "resident_peak_bytes")


def memory_rows(ranks: list[dict]) -> list[dict]:
    """One row per rank that reported memory: its rank, coordinates and figures."""
    return [{"rank": rank["rank"], "coords": rank.get("coords", {}), **rank["memory"]}
            for rank in sorted(ranks, key=lambda entry: entry["rank"]) if rank.get("memory")]


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / 2 ** 20:.2f}"


def render_memory(rows: list[dict]) -> list[str]:
    """The report's memory section (markdown lines)."""
    if not rows:
        return []
    lines = ["## Memory", "",
             "MiB per rank, peaks over the steps run. saved activations: live storages autograd held for the "
             "backward, measured through weak references (recomputation's kept inputs and regenerated tensors "
             "included); engine: the pipeline engine's schedule bookkeeping of the same; params, grads, "
             "optimizer: live storages after the first step (optimizer in files: its state offloaded to memory-mapped "
             f"files, not in memory); resident: {rows[0].get('resident_source', 'n/a')}.",
             "", "| rank | coords | saved activations | engine | params | grads | optimizer | optimizer in files | "
             "resident |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        coords = " ".join(f"{axis}{value}" for axis, value in row["coords"].items())
        lines.append(f"| {row['rank']} | {coords} | " + " | ".join(_mib(row.get(key)) for key in MEMORY_COLUMNS) + " |")
    return lines + [""]


__all__ = ["MEMORY_COLUMNS", "MemoryMonitor", "memory_rows", "model_state_bytes", "read_peak_resident_bytes",
           "read_resident_bytes", "render_memory", "reset_peak_resident"]
