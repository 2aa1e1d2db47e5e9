"""Training progress for rank 0: a bar rewritten in place on a terminal, plain lines elsewhere.

On a TTY one line is redrawn with ``\\r``::

    [#########...............] step 120/300  loss 2.345  12.3k tok/s  ETA 1m20s

The rate is in the unit the model trains on (``throughput_unit``): tokens for the GPT
(``tok/s``), samples for the MLP (``samples/s``: one digit image is one sample).

On anything else (a pipe, a log file, pytest's capture) a plain line with no control
characters is written at most every ``interval_s`` seconds, plus always the first and
the last step. ``step`` counts completed steps: ``update(step)`` is called after step
number ``step`` (1-based) finished, so the last one is ``step == total_steps``; a
resumed run passes ``start_step`` (the steps already done before this process).

ETA = mean step time × steps left, the mean taken over the steps after the first one
this process ran (the first includes warm-up: allocation, compilation, rendezvous):
mean_step_s = (now - time of first update) / (step - step of first update).
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from typing import IO, Callable

BAR_WIDTH = 24
DEFAULT_INTERVAL_S = 5.0
# What one step of each of plait train's models (TrainConfig.model) processes: the GPT
# global_batch x seq_len tokens, the MLP global_batch samples (digit images, no sequence).
THROUGHPUT_UNITS = {"gpt": "tokens", "mlp": "samples"}
RATE_LABELS = {"tokens": "tok/s", "samples": "samples/s"}  # the progress line's short form


def throughput_unit(model: str) -> str:
    """The unit ("tokens" or "samples") a throughput of plait train's ``model`` counts."""
    if model.startswith("hf:"):  # a Hugging Face causal LM (TrainConfig.hf_source) counts tokens
        return "tokens"
    if model not in THROUGHPUT_UNITS:
        raise ValueError(f"model={model!r} has no throughput unit; known: {', '.join(THROUGHPUT_UNITS)}")
    return THROUGHPUT_UNITS[model]


def rate_key(unit: str) -> str:
    """The metrics.jsonl / report key of a rate in ``unit``: "tokens_per_s", "samples_per_s"."""
    if unit not in RATE_LABELS:
        raise ValueError(f"unit={unit!r} is not a throughput unit; use one of {', '.join(RATE_LABELS)}")
    return f"{unit}_per_s"


def format_duration(seconds: float) -> str:
    """Short human duration: 12.4 -> '12.4s', 185 -> '3m05s', 3720 -> '1h02m'; '--' if unknown.

    Under a minute one decimal; under an hour whole seconds; above, whole minutes."""
    if seconds is None or not math.isfinite(seconds):
        return "--"
    if seconds < 0:
        raise ValueError(f"duration must be >= 0 seconds, got {seconds}")
    if round(seconds, 1) < 60.0:
        return f"{seconds:.1f}s"
    whole_s = int(round(seconds))
    if whole_s < 3600:
        return f"{whole_s // 60}m{whole_s % 60:02d}s"
    whole_min = int(round(seconds / 60.0))
    return f"{whole_min // 60}h{whole_min % 60:02d}m"


def format_rate(value: float) -> str:
    """SI-abbreviated rate: 850 -> '850', 12345 -> '12.3k', 1.5e6 -> '1.50M'."""
    if value is None or not math.isfinite(value):
        return "--"
    magnitude = abs(value)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= scale:
            scaled = value / scale
            return f"{scaled:.2f}{suffix}" if abs(scaled) < 10 else f"{scaled:.1f}{suffix}"
    return f"{value:.0f}"


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


class Progress:
    """Progress of steps ``start_step+1 .. total_steps``: a TTY bar or rate-limited plain lines.

    ``clock`` (seconds, monotonic) is injectable for tests; ``columns`` caps the TTY
    line width (default: the terminal's), so a long line never wraps and breaks ``\\r``.
    ``unit`` ("tokens" or "samples", ``throughput_unit(model)``) labels the rate."""

    def __init__(self, total_steps: int, *, start_step: int = 0, stream: IO[str] | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 columns: int | None = None, unit: str = "tokens"):
        problems = []
        if unit not in RATE_LABELS:
            problems.append(f"unit({unit!r}) must be one of {', '.join(RATE_LABELS)}")
        if not isinstance(total_steps, int) or total_steps < 0:
            problems.append(f"total_steps({total_steps!r}) must be an int >= 0")
        if not isinstance(start_step, int) or start_step < 0:
            problems.append(f"start_step({start_step!r}) must be an int >= 0")
        elif isinstance(total_steps, int) and start_step > total_steps:
            problems.append(f"start_step({start_step}) > total_steps({total_steps})")
        if not interval_s >= 0:
            problems.append(f"interval_s({interval_s!r}) must be >= 0")
        if columns is not None and columns < 20:
            problems.append(f"columns({columns!r}) must be >= 20")
        if problems:
            raise ValueError("Progress: " + "; ".join(problems))
        self.total_steps = total_steps
        self.start_step = start_step
        self.unit = unit
        self.stream = sys.stderr if stream is None else stream
        self.interval_s = float(interval_s)
        self.is_tty = _is_tty(self.stream)
        self._clock = clock
        self._columns = columns
        self._start_time_s = clock()
        self._first_update: tuple[int, float] | None = None  # (step, time_s) of the first update
        self._last_print_s: float | None = None
        self._pending: str | None = None  # newest plain line not yet written (non-TTY)
        self._bar = ""  # the line now on screen (TTY)
        self._closed = False

    # ---- timing -------------------------------------------------------------------

    def mean_step_s(self, step: int, now_s: float) -> float | None:
        """Mean seconds per step after the first update; None until two updates."""
        if self._first_update is None:
            return None
        first_step, first_time_s = self._first_update
        if step <= first_step:
            return None
        return (now_s - first_time_s) / (step - first_step)

    def eta_s(self, step: int, now_s: float) -> float | None:
        """Seconds left: mean step time × (total_steps - step); None while unknown."""
        mean_s = self.mean_step_s(step, now_s)
        if mean_s is None:
            return None
        return mean_s * max(0, self.total_steps - step)

    # ---- output -------------------------------------------------------------------

    def update(self, step: int, loss: float, rate_per_s: float, extra: str = "") -> None:
        """Report that step ``step`` finished with this loss and throughput (in ``unit`` per second)."""
        if self._closed:
            raise ValueError("Progress.update after close(); make a new Progress")
        now_s = self._clock()
        if self._first_update is None:
            self._first_update = (step, now_s)
        eta_s = self.eta_s(step, now_s)
        done = step >= self.total_steps
        parts = [f"step {step}/{self.total_steps}", f"loss {loss:.3f}",
                 f"{format_rate(rate_per_s)} {RATE_LABELS[self.unit]}"]
        if done:
            parts.append(f"done in {format_duration(now_s - self._start_time_s)}")
        else:
            parts.append(f"ETA {format_duration(eta_s) if eta_s is not None else '--'}")
        if extra:
            parts.append(extra)
        if self.is_tty:
            fraction = min(1.0, step / self.total_steps) if self.total_steps else 1.0
            filled = int(round(fraction * BAR_WIDTH))
            bar = "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "] "
            self._draw(bar + "  ".join(parts))
            return
        percent = f" ({100.0 * step / self.total_steps:.0f}%)" if self.total_steps else ""
        parts[0] += percent
        parts.insert(3, f"elapsed {format_duration(now_s - self._start_time_s)}")
        line = "  ".join(parts).replace("\r", " ").replace("\n", " ")
        due = self._last_print_s is None or now_s - self._last_print_s >= self.interval_s
        if due or done:
            self._write_line(line)
            self._last_print_s = now_s
            self._pending = None
        else:
            self._pending = line

    def log(self, message: str) -> None:
        """Print ``message`` on its own line(s) without breaking the bar (redrawn below it)."""
        if self.is_tty and self._bar:
            bar = self._bar
            self._clear()
            self.stream.write(message.rstrip("\n") + "\n")
            self._draw(bar)
        else:
            self._write_line(message.rstrip("\n"))

    def close(self) -> None:
        """Finish: end the TTY line, or write the newest update if it was held back."""
        if self._closed:
            return
        self._closed = True
        if self.is_tty:
            if self._bar:
                self.stream.write("\n")
                self._bar = ""
        elif self._pending is not None:
            self._write_line(self._pending)
            self._pending = None
        self._flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- helpers ------------------------------------------------------------------

    def _width(self) -> int:
        if self._columns is not None:
            return self._columns
        return max(20, shutil.get_terminal_size(fallback=(120, 24)).columns)

    def _draw(self, line: str) -> None:
        # one column short of the terminal: writing into the last column wraps on some terminals
        line = line[: self._width() - 1]
        padding = " " * max(0, len(self._bar) - len(line))  # wipe the tail of a longer old line
        self.stream.write("\r" + line + padding)
        self._bar = line
        self._flush()

    def _clear(self) -> None:
        self.stream.write("\r" + " " * len(self._bar) + "\r")
        self._bar = ""

    def _write_line(self, line: str) -> None:
        self.stream.write(line + "\n")
        self._flush()

    def _flush(self) -> None:
        flush = getattr(self.stream, "flush", None)
        if flush is not None:
            flush()
