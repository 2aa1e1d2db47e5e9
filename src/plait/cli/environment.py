"""The PLAIT_* environment variables: every one plait reads or sets, and the check
every ``plait`` command runs before anything else (``--help`` included); and the
cache directory the CLI hands the library (``cache_dir``: the library reads no
environment variable).

A variable whose name starts with ``PLAIT_`` and is none of these is refused (exit 2),
named with the closest known name (difflib), instead of being silently ignored: a
misspelt ``PLAIT_COMM_TIMEOUTS=5`` would otherwise leave the deadline at 300 s.
The variables plait sets for its own child processes are known too (their ranks run
``plait`` and run this check). ``tests/cli/test_environment.py`` checks this table
against every ``PLAIT_*`` name in plait's sources, so a new variable cannot be
forgotten here.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path

from plait.comm.config import ENVIRONMENT as COMM_ENVIRONMENT
from plait.files import default_cache_dir

PREFIX = "PLAIT_"

# name -> what it is and who reads it
KNOWN_VARIABLES = {
    **{variable: f"CommConfig.{field} of every communicator the CLI builds (plait.comm.config)"
       for field, variable in COMM_ENVIRONMENT.items()},
    "PLAIT_CACHE_DIR": "the data and calibration-profile cache the CLI passes to plait.train.corpus and "
                       "plait.cost.profile (plait.cli.environment.cache_dir)",
    "PLAIT_LAUNCH_TIME": "set by plait train for its ranks: when the launcher started (plait.train.loop)",
    "PLAIT_FAULT_KILL": "tests: RANK:STEP, that rank kills itself before STEP (plait.train.loop)",
    "PLAIT_TESTBED_HOST": "set by plait testbed run for its ranks: the host's index (plait.testbed.run)",
    "PLAIT_TEST_MAX_WORKERS": "tests: worker processes the pool keeps (plait.testing.pool)",
}


def unknown_variables_error(environ: Mapping[str, str] | None = None) -> str | None:
    """The message naming every PLAIT_* variable in ``environ`` (default os.environ)
    that plait does not know, each with the closest known name; None if there is none."""
    environ = os.environ if environ is None else environ
    unknown = sorted(name for name in environ if name.startswith(PREFIX) and name not in KNOWN_VARIABLES)
    if not unknown:
        return None
    named = []
    for name in unknown:  # case-insensitive: PLAIT_comm_timeout_s means PLAIT_COMM_TIMEOUT_S
        close = difflib.get_close_matches(name.upper(), KNOWN_VARIABLES, n=1, cutoff=0.6)
        named.append(f"{name}" + (f" (did you mean {close[0]}?)" if close else ""))
    return (f"unknown environment variable{'s' if len(unknown) > 1 else ''} {', '.join(named)}: plait would ignore "
            f"{'them' if len(unknown) > 1 else 'it'}; fix {'each name or unset them' if len(unknown) > 1 else 'the name or unset it'} (plait reads "
            f"{', '.join(sorted(KNOWN_VARIABLES))})")


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The cache directory of every ``plait`` command (tokenised corpora, calibration
    profiles): ``$PLAIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/plait``, else
    ``~/.cache/plait``; read from ``environ`` (default os.environ) when called."""
    environ = os.environ if environ is None else environ
    if environ.get("PLAIT_CACHE_DIR"):
        return Path(environ["PLAIT_CACHE_DIR"]).expanduser()
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]).expanduser() / "plait"
    return default_cache_dir()


__all__ = ["KNOWN_VARIABLES", "PREFIX", "cache_dir", "unknown_variables_error"]
