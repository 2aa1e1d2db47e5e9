"""plait: distributed deep-learning training on torch.distributed.

Layers (dependencies point down only): cli -> train -> plan -> parallel -> compress
-> comm -> cost. See ../shared/DESIGN.md for the map.
"""

__version__ = "0.1.0"
