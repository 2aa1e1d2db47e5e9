"""A rewrite rule on a torch.fx graph, and the graph queries its preconditions share.

A rule has four parts (plait.graph.engine applies them):

    find(gm, shapes) -> [Match]   the pattern: every place in the graph it could fire
    check(match) -> reason | None the preconditions: a sentence saying why it must not fire here
    gain(match) -> (flops, bytes) the predicted saving per forward, from the traced shapes
    apply(gm, match)              the replacement, done in place on the graph and its modules

``shapes`` maps each fx node to the ``TensorShape`` of its output on the example inputs
(torch.fx ShapeProp); nodes whose output is not a single tensor are absent.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import fx, nn


@dataclass(frozen=True)
class TensorShape:
    """Shape and dtype of one node's output: numel elements of itemsize bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


Shapes = dict[fx.Node, TensorShape]


def recorded_shapes(gm: fx.GraphModule) -> Shapes:
    """The shapes ShapeProp recorded in the nodes' meta (rewrites keep them on the nodes
    that replace others: every rule preserves the shape of what it replaces)."""
    shapes: Shapes = {}
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "shape"):
            shapes[node] = TensorShape(tuple(meta.shape), meta.dtype)
    return shapes


@dataclass(eq=False)
class Match:
    """One place a rule's pattern matched: its nodes (in graph order), where (names), and
    how many graph nodes the rewrite would remove (a Python call each per forward)."""

    gm: fx.GraphModule
    shapes: Shapes
    nodes: tuple[fx.Node, ...]
    where: str
    nodes_removed: int = 1
    extra: dict = field(default_factory=dict)


class Rule(ABC):
    """Base of every rewrite rule; subclasses set ``name``, implement ``find`` and
    ``apply``, and override ``check`` / ``gain`` where they refuse or save something."""

    name: str = ""

    @property
    def doc(self) -> str:
        return inspect.getdoc(type(self)) or ""

    @abstractmethod
    def find(self, gm: fx.GraphModule, shapes: Shapes) -> list[Match]:
        """Every place the rule's pattern matches."""

    def check(self, match: Match) -> str | None:
        return None

    def gain(self, match: Match) -> tuple[float, float]:
        return 0.0, 0.0

    @abstractmethod
    def apply(self, gm: fx.GraphModule, match: Match) -> None:
        """Rewrite ``gm`` at ``match`` (its check passed and its gain is positive)."""

    def __repr__(self) -> str:
        return f"<rule {self.name}>"


# ---- graph queries shared by the rules -------------------------------------------------

def module_of(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The submodule a call_module node calls, else None."""
    if node.op != "call_module":
        return None
    return gm.get_submodule(node.target)


def calls_module(gm: fx.GraphModule, node: fx.Node, types) -> bool:
    return isinstance(module_of(gm, node), types)


def first_input(node: fx.Node) -> fx.Node | None:
    """The node a module / function / method call takes as its first argument."""
    if node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if "input" in node.kwargs and isinstance(node.kwargs["input"], fx.Node):
        return node.kwargs["input"]
    return None


def label(node: fx.Node) -> str:
    """A node's name for messages: the module's qualified name for call_module."""
    return str(node.target) if node.op == "call_module" else node.name


def other_users(node: fx.Node, expected: fx.Node) -> str | None:
    """Reason to refuse when ``node``'s output feeds anything besides ``expected``."""
    others = [label(user) for user in node.users if user is not expected]
    if not others:
        return None
    return (f"{label(node)}'s output is also used by {', '.join(others)} "
            f"(rewriting it would change that use)")


def call_sites(gm: fx.GraphModule, target: str) -> list[fx.Node]:
    return [node for node in gm.graph.nodes if node.op == "call_module" and node.target == target]


def shared_module_reason(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """Reason to refuse changing the module ``node`` calls: it is called at several places
    (new weights would change every call), one of its parameters is tied to (the same
    tensor as) another module's (new weights would untie them), or is read directly by a
    get_attr node (that use would see the new weights)."""
    module = module_of(gm, node)
    sites = call_sites(gm, node.target)
    if len(sites) > 1:
        return (f"{node.target} is called at {len(sites)} places ({', '.join(site.name for site in sites)}); "
                f"changing its weights would change every call")
    for param_name, param in module.named_parameters(recurse=False):
        own = f"{node.target}.{param_name}"
        aliases = [name for name, other in gm.named_parameters(remove_duplicate=False)
                   if other is param and name != own]
        if aliases:
            return f"{own} is tied to {', '.join(aliases)} (rewriting it would untie them: two copies of the weights)"
        direct = [user.name for user in gm.graph.nodes if user.op == "get_attr" and user.target == own]
        if direct:
            return f"{own} is also read directly by {', '.join(direct)} (changing it would change that use)"
    return None


def bypass(gm: fx.GraphModule, node: fx.Node, replacement: fx.Node) -> None:
    """Send every use of ``node`` to ``replacement`` (which computes the same tensor, so it
    inherits the recorded shape if it has none) and erase ``node``."""
    if "tensor_meta" in node.meta:
        replacement.meta.setdefault("tensor_meta", node.meta["tensor_meta"])
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)
