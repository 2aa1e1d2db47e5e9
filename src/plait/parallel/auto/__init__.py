"""plait.parallel.auto: run an automatically sharded model (issue 35, Alpa's view).

Nothing is imported here, so the torch-free parts (``opgraph``, ``device_mesh``,
``node_layout``, ``reshard_steps``) load without torch for the planner.

- ``opgraph``: the operator graph (OpGraph, OpNode, ParamMeta), plain data.
- ``device_mesh``: AutoMesh, a 1-D or 2-D logical mesh (row-major ranks, per-axis groups).
- ``trace`` (+ ``trace_kinds``, ``trace_rewrite``, ``trace_views``, ``trace_simplify``):
  ``trace_graph(model, example_inputs)`` turns torch.export's training IR into an OpGraph
  and a canonical fx module; ``simplify`` is Alpa's merging of elementwise chains.
- ``node_layout``: NodeLayout, the layouts one node runs in (inputs, output, parameters).
- ``reshard_steps`` and ``reshard``: layout changes axis by axis, as autograd functions on
  plait's collectives with their backward duals.
- ``execute`` (+ ``execute_node``, ``execute_rules``, ``execute_views``, ``execute_fused``):
  ``auto_parallelize(model, example_inputs, layouts, mesh)`` -> AutoParallelModule, the
  model holding local parameter shards, exact against one process.

The planner that chooses the layouts is ``plait.plan.auto``.
"""
