"""Nothing ``plait train`` writes, truncates or deletes under ``--out`` goes through a
symbolic link out of the run.

Before any process starts, ``check_run_links(out)`` refuses by name a link standing
where the run writes: the lock, the launch config, the run's own files (metrics,
report, plot, config, run record), ``offload/`` and its ``rank<r>`` directories, and
``previous/`` (where --force-fresh moves an earlier run). ``--out`` itself may be a
link: it is the directory the user named. Checkpoints check their own links
(plait.train.checkpoint).

At write time (a link put there during the run) the writers do not follow one
either: whole files are written to a temporary name and renamed over the link
(``atomic_files.atomic_write``: the link itself is replaced, never its target);
files opened in place (the lock, the appended metrics) are opened with
``atomic_files.open_no_link`` (O_NOFOLLOW), which refuses a link by name.
"""

from __future__ import annotations

import os
from pathlib import Path

from plait.train.atomic_files import LinkRefused
from plait.train.offload_dirs import OFFLOAD_DIR_NAME
from plait.train.rundir import PREVIOUS_DIR, RUN_FILES
from plait.train.runlock import LOCK_NAME

LAUNCH_CONFIG_NAME = "launch-config.toml"
# where plait train writes under --out (checkpoints/ is checked by plait.train.checkpoint)
WRITTEN_NAMES = (LOCK_NAME, LAUNCH_CONFIG_NAME, *RUN_FILES, OFFLOAD_DIR_NAME, PREVIOUS_DIR)


def check_run_links(out: str | os.PathLike) -> None:
    """Raise LinkRefused naming the first symbolic link where plait train writes under
    ``out`` (see WRITTEN_NAMES; also each entry of ``out/offload``). Reads only."""
    out = Path(out)
    for name in WRITTEN_NAMES:
        if (out / name).is_symlink():
            raise LinkRefused(out / name)
    offload = out / OFFLOAD_DIR_NAME
    if offload.is_dir():
        for entry in sorted(offload.iterdir()):
            if entry.is_symlink():
                raise LinkRefused(entry)
