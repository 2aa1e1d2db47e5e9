"""Mesh axes: data, tensor and pipeline parallelism, and their default order.

``AXES`` lists them as ``ParallelDims`` has its fields (dp first); an order string
such as ``DEFAULT_ORDER`` lists them innermost (consecutive ranks) first.
"""

from __future__ import annotations

DP = "dp"
TP = "tp"
PP = "pp"
AXES = (DP, TP, PP)
# tp innermost: a tp group of size <= processes per node never leaves the node
DEFAULT_ORDER = ",".join((TP, DP, PP))

__all__ = ["AXES", "DEFAULT_ORDER", "DP", "PP", "TP"]
