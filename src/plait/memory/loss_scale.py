"""Dynamic loss scaling for 16-bit training, with torch.amp.GradScaler's semantics and
defaults, across ranks.

Each step: the loss is multiplied by ``scale`` before the backward (``scale_loss``);
``unscale`` multiplies every gradient by 1/scale (the reciprocal taken in float64,
rounded to float32, as GradScaler does) and records whether any gradient holds an inf
or NaN; ``found_overflow`` takes the maximum of that flag over ``group`` (every rank
of the run: an overflow on any dp, tp or pp coordinate skips the step everywhere);
``step(optimizer)`` steps unless an overflow was found; ``update`` then halves the
scale on an overflow (``backoff_factor``) or doubles it after ``growth_interval``
clean steps in a row (``growth_factor``). The scale and the clean-step counter are
float32 and int32 tensors updated with GradScaler's arithmetic, so for any pattern
of overflows the scale sequence is GradScaler's, bit for bit.

GradScaler would keep halving forever on a run whose gradients are inf at every
scale; here ``max_consecutive_overflows`` steps skipped in a row stop the run with an
error naming the scale and the count, rather than training on nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait import comm
from plait.errors import PlaitError

DEFAULT_INIT_SCALE = 2.0 ** 16
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_BACKOFF_FACTOR = 0.5
DEFAULT_GROWTH_INTERVAL = 2000
DEFAULT_MAX_CONSECUTIVE_OVERFLOWS = 50


class LossScaleError(PlaitError, RuntimeError):
    """The gradients overflowed at every scale tried: the run cannot go on. A user error
    (the model diverged; the message gives the fix): one line, no traceback."""


class LossScaler:
    """GradScaler's dynamic loss scaling over ``group`` (None: the world; see the module docstring)."""

    def __init__(self, *, init_scale: float = DEFAULT_INIT_SCALE, growth_factor: float = DEFAULT_GROWTH_FACTOR,
                 backoff_factor: float = DEFAULT_BACKOFF_FACTOR, growth_interval: int = DEFAULT_GROWTH_INTERVAL,
                 max_consecutive_overflows: int = DEFAULT_MAX_CONSECUTIVE_OVERFLOWS, group=None):
        problems = []
        if not init_scale > 0:
            problems.append(f"init_scale={init_scale!r} must be > 0")
        if not growth_factor > 1:
            problems.append(f"growth_factor={growth_factor!r} must be > 1")
        if not 0 < backoff_factor < 1:
            problems.append(f"backoff_factor={backoff_factor!r} must be in (0, 1)")
        for name, value in (("growth_interval", growth_interval), ("max_consecutive_overflows",
                                                                   max_consecutive_overflows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a whole number >= 1")
        if problems:
            raise ValueError("LossScaler: " + "; ".join(problems))
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.max_consecutive_overflows = growth_interval, max_consecutive_overflows
        self.group = group
        self._scale = torch.full((), float(init_scale), dtype=torch.float32)
        self._growth_tracker = torch.zeros((), dtype=torch.int32)
        self._found = torch.zeros((), dtype=torch.float32)  # this step's overflow, after found_overflow: any rank's
        self.consecutive_overflows = 0
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        return float(self._scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.to(device=loss.device, dtype=loss.dtype)

    def unscale(self, params) -> bool:
        """Gradients *= 1/scale; True when this rank found an inf or NaN among them."""
        inverse = self._scale.double().reciprocal().float()
        found = False
        for param in params:
            if param.grad is None:
                continue
            param.grad.mul_(inverse.to(device=param.grad.device, dtype=param.grad.dtype))
            found = found or not bool(torch.isfinite(param.grad).all())
        self._found = torch.tensor(1.0 if found else 0.0)
        return found

    def found_overflow(self) -> bool:
        """Whether any rank of the group found one (a max all-reduce of the flags; every
        rank of the group must call it, once per step, after ``unscale``)."""
        flag = self._found.clone()
        if dist.is_available() and dist.is_initialized():  # one process without a process group: its own flag
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.group)
        self._found = flag
        return bool(flag > 0)

    def step(self, optimizer) -> bool:
        """``optimizer.step()`` unless an overflow was found on any rank; True when it stepped."""
        if bool(self._found > 0):
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """GradScaler's rule: an overflow halves the scale and restarts the count;
        ``growth_interval`` clean steps in a row double it."""
        if bool(self._found > 0):
            self._scale = self._scale * self.backoff_factor
            self._growth_tracker = torch.zeros((), dtype=torch.int32)
            self.consecutive_overflows += 1
            self.skipped_steps += 1
            if self.consecutive_overflows >= self.max_consecutive_overflows:
                raise LossScaleError(
                    f"the gradients held inf or NaN at {self.consecutive_overflows} steps in a row; the loss scale "
                    f"is down to {self.scale:g}: the model diverged (lower the learning rate, or train in bf16 or "
                    "fp32)")
        else:
            self.consecutive_overflows = 0
            tracker = self._growth_tracker + 1
            if int(tracker) == self.growth_interval:
                grown = self._scale * self.growth_factor
                if bool(torch.isfinite(grown)):  # as GradScaler: never grow into inf
                    self._scale = grown
                tracker = torch.zeros((), dtype=torch.int32)
            self._growth_tracker = tracker
        self._found = torch.zeros((), dtype=torch.float32)

    def state_dict(self) -> dict:
        return {"scale": self._scale.clone(), "growth_tracker": self._growth_tracker.clone(),
                "consecutive_overflows": self.consecutive_overflows, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "growth_tracker", "consecutive_overflows", "skipped_steps"} - set(state)
        if missing:
            raise ValueError(f"LossScaler state is missing {sorted(missing)}")
        self._scale = state["scale"].to(torch.float32).clone()
        self._growth_tracker = state["growth_tracker"].to(torch.int32).clone()
        self.consecutive_overflows = int(state["consecutive_overflows"])
        self.skipped_steps = int(state["skipped_steps"])


__all__ = ["DEFAULT_INIT_SCALE", "LossScaleError", "LossScaler"]
