"""plait.cost: predict collectives before they run.

Alpha-beta(-gamma) closed forms and schedule-derived costs (``alpha_beta``),
calibration profiles of the real machine (``profile``, ``calibration``), cluster
topologies (``topology``, ``presets``, ``topology_io``) and a flow-level simulator
(``simulator``). This package imports neither the torch distributed runtime nor plait.comm: it
takes schedules as plain data and runs anywhere, fast.
"""

from plait.cost.link import CostTerms, LinkModel
from plait.cost.alpha_beta import cost_terms, predict_time_s, schedule_terms, schedule_time_s

__all__ = ["CostTerms", "LinkModel", "cost_terms", "predict_time_s", "schedule_terms", "schedule_time_s"]
