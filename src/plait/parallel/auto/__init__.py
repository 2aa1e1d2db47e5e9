"""plait.parallel.auto: run an automatically sharded model (issue 35, Alpa's view).

``opgraph`` (the operator graph, plain data), ``trace`` (torch.export's training IR
into an OpGraph), ``reshard`` (the collectives between layouts, with their duals in
backward) and ``execute`` (a model run on local shards with plait's collectives where
layouts change). The planner that chooses the layouts is ``plait.plan.auto``.
"""
