"""A model's OpGraph cut into layers, and the sub-graph of a slice of layers: what the
inter-operator search (``plait.plan.auto.stages``) prices on each sub-mesh.

Layers (Alpa §5.2 runs its DP over layers, not operators): the blocks of the model's
biggest repeated container, found from ``OpNode.module`` alone (a module path
``P.<i>...`` puts a node in block i of container P; the container whose blocks read
the most parameter bytes wins, as ``plait.plan.tp_trace.layer_modules`` picks the
ModuleList holding the most parameters; an nn.Sequential's children are container
""; without any, the model's top-level children), with what runs before the first
block as the first layer and what runs after the last as the last layer. Glue
between two blocks (a node of no block) joins the block before it. Every layer is a contiguous run of the graph's topological order, so
a slice of layers [i, j) is a contiguous run too.

A slice's sub-graph keeps its nodes (names unchanged) and turns every tensor it reads
from an earlier layer into an ``input`` node of the same name, shape and dtype (a
``constant`` one when its producer is a constant): the stage receives it from its
predecessor (batch dim 0 as for the model's inputs). Its output is the graph's output
when the slice holds it, else its last node (what the later stages read is sent as
it is laid out: ``boundary_bytes`` prices that message).

``slice_signature`` names a slice up to renaming: two slices of identical blocks (same
kinds, shapes, FLOPs, parameter shapes, edges and which nodes carry a gradient) have
the same signature, so the search prices one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from plait.parallel.auto.opgraph import OpGraph, OpNode

__all__ = ["Layer", "graph_layers", "slice_graph", "slice_signature", "boundary_bytes", "FIRST_LAYER", "LAST_LAYER"]

FIRST_LAYER, LAST_LAYER = "<first>", "<last>"  # what runs before the first block and after the last


@dataclass(frozen=True)
class Layer:
    """One layer: ``name`` ("<first>", "blocks.3", "<last>") and its node names, in order."""

    name: str
    nodes: tuple[str, ...]


def _block_of(module: str) -> list[tuple[str, int]]:
    """Every (container, index) a module path lies in: "a.blocks.3.mlp" -> [("a.blocks", 3)]."""
    parts = module.split(".") if module else []
    return [(".".join(parts[:k]), int(part)) for k, part in enumerate(parts) if part.isdigit()]


def _container(graph: OpGraph) -> str | None:
    """The repeated container whose blocks read the most parameter bytes (ties: the
    outermost), or None when no module path lies in an indexed container."""
    blocks: dict[str, set[int]] = {}
    params: dict[str, set[str]] = {}
    for node in graph.nodes:
        for container, index in _block_of(node.module):
            blocks.setdefault(container, set()).add(index)
            params.setdefault(container, set()).update(node.params)
    if not blocks:
        return None
    weight = {name: sum(graph.param(param).nbytes for param in params[name]) for name in blocks}
    return max(blocks, key=lambda name: (weight[name], len(blocks[name]), -name.count("."), -len(name)))


def _keys(graph: OpGraph) -> tuple[list, Callable]:
    """Per node its block (None: outside every block) and the layer name of a block: the
    container's index, or without a container the model's top-level child."""
    container = _container(graph)
    if container is None:
        return [node.module.split(".")[0] or None for node in graph.nodes], str
    keys = [next((i for name, i in _block_of(node.module) if name == container), None) for node in graph.nodes]
    return keys, (lambda key: f"{container}.{key}" if container else str(key))


def graph_layers(graph: OpGraph) -> list[Layer]:
    """The layers of ``graph`` (module docstring), in execution order. Without an indexed
    container the model's top-level children are the blocks; one layer holding every
    node when no node runs in a module."""
    keys, name_of = _keys(graph)
    positions = [position for position, key in enumerate(keys) if key is not None]
    if not positions:
        return [Layer("<all>", tuple(node.name for node in graph.nodes))]
    first, last = positions[0], positions[-1]
    order: list = []  # blocks in the order they first run
    assigned: list[str] = []
    current = None
    for position, key in enumerate(keys):
        if position < first:
            assigned.append(FIRST_LAYER)
            continue
        if position > last:
            assigned.append(LAST_LAYER)
            continue
        if key is not None and key not in order:
            order.append(key)
        if key is not None and (current is None or order.index(key) > order.index(current)):
            current = key  # a node of an earlier block met again (re-used module) stays in the later layer
        assigned.append(name_of(current))
    layers: list[Layer] = []
    for node, name in zip(graph.nodes, assigned):
        if layers and layers[-1].name == name:
            layers[-1] = Layer(name, layers[-1].nodes + (node.name,))
        else:
            layers.append(Layer(name, (node.name,)))
    return layers


def _slice_nodes(graph: OpGraph, layers: list[Layer], start: int, end: int) -> list[OpNode]:
    if not 0 <= start < end <= len(layers):
        raise ValueError(f"slice [{start}, {end}) is not a non-empty range of the {len(layers)} layers")
    return [graph.node(name) for layer in layers[start:end] for name in layer.nodes]


def slice_graph(graph: OpGraph, layers: list[Layer], start: int, end: int) -> OpGraph:
    """The sub-graph of layers ``start`` .. ``end - 1`` (module docstring)."""
    nodes = _slice_nodes(graph, layers, start, end)
    inside = {node.name for node in nodes}
    received: dict[str, OpNode] = {}
    for node in nodes:
        for name in node.inputs:
            if name not in inside and name not in received:
                producer = graph.node(name)
                received[name] = OpNode(name=name, kind="constant" if producer.kind == "constant" else "input",
                                        target="stage_input", inputs=(), params=(), shape=producer.shape,
                                        dtype=producer.dtype, itemsize=producer.itemsize, module=producer.module)
    used = {param for node in nodes for param in node.params}
    output = graph.output if graph.output in inside else nodes[-1].name
    return OpGraph(nodes=tuple(received.values()) + tuple(nodes),
                   params=tuple(param for param in graph.params if param.name in used), inputs=tuple(received),
                   output=output)


def _canonical(value, names: dict[str, object]):
    """``value`` with every node or parameter name replaced by its canonical stand-in."""
    if isinstance(value, str):
        return names.get(value, value)
    if isinstance(value, (tuple, list)):
        return tuple(_canonical(item, names) for item in value)
    return value


def slice_signature(graph: OpGraph, layers: list[Layer], start: int, end: int, grads: frozenset) -> tuple:
    """What the slice's price depends on, with names replaced by first-use indices
    (module docstring); ``grads``: the names of the nodes carrying a gradient in the
    whole graph (``plait.plan.auto.strategies.grad_nodes``)."""
    nodes = _slice_nodes(graph, layers, start, end)
    names: dict[str, object] = {}  # node and parameter names -> stand-ins
    param_names: dict[str, object] = {}  # attrs name parameters only ("op": "add" is no node)
    entries = []
    for node in nodes:
        for name in node.inputs:
            if name not in names:
                producer = graph.node(name)
                names[name] = ("received", len(names), producer.kind == "constant", producer.shape, producer.dtype,
                               name in grads)
        for param in node.params:
            if param not in names:
                meta = graph.param(param)
                names[param] = param_names[param] = ("param", len(names), meta.shape, meta.dtype)
        entries.append((node.kind, node.target, node.shape, node.dtype, node.flops, node.name in grads,
                        _canonical(node.inputs, names), _canonical(node.params, names),
                        _canonical(tuple((key, value) for key, value in node.attrs), param_names)))
        names[node.name] = ("node", len(names))
    return tuple(entries) + (graph.output in {node.name for node in nodes},)


def boundary_bytes(graph: OpGraph, layers: list[Layer], cut: int, grads: frozenset) -> tuple[int, int]:
    """(forward, backward) bytes crossing the cut before layer ``cut``: the distinct
    tensors made in layers < cut and read in layers >= cut, and of those the ones that
    carry a gradient (sent back in the backward)."""
    before = {name for layer in layers[:cut] for name in layer.nodes}
    crossing = {name for layer in layers[cut:] for node_name in layer.nodes
                for name in graph.node(node_name).inputs if name in before}
    forward = sum(graph.node(name).nbytes for name in crossing)
    return forward, sum(graph.node(name).nbytes for name in crossing if name in grads)
