"""Activation recomputation modes, as ``plait train --recompute`` and the planner
spell them: none (keep every activation), selective (recompute the attention core),
full (keep each block's input only)."""

from __future__ import annotations

NONE = "none"
SELECTIVE = "selective"
FULL = "full"
RECOMPUTE_MODES = (NONE, SELECTIVE, FULL)

__all__ = ["FULL", "NONE", "RECOMPUTE_MODES", "SELECTIVE"]
