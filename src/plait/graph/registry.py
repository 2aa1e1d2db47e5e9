"""RULES: every rewrite rule by name, in the order the engine tries them.

BatchNorm folds come first (they remove whole nodes and expose conv -> ReLU pairs), then
the merges and removals, constants, permutes, and in-place ReLU last (it only marks an
allocation as reusable, so it should see the final producers)."""

from __future__ import annotations

from plait.graph.eliminate import CancelPermutes, RemoveDropout, RemoveIdentity
from plait.graph.fold_bn import FoldBnConv, FoldConvBn, FoldLinearBn
from plait.graph.fold_constants import FoldConstants
from plait.graph.inplace_relu import InplaceRelu
from plait.graph.merge_linear import MergeLinear
from plait.graph.rule import Rule

RULES: dict[str, Rule] = {rule.name: rule for rule in (
    FoldConvBn(), FoldLinearBn(), FoldBnConv(), MergeLinear(), RemoveDropout(), RemoveIdentity(),
    FoldConstants(), CancelPermutes(), InplaceRelu(),
)}
