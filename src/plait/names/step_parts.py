"""The parts of a training step, as the planner prices them and the trainer measures
them, under one spelling so a report can put the two side by side.

- ``compute``: forward and backward kernels (recomputation included);
- ``tp_comm``: tensor-parallel collectives on the critical path;
- ``pp_comm``: pipeline point-to-point transfers on the critical path (waiting for an
  activation or a gradient that is in flight);
- ``pp_bubble``: pipeline idle time (fill and drain);
- ``dp_comm``: data-parallel / ZeRO collectives on the critical path (the part not
  hidden under compute), gradient-norm and loss reductions;
- ``optimizer``: the optimizer step;
- ``data``: fetching the batch;
- ``other``: the rest of the step's wall time (bookkeeping).

Predicted parts are exposed time: they add up to the predicted step time; communication
hidden under compute is reported apart (``Estimate.hidden_s``).
"""

from __future__ import annotations

COMPUTE = "compute"
TP_COMM = "tp_comm"
PP_COMM = "pp_comm"
PP_BUBBLE = "pp_bubble"
DP_COMM = "dp_comm"
OPTIMIZER = "optimizer"
DATA = "data"
OTHER = "other"
STEP_PARTS = (COMPUTE, TP_COMM, PP_COMM, PP_BUBBLE, DP_COMM, OPTIMIZER, DATA, OTHER)
# the parts the planner prices (data and other are not priced: 0 in a plan)
PRICED_PARTS = (COMPUTE, TP_COMM, PP_COMM, PP_BUBBLE, DP_COMM, OPTIMIZER)
# a run's total step time off the plan's by more than this fraction is flagged, naming the part that differs most
DRIFT_FLAG_FRACTION = 0.25

__all__ = ["COMPUTE", "TP_COMM", "PP_COMM", "PP_BUBBLE", "DP_COMM", "OPTIMIZER", "DATA", "OTHER", "STEP_PARTS",
           "PRICED_PARTS", "DRIFT_FLAG_FRACTION"]
