"""plait.plan.auto: Alpa-style auto-parallelisation (issue 35).

``mesh`` (a 1-D or 2-D device mesh on a Cluster) and ``strategy`` (one sharding choice
of an operator, with its costs); ``strategies`` (what each operator kind may do),
``reshard_cost`` (what changing layout between two operators costs), ``ilp`` (the
intra-operator MILP and its exhaustive check), ``stages`` (the inter-operator stage /
sub-mesh dynamic program), ``planner`` (graph -> plan), ``plan_file`` (saved plans) and
``report`` (the table and the picture).
"""
