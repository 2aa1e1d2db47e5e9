"""The rewrite engine: trace a module with torch.fx, apply rules to a fixed point, report.

    gm, report = optimize(module, example_inputs, rules=None, leaf_modules=())

1. ``module`` is deep-copied (the caller's module is never modified) and traced with a
   torch.fx Tracer that also treats ``leaf_modules`` (classes or qualified names) as
   leaves. A module torch.fx cannot trace raises ``GraphError`` naming the construct.
2. Shapes: torch.fx ShapeProp runs the graph on ``example_inputs`` (without autograd) and
   records every node's output shape and dtype; rules price their matches from them.
3. For each rule in order, every match is checked. A match is applied exactly when

       check(match) is None  and  flops_saved >= 0  and  bytes_saved >= 0
       and (flops_saved > 0 or bytes_saved > 0 or match.nodes_removed > 0)

   i.e. the preconditions hold, nothing predicted gets worse, and something gets better:
   FLOPs, bytes read + written (or allocated), or graph nodes (one Python call each per
   forward: a dropout in eval, an Identity or a cancelling permute pair move no bytes but
   still cost a call). Otherwise the match is refused with its reason.
   After each application the graph is linted and recompiled. Shapes are propagated on
   the example inputs at the start of every pass; within a pass the nodes that replace
   others carry the shapes of what they replace (every rule preserves them).
4. The passes repeat until one full pass over all rules applies nothing (the fixed point),
   so optimizing the result again applies nothing.

The optimized module is for inference: rules that fold BatchNorm, merge linears or fold
constants compute new tensors from the parameters' values at that moment (snapshots), and
in-place ReLUs are not meant for autograd. Call ``module.eval()`` first: BatchNorm and
dropout in training mode are refused.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from plait.graph.registry import RULES
from plait.graph.rule import Match, Rule, Shapes, recorded_shapes

MAX_PASSES = 64  # every application removes or rewrites nodes, so a fixed point comes long before


class GraphError(ValueError):
    """A module plait.graph cannot work on (e.g. torch.fx cannot trace it)."""


@dataclass(frozen=True)
class RuleOutcome:
    """One match of one rule: applied, or refused with the reason; predicted saving per forward."""

    rule: str
    where: str
    applied: bool
    reason: str
    flops_saved: float
    bytes_saved: float


@dataclass
class Report:
    """Every match found while optimizing, applied or refused, in the order they were decided."""

    outcomes: list[RuleOutcome]

    @property
    def applied(self) -> list[RuleOutcome]:
        return [outcome for outcome in self.outcomes if outcome.applied]

    @property
    def refused(self) -> list[RuleOutcome]:
        return [outcome for outcome in self.outcomes if not outcome.applied]

    @property
    def predicted_flops_saved(self) -> float:
        return float(sum(outcome.flops_saved for outcome in self.applied))

    @property
    def predicted_bytes_saved(self) -> float:
        return float(sum(outcome.bytes_saved for outcome in self.applied))

    def table(self) -> str:
        """A markdown table: one row per outcome, then the totals of the applied ones."""
        lines = ["| rule | where | applied | FLOPs saved | bytes saved | reason |",
                 "|---|---|---|---:|---:|---|"]
        for outcome in self.outcomes:
            lines.append(f"| {outcome.rule} | {outcome.where} | {'yes' if outcome.applied else 'no'} | "
                         f"{outcome.flops_saved:,.0f} | {outcome.bytes_saved:,.0f} | {outcome.reason} |")
        lines.append(f"| **total applied: {len(self.applied)}** | | | {self.predicted_flops_saved:,.0f} | "
                     f"{self.predicted_bytes_saved:,.0f} | refused: {len(self.refused)} |")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"outcomes": [asdict(outcome) for outcome in self.outcomes],
                "applied": len(self.applied), "refused": len(self.refused),
                "predicted_flops_saved": self.predicted_flops_saved,
                "predicted_bytes_saved": self.predicted_bytes_saved}


class _LeafTracer(fx.Tracer):
    """torch.fx's Tracer, with extra leaves (classes or qualified names), remembering the
    submodule it was inside when tracing failed."""

    def __init__(self, leaf_classes: tuple[type, ...], leaf_names: frozenset[str]):
        super().__init__()
        self.leaf_classes = leaf_classes
        self.leaf_names = leaf_names
        self.inside: list[tuple[str, str]] = []  # (qualified name, class) of modules being traced

    def is_leaf_module(self, module: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(module, self.leaf_classes) or module_qualified_name in self.leaf_names:
            return True
        return super().is_leaf_module(module, module_qualified_name)

    def call_module(self, module, forward, args, kwargs):
        self.inside.append((self.path_of_module(module), type(module).__name__))
        result = super().call_module(module, forward, args, kwargs)
        self.inside.pop()  # not in a finally: after a failure the stack shows where it was
        return result


def _split_leaves(leaf_modules) -> tuple[tuple[type, ...], frozenset[str]]:
    if isinstance(leaf_modules, (str, type)):
        leaf_modules = (leaf_modules,)
    classes, names = [], []
    for leaf in leaf_modules:
        if isinstance(leaf, type) and issubclass(leaf, nn.Module):
            classes.append(leaf)
        elif isinstance(leaf, str):
            names.append(leaf)
        else:
            raise TypeError(f"leaf_modules entry {leaf!r} is neither an nn.Module class nor a qualified "
                            f"module name (str); pass e.g. leaf_modules=(MyBlock, 'encoder.layer0')")
    return tuple(classes), frozenset(names)


def trace(module: nn.Module, leaf_modules=()) -> fx.GraphModule:
    """torch.fx symbolic trace with extra leaf modules; GraphError names what failed."""
    leaf_classes, leaf_names = _split_leaves(leaf_modules)
    known = {name for name, _ in module.named_modules()}
    missing = sorted(leaf_names - known)
    if missing:
        raise ValueError(f"leaf module name(s) {missing} not found in {type(module).__name__}; "
                         f"qualified names look like {sorted(known - {''})[:5]}")
    tracer = _LeafTracer(leaf_classes, leaf_names)
    try:
        graph = tracer.trace(module)
    except Exception as error:  # torch.fx raises TraceError, TypeError, RuntimeError, ... by construct
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        inside = [name for name, _ in tracer.inside if name]
        where = (f" inside submodule '{inside[-1]}' ({tracer.inside[-1][1]})" if inside else
                 f" in {type(module).__name__}.forward")
        suggestion = (f"leaf_modules=('{inside[-1]}',) or ({tracer.inside[-1][1]},)" if inside
                      else "leaf_modules=(TheSubmoduleClass,)")
        raise GraphError(f"torch.fx cannot trace {type(module).__name__}{where}: "
                         f"{type(error).__name__}: {first_line}. Treat the module that does this as a "
                         f"leaf (called as a whole, not traced through): {suggestion} in "
                         f"plait.graph.optimize, or --leaf NAME with plait optimize") from error
    return fx.GraphModule(tracer.root, graph, class_name=type(module).__name__)


def propagate_shapes(gm: fx.GraphModule, example_inputs: tuple) -> Shapes:
    """Run the graph on the example inputs (no autograd) and read each node's output shape."""
    with torch.no_grad():
        ShapeProp(gm).propagate(*example_inputs)
    return recorded_shapes(gm)


def select_rules(rules) -> list[Rule]:
    """None: every rule in RULES order; else the named ones in the given order."""
    if rules is None:
        return list(RULES.values())
    if isinstance(rules, str):
        rules = [rules]
    unknown = [name for name in rules if name not in RULES]
    if unknown:
        raise ValueError(f"unknown rule name(s) {', '.join(map(repr, unknown))}; "
                         f"valid rules: {', '.join(RULES)}")
    return [RULES[name] for name in rules]


def _decide(rule: Rule, match: Match) -> RuleOutcome:
    reason = rule.check(match)
    if reason is not None:
        return RuleOutcome(rule.name, match.where, False, reason, 0.0, 0.0)
    flops_saved, bytes_saved = (float(value) for value in rule.gain(match))
    better = flops_saved > 0 or bytes_saved > 0 or match.nodes_removed > 0
    if flops_saved < 0 or bytes_saved < 0 or not better:
        return RuleOutcome(rule.name, match.where, False,
                           f"predicted gain is not positive (FLOPs {-flops_saved:+,.0f}, "
                           f"bytes {-bytes_saved:+,.0f}, nodes {-match.nodes_removed:+d})",
                           flops_saved, bytes_saved)
    return RuleOutcome(rule.name, match.where, True, "applied", flops_saved, bytes_saved)


def _as_inputs(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a tensor or a tuple of tensors, got "
                    f"{type(example_inputs).__name__}")


def optimize(module: nn.Module, example_inputs, rules=None, *,
             leaf_modules=()) -> tuple[fx.GraphModule, Report]:
    """Trace a copy of ``module`` and apply ``rules`` (None: all of RULES) to a fixed point.

    Returns the optimized GraphModule (for inference) and the Report of every match."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"optimize needs an nn.Module, got {type(module).__name__}")
    inputs = _as_inputs(example_inputs)
    selected = select_rules(rules)
    gm = trace(copy.deepcopy(module), leaf_modules)
    outcomes: list[RuleOutcome] = []
    seen_refusals: set[tuple[str, str, str]] = set()
    for _ in range(MAX_PASSES):
        shapes = propagate_shapes(gm, inputs)
        applied_in_pass = 0
        for rule in selected:
            while True:  # re-find after every application: the graph changed under the matches
                applied = False
                for match in rule.find(gm, shapes):
                    outcome = _decide(rule, match)
                    if outcome.applied:
                        rule.apply(gm, match)
                        gm.delete_all_unused_submodules()
                        gm.graph.lint()
                        gm.recompile()
                        shapes = recorded_shapes(gm)
                        outcomes.append(outcome)
                        applied = True
                        break
                    key = (outcome.rule, outcome.where, outcome.reason)
                    if key not in seen_refusals:
                        seen_refusals.add(key)
                        outcomes.append(outcome)
                if not applied:
                    break
                applied_in_pass += 1
        if applied_in_pass == 0:
            return gm, Report(outcomes)
    raise AssertionError(f"no fixed point after {MAX_PASSES} passes: a rule keeps re-applying")
