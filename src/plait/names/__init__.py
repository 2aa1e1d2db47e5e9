"""The shared vocabulary, torch-free: every name two layers share is defined once here
(or in its owner) and imported, never re-typed as a literal.

One module per concept: ``axes`` (mesh axes and their order), ``recompute``
(recomputation modes), ``precision`` (training precisions and gradient-reduce dtypes),
``transports`` (process-group backends and plait's transports), ``collectives``
(collective and reduce-op names) and ``wire`` (the one table of dtype and reduce-op
codes that travel in messages). Nothing here imports torch, so ``cost/`` and ``plan/``
import it freely.
"""
