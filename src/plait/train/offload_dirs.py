"""A training rank's offload directory, ``<out>/offload/rank<r>``: where activation
offload writes its files and optimizer offload maps its (unlinked) state files."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist


def prepare_offload_dir(out: Path, rank: int, world_size: int, wanting: list[str]) -> Path:
    """This rank's directory, created and checked writable on every rank at once (one
    all-gather, so every rank must call it): a rank that cannot write is named on all
    of them before any step. ``wanting``: the settings that need it, for the message."""
    directory = out / "offload" / f"rank{rank}"
    problem = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".probe"
        probe.write_bytes(b"plait")
        probe.unlink()
    except OSError as error:
        problem = f"rank {rank} cannot write its offload directory {directory}: {error}"
    everyone = [None] * world_size
    dist.all_gather_object(everyone, problem)
    problems = [entry for entry in everyone if entry]
    if problems:
        raise OSError("; ".join(problems) + f" ({' and '.join(wanting)} need{'s' if len(wanting) == 1 else ''} "
                      "a writable --out on every node)")
    return directory


def remove_offload_dir(out: Path, rank: int) -> None:
    """Remove this rank's directory, and ``offload/`` itself once the last rank is out."""
    directory = out / "offload" / f"rank{rank}"
    shutil.rmtree(directory, ignore_errors=True)
    try:
        directory.parent.rmdir()
    except OSError:
        pass
