"""One step of a pipeline schedule: what a rank does (``ActionKind``), the ``Action``
itself (text and display forms), what a computation costs in the unit-cost replay and
the list scheduler (``compute_cost``), and the error an inconsistent schedule raises.

The bottom of the pipeline package: ``schedules`` (the builders) and ``replay`` (the
unit-cost replay and the validator) both import it; it imports neither. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class ScheduleError(ValueError):
    """A schedule that is inconsistent or deadlocks."""


class ActionKind(str, Enum):
    """What an action does. A str enum: ``ActionKind.FORWARD == "F"``, and it prints and
    serialises (JSON timelines) as its value."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"  # the weight-gradient half of a split backward
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    ALL_REDUCE = "ALL_REDUCE"
    STEP = "STEP"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{kind}" gives the value, as str() does


FORWARD, BACKWARD, WEIGHT = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD
ALL_REDUCE, STEP = ActionKind.ALL_REDUCE, ActionKind.STEP
COMPUTE = (FORWARD, BACKWARD, WEIGHT)
MESSAGES = (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)
_SHORT = {SEND_ACT: "sa", RECV_ACT: "ra", SEND_GRAD: "sg", RECV_GRAD: "rg"}
_LONG = {short: kind for kind, short in _SHORT.items()}
_FIELDS = {kind: ("microbatch", "stage") for kind in COMPUTE}
_FIELDS.update({kind: ("microbatch", "stage", "peer") for kind in MESSAGES})
_FIELDS.update({ALL_REDUCE: (), STEP: ()})
_PATTERN = re.compile(r"(?P<kind>[FBW]|sa|ra|sg|rg)(?P<mb>\d+)@(?P<stage>\d+)(?:(?P<arrow>[<>])(?P<peer>\d+))?$")


@dataclass(frozen=True)
class Action:
    """One thing a rank does: ``kind`` on micro-batch ``microbatch`` at stage
    ``stage``; ``peer`` is the other rank of a send or receive. A message is named by
    the stage that produced it: SEND_ACT/RECV_ACT carry the stage whose forward made
    the activation, SEND_GRAD/RECV_GRAD the stage whose backward made the gradient.
    Fields a kind has no use for are None (ALL_REDUCE and STEP have none; a
    computation has no peer)."""

    kind: ActionKind
    microbatch: int | None = None
    stage: int | None = None
    peer: int | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", ActionKind(self.kind))
        except ValueError:
            raise ValueError(f"unknown action kind {self.kind!r}; one of {[k.value for k in ActionKind]}") from None
        wanted = _FIELDS[self.kind]
        for name in ("microbatch", "stage", "peer"):
            value = getattr(self, name)
            if name in wanted and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"a {self.kind.name} action needs {name} as an int >= 0, got {value!r}")
            if name not in wanted and value is not None:
                raise ValueError(f"a {self.kind.name} action has no {name}: leave it None, got {value!r}")

    def text(self) -> str:
        """Lossless form, read back by ``parse``: F3@2 (forward of micro-batch 3 at stage
        2), B3@2, W3@2, sa3@2>1 / ra3@2<0 (send/receive the activation of micro-batch 3
        made by stage 2 to/from rank 1/0), sg, rg likewise, AR, STEP."""
        if self.kind in COMPUTE:
            return f"{self.kind.value}{self.microbatch}@{self.stage}"
        if self.kind in _SHORT:
            arrow = ">" if self.kind in (SEND_ACT, SEND_GRAD) else "<"
            return f"{_SHORT[self.kind]}{self.microbatch}@{self.stage}{arrow}{self.peer}"
        return "AR" if self.kind == ALL_REDUCE else "STEP"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action ``text()`` wrote."""
        if text in ("AR", "STEP"):
            return cls(ALL_REDUCE if text == "AR" else STEP)
        match = _PATTERN.match(text)
        if match is None or (match["kind"] in _LONG) != (match["peer"] is not None) or (
                match["kind"] in _LONG and (match["arrow"] == ">") != match["kind"].startswith("s")):
            raise ValueError(f"cannot read pipeline action {text!r}: expected e.g. F3@2, B3@2, W3@2, sa3@2>1, "
                             "ra3@2<0, sg3@2>1, rg3@2<0, AR or STEP")
        kind = _LONG.get(match["kind"]) or ActionKind(match["kind"])
        peer = None if match["peer"] is None else int(match["peer"])
        return cls(kind, int(match["mb"]), int(match["stage"]), peer)

    def label(self, chunk: int | None = None) -> str:
        """Compact display form (Gantt charts, timelines): F3, B3 (F3.1: chunk 1 of a
        rank holding several), sa3>2 / ra3<0 (send/receive activation of micro-batch 3
        to/from rank 2/0), AR, STEP. Drops the stage: ``text()`` keeps it."""
        suffix = "" if chunk is None else f".{chunk}"
        if self.kind in COMPUTE:
            return f"{self.kind.value}{self.microbatch}{suffix}"
        if self.kind in _SHORT:
            arrow = ">" if self.kind in (SEND_ACT, SEND_GRAD) else "<"
            return f"{_SHORT[self.kind]}{self.microbatch}{suffix}{arrow}{self.peer}"
        return "AR" if self.kind == ALL_REDUCE else "STEP"


def compute_cost(kind: ActionKind, forward: float, backward: float, *, split: bool = False,
                 weight: float | None = None) -> float:
    """Cost of one computation of one stage: a forward ``forward``; a backward
    ``backward``, or, when the backward is split, W ``weight`` (default half the
    backward) and B the rest, ``backward - weight`` (so B + W is the whole backward)."""
    if kind == FORWARD:
        return forward
    if not split:
        return backward
    weight_cost = backward / 2 if weight is None else weight
    return weight_cost if kind == WEIGHT else backward - weight_cost
