"""The CommConfig the CLI builds from the environment: the PLAIT_COMM_* variables
(``plait.comm.config.ENVIRONMENT``) and the launcher's LOCAL_WORLD_SIZE. The library
reads no environment variable: the CLI reads them here and passes the CommConfig down
(``plait train`` to every group's communicator, ``plait tune`` to its overrides).

Each value is checked by ``plait.comm.settings`` with the same words as the
CommConfig keyword it sets (errors name the variable, the value and the valid range).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from plait.comm.config import CHECK_MODES, ENVIRONMENT, CommConfig
from plait.comm.settings import checked_setting


def config_from_environment(base: CommConfig | None = None, environ: Mapping[str, str] | None = None) -> CommConfig:
    """``base`` (default CommConfig()) with the variables of ``environ`` (default
    os.environ) that are set applied, each checked: PLAIT_COMM_TIMEOUT_S,
    PLAIT_COMM_CHECK (inband/deep/off, or 1/0 as before: in-band or off),
    PLAIT_COMM_SEGMENT_BYTES, PLAIT_HIERARCHY, PLAIT_ALGORITHMS, and LOCAL_WORLD_SIZE
    (torchrun's ranks on this host) as ``local_world_size``. Unset or empty: the base's."""
    environ = os.environ if environ is None else environ
    base = base or CommConfig()
    changes = {}
    for name, variable in ENVIRONMENT.items():
        text = environ.get(variable, "")
        if not text.strip():
            continue
        if name == "check" and text.strip().lower() in CHECK_MODES:
            changes[name] = text.strip().lower()
            continue
        value = checked_setting("check_args" if name == "check" else name, text, variable)  # as typed, in errors
        if name == "check":  # PLAIT_COMM_CHECK=1/0: in-band or off
            value = "inband" if value else "off"
        changes[name] = value
    local = environ.get("LOCAL_WORLD_SIZE", "").strip()
    if local.isdigit() and int(local) >= 1:
        changes["local_world_size"] = int(local)
    return base.replace(**changes) if changes else base


__all__ = ["config_from_environment"]
