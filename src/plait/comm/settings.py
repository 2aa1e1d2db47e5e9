"""The checks of a CommConfig's values, shared by ``CommConfig(...)`` and the PLAIT_*
environment variables the CLI reads (``plait.cli.comm_config.config_from_environment``), so
the two cannot drift: the same value is accepted or refused, in the same words, either way.

    timeout_s      PLAIT_COMM_TIMEOUT_S      finite seconds, 0.001 (1 ms) <= t <= threading.TIMEOUT_MAX
    check_args     PLAIT_COMM_CHECK          1/0, true/false, yes/no, on/off (any case)
    segment_bytes  PLAIT_COMM_SEGMENT_BYTES  whole bytes, 0 (never split) .. 2**53
    algorithms     PLAIT_ALGORITHMS          "all_reduce=ring,broadcast=tree"
    hierarchy      PLAIT_HIERARCHY           sizes "2x4" (2 groups of 4) or "3+5", each >= 1; that
                                             it names a group's ranks needs the group:
                                             hierarchy_ranks() says how many it names

A variable that is unset or empty leaves the default. Errors are ValueErrors that
begin ``NAME=value:`` (the variable, or CommConfig's keyword) and give the valid range.
"""

from __future__ import annotations

import math
import numbers
import threading

from plait.comm.tuner import parse_overrides

MAX_TIMEOUT_S = threading.TIMEOUT_MAX  # the longest wait threading (and so the comm thread) can do
# torch's store and process-group deadlines count whole milliseconds: a shorter one is 0 ms, a wait that times out
# before it starts ("timed out after 0ms" from the C++ store)
MIN_TIMEOUT_S = 0.001
MAX_SEGMENT_BYTES = 2**53  # byte counts stay exact as floats
SWITCH_SPELLINGS = {"1": True, "true": True, "yes": True, "on": True,
                    "0": False, "false": False, "no": False, "off": False}


def checked_setting(name: str, value, source: str):
    """``value`` for the CommConfig field ``name``, converted (text from the environment
    included) and checked; ``source`` is what the error calls it (keyword or variable)."""
    checks = {"timeout_s": _timeout_s, "check_args": _check_args, "segment_bytes": _segment_bytes,
              "algorithms": _algorithms, "hierarchy": _hierarchy}
    return checks[name](value, source)


def _number(value) -> float | None:
    """``value`` as a float (from a number or its text), or None if it is neither."""
    if isinstance(value, bool):
        return None
    try:
        if isinstance(value, str):
            return float(value.strip())
        if isinstance(value, numbers.Real):
            return float(value)
    except (ValueError, OverflowError):
        return None
    return None


def _timeout_s(value, source: str) -> float:
    seconds = _number(value)
    if seconds is None or not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:  # nan fails both comparisons
        raise ValueError(f"{source}={value!r}: the comm timeout must be a finite number of seconds >= "
                         f"{MIN_TIMEOUT_S} (torch counts whole milliseconds: less is 0 ms) and <= "
                         f"{MAX_TIMEOUT_S:.0f}, e.g. 300 (every blocking wait needs a deadline)")
    return seconds


def _check_args(value, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in SWITCH_SPELLINGS:
        return SWITCH_SPELLINGS[value.strip().lower()]
    raise ValueError(f"{source}={value!r}: the argument check must be one of 1/0, true/false, yes/no, on/off "
                     "(any case)")


def _segment_bytes(value, source: str) -> int:
    nbytes = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        nbytes = int(value)
    elif isinstance(value, str):
        try:
            nbytes = int(value)  # exact, however long
        except ValueError:
            pass
    if nbytes is None:
        number = _number(value)  # a float is fine when it is a whole number: 4e6, 1048576.0
        if number is not None and math.isfinite(number) and number.is_integer():
            nbytes = int(number)
    if nbytes is None or not 0 <= nbytes <= MAX_SEGMENT_BYTES:
        raise ValueError(f"{source}={value!r}: the segment size must be a whole number of bytes from 0 (never "
                         f"split) to 2**53, e.g. {4 << 20} (4 MiB)")
    return nbytes


def _algorithms(value, source: str) -> dict:
    if isinstance(value, str):  # a collective named twice: the later one silently won
        named = [item.split("=", 1)[0].strip() for item in value.split(",") if "=" in item]
        twice = sorted({name for name in named if named.count(name) > 1})
        if twice:
            raise ValueError(f"{source}={value!r}: {', '.join(twice)} named more than once; give each collective "
                             f"one algorithm, e.g. {twice[0]}=ring")
    try:
        return parse_overrides(value)
    except (ValueError, TypeError) as error:
        raise type(error)(f"{source}={value!r}: {error}") from None


def _hierarchy(value, source: str):
    """Kept as given (a spec parse_hierarchy takes); text must be sizes ("2x4", "3+5"),
    each >= 1. Whether it names a group's ranks is checked against the group: when a
    collective uses it, and by plait train's launcher against its layout before any
    process starts. Empty text means none."""
    if isinstance(value, str) and not value.strip():
        return None
    if isinstance(value, str):
        hierarchy_ranks(value, source)
    return value


def hierarchy_ranks(spec: str, source: str = "hierarchy") -> int:
    """How many ranks a hierarchy of sizes names: "2x4" -> 8 (2 groups of 4), "3+5" -> 8
    (groups of 3 and 5); a ValueError naming ``source`` unless every size is a whole
    number >= 1. Computed without building the groups (a hostile "100000x100000" costs
    nothing here)."""
    text = spec.replace(" ", "")
    separator = "+" if "+" in text else "x"
    try:
        sizes = [int(size) for size in text.split(separator)]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes):
        raise ValueError(f"{source}={spec!r}: a hierarchy is sizes like '2x4' (2 groups of 4 consecutive ranks; "
                         "more x for more levels) or '3+5' (groups of 3 and 5), each a whole number >= 1")
    return math.prod(sizes) if separator == "x" else sum(sizes)
