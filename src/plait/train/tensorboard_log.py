"""TensorBoard event files of a run's metrics: ``plait train --log tensorboard``.

Rank 0 writes ``OUT/tensorboard/events.out.tfevents.*`` with torch's SummaryWriter
(``tensorboard --logdir OUT/tensorboard`` shows them): every number of every
metrics.jsonl record becomes a scalar of the same name at ``global_step`` = its
"step" — loss (the dp mean), lr, grad_norm, tokens_per_s (samples_per_s for the
MLP), step_s, elapsed_s, the memory peaks (saved_peak_bytes, resident_peak_bytes),
the seconds in collectives per mesh axis (comm_dp_s, comm_tp_s, comm_pp_s: rank 0's,
axes of size > 1), val_loss on evaluation steps, loss_scale under fp16. The values are
written in float64 (new-style tensor summaries): a scalar reads back equal to its
metrics.jsonl number.

Written at each flush of the metrics log, so the events cover the same steps as
metrics.jsonl. A resumed run opens the writer with ``purge_step`` = its start step:
TensorBoard then drops the events of later steps from the earlier files (the steps
the resume redoes), as metrics.jsonl is cut back to them.
"""

from __future__ import annotations

from pathlib import Path

TENSORBOARD_DIR = "tensorboard"


def scalars_of(record: dict) -> dict[str, float]:
    """The numbers of a metrics record, "step" (the x axis) left out."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoardLog:
    """Event files under ``directory`` (OUT/tensorboard); a run that starts at
    ``start_step`` (a resume: > 0) purges the earlier files' events from that step on."""

    def __init__(self, directory: str | Path, *, start_step: int = 0):
        # tensorboard is the optional hf extra: imported only by runs that log to it
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # purge_step writes SessionLog.START at start_step, every run (TensorBoard takes the first START of a
        # directory as its start, each later one as a restart that drops the earlier events from that step on)
        self._writer = SummaryWriter(log_dir=str(self.directory), purge_step=start_step)

    def write(self, records: list[dict]) -> None:
        """One scalar per number of each record at its step; flushed to disk."""
        for record in records:
            for tag, value in scalars_of(record).items():
                self._writer.add_scalar(tag, value, global_step=int(record["step"]), new_style=True,
                                        double_precision=True)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_scalars(directory: str | Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the event files under ``directory``, read as the
    TensorBoard server reads them (its plugin EventAccumulator: the events of steps a
    resume redid are purged). ValueError if a step still has two values."""
    # tensorboard is the optional hf extra: imported only by readers
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    accumulator = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    accumulator.Reload()
    scalars: dict[str, dict[int, float]] = {}
    for tag in accumulator.Tags()["tensors"]:
        events = accumulator.Tensors(tag)
        scalars[tag] = {event.step: tensor_util.make_ndarray(event.tensor_proto).item() for event in events}
        if len(scalars[tag]) != len(events):
            raise ValueError(f"{directory}: tag {tag!r} has {len(events)} events over {len(scalars[tag])} steps: some "
                             "step was written twice and not purged")
    return scalars
