"""A model's training step as a graph of operators: what the auto-parallel planner
(``plait.plan.auto``) chooses a sharding for and the executor (``plait.parallel.auto``)
runs. Plain data, torch-free; ``plait.parallel.auto.trace`` builds it from
``torch.export``'s training IR.

Each ``OpNode`` is one operator (or, after simplification, a chain of operators
merged into the first: ``members``) with its global output shape, its forward FLOPs,
the producers of its tensor inputs (``inputs``, in argument order; a node's strategy
gives one layout per entry) and the parameters it reads (``params``, qualified names
as in ``model.named_parameters()``). ``kind`` says which strategy family applies:

    input      a user input (placeholder); the batch is dim 0
    constant   depends on no input and no parameter (position ids, masks): replicated
    linear     x @ W^T (+ b), W a parameter (aten.linear / addmm / mm with a weight)
    matmul     activation @ activation (attention scores, bmm)
    attention  scaled_dot_product_attention(q, k, v)
    conv       convolution with a weight parameter
    embedding  table lookup, the table a parameter
    norm       layer/group/RMS norm over the trailing ``attrs['normalized_ndim']`` dims
    softmax    softmax / log_softmax over ``attrs['dim']``
    elementwise  pointwise, with broadcasting (unary, binary, activation, dropout)
    reduce     sum / mean over ``attrs['dims']``
    view       view / reshape / flatten / unflatten / split / getitem of a split
    permute    transpose / permute
    loss       a scalar loss (cross_entropy, mse_loss; ``attrs['reduction']``)
    output     the graph's result
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["KINDS", "ParamMeta", "OpNode", "OpGraph"]

KINDS = ("input", "constant", "linear", "matmul", "attention", "conv", "embedding", "norm", "softmax",
         "elementwise", "reduce", "view", "permute", "loss", "output")


@dataclass(frozen=True)
class ParamMeta:
    """A parameter the graph reads: its qualified name, global shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class OpNode:
    """One operator: ``name`` (the fx node's), ``kind`` (KINDS), ``target`` (the aten op,
    e.g. "aten.linear.default"), ``inputs`` (producer names of its tensor arguments),
    ``params`` (parameter names), ``shape``/``dtype``/``itemsize`` of its output, ``flops``
    of its forward, ``attrs`` (kind-specific, a tuple of (key, value) pairs), ``module``
    (the innermost nn.Module qualified name it ran in, "" at the top) and ``members``
    (the fx nodes it stands for, itself first)."""

    name: str
    kind: str
    target: str
    inputs: tuple[str, ...]
    params: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    flops: float = 0.0
    attrs: tuple[tuple[str, object], ...] = ()
    module: str = ""
    members: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"node {self.name!r}: kind {self.kind!r} must be one of {', '.join(KINDS)}")

    def attr(self, key: str, default=None):
        return dict(self.attrs).get(key, default)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class OpGraph:
    """Nodes in topological order, the parameters they read, and the names of the
    user inputs and of the output node."""

    nodes: tuple[OpNode, ...]
    params: tuple[ParamMeta, ...]
    inputs: tuple[str, ...]
    output: str
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({node.name: node for node in self.nodes})
        names = set(self._index)
        known_params = {param.name for param in self.params}
        for position, node in enumerate(self.nodes):
            earlier = {n.name for n in self.nodes[:position]}
            missing = [name for name in node.inputs if name not in earlier]
            if missing:
                raise ValueError(f"node {node.name!r} reads {missing} before they are made (or they are not nodes)")
            unknown = [name for name in node.params if name not in known_params]
            if unknown:
                raise ValueError(f"node {node.name!r} reads parameters {unknown} the graph does not list")
        if self.output not in names:
            raise ValueError(f"output {self.output!r} is not a node")

    def node(self, name: str) -> OpNode:
        return self._index[name]

    def param(self, name: str) -> ParamMeta:
        return next(param for param in self.params if param.name == name)

    def consumers(self, name: str) -> list[OpNode]:
        return [node for node in self.nodes if name in node.inputs]

    def edges(self) -> list[tuple[str, str, int]]:
        """(producer, consumer, argument position) of every tensor edge."""
        return [(source, node.name, position) for node in self.nodes for position, source in enumerate(node.inputs)]
