"""plait.cost: predict collectives before they run.

Alpha-beta(-gamma) closed forms and schedule-derived costs (``alpha_beta``),
calibration profiles of the real machine (``profile``, ``calibration``), cluster
topologies (``topology``) and a flow-level simulator (``simulator``).
This package never imports torch.distributed: it runs anywhere, fast.
"""

from plait.cost.link import CostTerms, LinkModel

__all__ = ["CostTerms", "LinkModel"]
