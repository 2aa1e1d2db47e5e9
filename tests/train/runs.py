"""What the trainer tests share: train configs on every rank of a plait.testing world,
and read a run's losses back from its metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path

from plait.train.loop import Trainer


def train_each(rank, world_size, configs, resume="never"):
    """A plait.testing worker: every rank trains each config in turn (one run each)."""
    for config in configs:
        Trainer(config, resume=resume, log=lambda _: None).train()


def losses(out) -> list[float]:
    """The loss of each logged step of the run in ``out``."""
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
