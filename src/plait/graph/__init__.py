"""plait.graph: rule-based rewrites of torch.fx graphs, and FoldedCNN.

    from plait.graph import optimize
    gm, report = optimize(model.eval(), (x,))      # every rule in RULES, to a fixed point
    print(report.table())                          # what fired where, and why others did not

Each rule (RULES, in plait.graph.registry) is a pattern, preconditions, a predicted gain
and a replacement; see plait.graph.engine for when one is applied. ``fold(model, f)``
builds the FoldedCNN version of a specialised CNN (Kosaian et al., ICML 2021).
"""

from plait.graph.engine import GraphError, Report, RuleOutcome, optimize
from plait.graph.fold import fold
from plait.graph.registry import RULES

__all__ = ["GraphError", "RULES", "Report", "RuleOutcome", "fold", "optimize"]
