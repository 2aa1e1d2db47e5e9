"""metrics.jsonl: one record per training step, written every ``log_interval`` steps.

A record holds rank 0's step parts too (``part_compute_s``, ``part_tp_comm_s``,
``part_pp_comm_s``, ``part_receive_s``, ``part_dp_comm_s``, ``part_optimizer_s``,
``part_data_s``, ``part_other_s``: plait.parallel.hybrid.StepTimes, adding up to
``step_s``); every rank's sums are in the run report (plait.train.step_breakdown).

A step's record is made on every rank with that dp rank's own loss (the mean over
its share of the global batch). The log holds records back until a *flush*, which
turns each held loss into the mean over the dp group with one all-gather of the
held losses (len(held) float64 per rank), summed in rank order, so:

- a step costs no collective for its metrics; a flush costs one all-gather of
  ``log_interval`` numbers (one latency, alpha, instead of one per step);
- the mean is the same bits whichever steps share a flush (each step's p losses
  are added in rank order, never inside a vector all-reduce whose chunking would
  depend on how many steps it holds), so a resumed run writes exactly the
  numbers the uninterrupted one did.

Every rank flushes at the same steps, a function of the step number alone: after
step s when (s + 1) is a multiple of ``log_interval``, at the end of the run and
before every checkpoint (so metrics.jsonl covers every step a checkpoint covers,
and a run that dies loses only records of steps its resume redoes). Rank 0 then
appends the records to metrics.jsonl (one flush of the file per flush of the
log). On (re)start, rank 0 cuts the file back to the records before the start step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from plait import comm
from plait.train.atomic_files import atomic_write, open_no_link
from plait.train.tensorboard_log import TensorBoardLog


class MetricsLog:
    """The run's per-step records (see the module docstring). Collective: ``flush``
    must be called by every rank of ``group`` (the dp group) at the same steps.

    path: metrics.jsonl; written only where ``write`` (rank 0), which also reads the
        records before ``start_step`` back (``records``: every record of the run).
    group, dp_size: the dp group the losses are averaged over (size 1: no collective).
    interval: log_interval, steps between flushes (>= 1).
    tensorboard_dir: also write the records as TensorBoard scalars there (rank 0), or None.
    """

    def __init__(self, path: Path, *, group, dp_size: int, write: bool, interval: int, start_step: int = 0,
                 tensorboard_dir: Path | None = None):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"log interval must be an int >= 1 step, got {interval!r}")
        self.path, self.group, self.dp_size = Path(path), group, dp_size
        self.interval, self.write = interval, write
        self.records: list[dict] = []
        self._held: list[dict] = []
        self._file = None
        self._tensorboard = None
        if write:
            self.records = read_metrics(self.path, before=start_step)
            write_metrics(self.path, self.records)
            # O_NOFOLLOW: a link put at metrics.jsonl since it was replaced is refused, never appended through
            self._file = os.fdopen(open_no_link(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")
            if tensorboard_dir is not None:
                self._tensorboard = TensorBoardLog(tensorboard_dir, start_step=start_step)

    def flush_due(self, step: int, *, last: bool = False, checkpoint: bool = False) -> bool:
        """Whether the log is flushed after ``step`` (the same answer on every rank)."""
        return last or checkpoint or (step + 1) % self.interval == 0

    def add(self, record: dict) -> None:
        """Hold ``record`` (its "loss": this dp rank's) until the next flush."""
        self._held.append(record)

    def flush(self) -> list[dict]:
        """Average the held losses over the dp group (collective), write them (rank 0)
        and return them."""
        held, self._held = self._held, []
        if not held:
            return []
        if self.dp_size > 1:
            mine = torch.tensor([record["loss"] for record in held], dtype=torch.float64,
                                device=comm.default_device(self.group))
            everyone = torch.empty(self.dp_size * len(held), dtype=torch.float64, device=mine.device)
            comm.all_gather_into_tensor(everyone, mine, group=self.group)
            table = everyone.view(self.dp_size, len(held)).cpu().tolist()  # rank r's losses in row r
            for index, record in enumerate(held):
                total = 0.0
                for row in table:  # rank order: the same bits whatever else the flush holds
                    total += row[index]
                record["loss"] = total / self.dp_size
        if self._file is not None:
            self._file.write("".join(json.dumps(record) + "\n" for record in held))
            self._file.flush()
            self.records.extend(held)
        if self._tensorboard is not None:
            self._tensorboard.write(held)
        return held

    def close(self) -> None:
        """Close the file; records still held (a run that stopped between flushes) are dropped."""
        self._held = []
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


class AxisCommClock:
    """Seconds this rank spends in collectives on each mesh axis of size > 1 during a
    step: ``start()`` before it, ``stop()`` after -> {"comm_dp_s": ..., ...}. Reads
    the time each axis's communicator has recorded (plait.comm.stats(group)); the
    pipeline's send/recv are not collectives (their waits are the step's bubble)."""

    def __init__(self, groups: dict, sizes: dict[str, int]):
        self.groups = {axis: group for axis, group in groups.items() if sizes[axis] > 1}
        self._started: dict[str, float] = {}

    def _seconds(self) -> dict[str, float]:
        return {axis: sum(entry["time_s"] for entry in comm.stats(group).values())
                for axis, group in self.groups.items()}

    def start(self) -> None:
        self._started = self._seconds()

    def stop(self) -> dict[str, float]:
        now = self._seconds()
        return {f"comm_{axis}_s": now[axis] - self._started.get(axis, 0.0) for axis in self.groups}


def read_metrics(path: Path, before: int) -> list[dict]:
    """Records of steps before ``before`` (a resumed run redoes the later ones)."""
    try:  # O_NOFOLLOW: a link's target is neither read into this run nor written back
        with os.fdopen(open_no_link(path, os.O_RDONLY), encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if record.get("step", before) < before:
            records.append(record)
    return records


def write_metrics(path: Path, records: list[dict]) -> None:
    """Replace ``path`` by ``records``, atomically (a temporary file of its own renamed
    over ``path``: a link there is replaced itself, never written through)."""
    text = "".join(json.dumps(record) + "\n" for record in records)
    atomic_write(path, lambda temporary: Path(temporary).write_text(text), nbytes=len(text.encode()))
