"""Nothing ``plait train`` writes, truncates or deletes under ``--out`` goes through a
symbolic link out of the run.

Before any process starts, ``check_run_links(out)`` refuses by name a link standing
where the run writes: the lock, the launch config, the run's own files (metrics,
report, plot, config, run record and its temporary name), ``offload/`` and its
``rank<r>`` directories, and ``previous/`` (where --force-fresh moves an earlier run);
and a device node, FIFO or socket where it writes a file. ``--out`` itself may be a
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

from plait.train.atomic_files import LinkRefused, check_replaceable
from plait.train.offload_dirs import OFFLOAD_DIR_NAME
from plait.train.rundir import PREVIOUS_DIR, RUN_FILES, RUN_RECORD
from plait.train.runlock import LOCK_NAME

LAUNCH_CONFIG_NAME = "launch-config.toml"
RUN_RECORD_TEMPORARY = f".{RUN_RECORD}.tmp"  # the fixed temporary name older plait wrote run.json through
# the files plait train writes under --out, and its directories (checkpoints/ is checked by plait.train.checkpoint)
WRITTEN_FILES = (LOCK_NAME, LAUNCH_CONFIG_NAME, *RUN_FILES, RUN_RECORD_TEMPORARY)
WRITTEN_DIRECTORIES = (OFFLOAD_DIR_NAME, PREVIOUS_DIR)


def check_run_links(out: str | os.PathLike) -> None:
    """Raise LinkRefused naming the first symbolic link where plait train writes under
    ``out`` (WRITTEN_FILES, WRITTEN_DIRECTORIES and each entry of ``out/offload``), or
    NotRegularFile naming a device node, FIFO, socket or directory where it writes a
    file (it would hang on a FIFO, or fail after training). Reads only."""
    out = Path(out)
    for name in (*WRITTEN_FILES, *WRITTEN_DIRECTORIES):
        if (out / name).is_symlink():
            raise LinkRefused(out / name)
    for name in WRITTEN_FILES:
        check_replaceable(out / name)
    offload = out / OFFLOAD_DIR_NAME
    if offload.is_dir():
        for entry in sorted(offload.iterdir()):
            if entry.is_symlink():
                raise LinkRefused(entry)
