"""plait.plan.auto: Alpa-style auto-parallelisation (issue 35).

Nothing is imported here (``import plait.plan.auto.report`` stays torch-free; the
planner loads torch to trace).

- ``strategy``: Strategy, one sharding choice of one operator with its costs per device
  per step (compute, its own collectives, memory).
- ``strategies`` (+ ``strategies_axis``, ``strategies_products``, ``strategies_options``,
  ``strategies_work``): what each operator kind may do on a 1-D or 2-D mesh, priced.
- ``reshard_cost``: what changing layout between two operators costs (forward +
  backward dual), and the cheapest axis-by-axis path.
- ``ilp`` (+ ``ilp_model``, ``ilp_edges``, ``ilp_flow``): the intra-operator MILP (HiGHS
  through scipy) and its exhaustive oracle.
- ``stage_graph`` and ``stages``: the inter-operator stage / sub-mesh dynamic program
  over the ILP's per-slice costs.
- ``planner`` and ``auto_plan``: graph -> the best plan over meshes, with the why.
- ``plan_file`` (saved plans, JSON) and ``report`` (the table and the picture).
- ``to_styles``: a 1-D plan compiled into plait.parallel.tensor's parallelize styles
  when every choice is one.
"""
