"""Run an auto-parallel plan for real: every operator of a traced training step on this
rank's local shards, with plait's collectives at the layout changes, exact (the loss
and every gradient equal one process's, up to the order of float sums).

    from plait.parallel.auto.execute import NodeLayout, auto_parallelize
    model = auto_parallelize(model, (x, y), layouts, AutoMesh((2,)))   # every rank
    loss = model(x, y)            # the global batch on every rank; the loss replicated
    loss.backward(); optimizer.step()                                  # any torch optimizer
    full = model.full_state_dict()                                     # collective

A ``NodeLayout`` per OpNode name gives the layout each input must arrive in, the
output's, and each parameter's. Before a node runs, each input is resharded from its
producer's output layout to the one the node wants (``plait.parallel.auto.reshard``:
all-reduce, reduce-scatter, all-gather, slice, all-to-all, each with its backward
dual); on every mesh axis on which the node splits its work (an input, a parameter
or the output is not R there), its R inputs and parameters are wrapped in an identity
whose backward all-reduces over that axis (so a parameter under batch sharding gets
data parallelism's all-reduce, the input of a column-parallel linear Megatron's f),
except R summands of a P output (a row-parallel bias, an R addend), which coordinate
0 alone adds. A parameter that every reading node reads at its stored layout and
wraps on the same axes (data parallelism's weights) is not wrapped per node: its
gradient goes into a flat bucket (``grad_buckets``: DDP's 25 MiB buckets, launched
in order while backward goes on, all-reduced once per axis, added into ``.grad`` at
the end of backward), so a data-parallel step runs a few large all-reduces. The
layouts are checked before anything runs: a (kind, layouts) pair
that does not run exactly is refused by name (execute_rules, execute_views).

Each parameter is held as this rank's shard of its STORED layout (the first reading
node's) as a real nn.Parameter under the model's own qualified name; other readers
get it resharded. ``comm_stats()``: what plait's communicators of the mesh axes moved
(bytes_sent per collective, counted at the transport's call), for comparing with the
planner's prediction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.comm.communicator import group_ranks, process_group
from plait.comm.engine import merge_stats
from plait.names.placements import PARTIAL, REPLICATE, local_shape, replicated
from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.execute_fused import blocked_shard, find_fused, unblock
from plait.parallel.auto.execute_node import NodeContext, run_members
from plait.parallel.auto.execute_rules import ADDITIVE, LayoutRefused, expected_output
from plait.parallel.auto.execute_views import check_view, shard_for
from plait.parallel.auto.grad_buckets import DEFAULT_BUCKET_CAP_BYTES, GradBuckets
from plait.parallel.auto.node_layout import NodeLayout
from plait.parallel.auto.reshard import (AxisComm, partial_from_replicated, reshard_step, wrap_replicated,
                                         wrap_replicated_many)
from plait.parallel.auto.reshard_steps import reshard_steps
from plait.parallel.auto.trace import simplify as simplify_graph
from plait.parallel.auto.trace import trace_graph

__all__ = ["NodeLayout", "AutoParallelModule", "auto_parallelize", "mesh_axis_groups"]


def mesh_axis_groups(mesh: AutoMesh, group=None) -> list:
    """This rank's process group along each axis of ``mesh``, laid row-major over the
    ranks of ``group`` (None: the world) in group-rank order. Collective over
    ``group``: every member calls it with the same mesh. With group=None every rank of
    the world creates every line's group (torch's rule); a 1-D mesh over a given group
    is that group; a 2-D mesh over a given group creates its lines with
    ``use_local_synchronization`` (only members call; torch names those groups by their
    ranks), so a caller mixing that with world-wide new_group calls should rather make
    the lines itself on every rank and pass ``axis_groups=``."""
    pg = process_group(group)
    ranks = group_ranks(dist.group.WORLD if pg is None else pg)
    if len(ranks) != mesh.size:
        raise ValueError(f"mesh {mesh.text()} has {mesh.size} ranks but the group has {len(ranks)}: give a mesh whose "
                         f"shape multiplies to {len(ranks)}, or a group of {mesh.size} ranks")
    if pg is not None and mesh.ndim == 1:
        return [group]  # the group is the one axis: nothing to create
    me = ranks.index(dist.get_rank())
    local = AutoMesh(mesh.shape)
    mine = []
    for axis in range(mesh.ndim):
        lines = sorted({tuple(local.axis_group(index, axis)) for index in range(mesh.size)})
        chosen = None
        for line in lines:
            members = [ranks[index] for index in line]
            if pg is None:  # torch requires every rank of the world to create every group
                made = dist.new_group(members)
            elif me in line:
                made = dist.new_group(members, use_local_synchronization=True)
            else:
                continue
            if me in line:
                chosen = made
        mine.append(chosen)
    return mine


def _check_layouts(graph, layouts: dict, mesh: AutoMesh) -> dict:
    if not isinstance(layouts, dict):
        raise TypeError(f"layouts must be a dict of OpNode name -> NodeLayout, got {type(layouts).__name__}")
    unknown = sorted(set(layouts) - {node.name for node in graph.nodes})
    if unknown:
        raise ValueError(f"layouts name nodes the graph does not have: {unknown[:5]} (names come from the traced "
                         "graph, simplified as the planner sees it)")
    missing = [node.name for node in graph.nodes if node.name not in layouts and node.kind != "output"]
    if missing:
        raise ValueError(f"no NodeLayout for nodes {missing[:8]}{' ...' if len(missing) > 8 else ''}: give one for "
                         "every node (NodeLayout.replicated(node, mesh.ndim) runs a node whole)")
    for name, layout in layouts.items():
        node = graph.node(name)
        if not isinstance(layout, NodeLayout):
            raise TypeError(f"layouts[{name!r}] must be a NodeLayout, got {type(layout).__name__}")
        layout.check(node, mesh.ndim)
    return layouts


class AutoParallelModule(nn.Module):
    """A traced training step run on this rank's shards of ``layouts`` (see the module
    docstring). ``traced``: plait.parallel.auto.trace's TracedGraph (its ``graph`` may
    be simplified); ``mesh``: an AutoMesh over the ranks of ``group`` (None: the world;
    all of them call this); ``axis_groups``: this rank's group per mesh axis, when the
    caller made them; ``reshard_path(src, dst, shape, itemsize)``: the layouts a
    reshard goes through (the planner's cheapest path), default reshard_steps'.
    ``bucket_cap_mb``: the size cap of the gradient buckets (DDP's, 25 MiB) of the
    parameters every reader splits its work over alike (grad_buckets)."""

    def __init__(self, traced, layouts: dict, mesh: AutoMesh, *, group=None, axis_groups=None, reshard_path=None,
                 algorithm: str = "auto", graph=None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_BYTES / 2**20):
        super().__init__()
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or \
                not 0 < bucket_cap_mb < float("inf"):
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a finite number of MiB > 0 (DDP's is 25)")
        if not isinstance(mesh, AutoMesh):
            raise TypeError(f"mesh must be a plait.parallel.auto.AutoMesh, got {type(mesh).__name__}")
        graph = traced.graph if graph is None else graph
        random_ops = [name for name in getattr(traced, "random_ops", ()) if name in _all_members(graph)]
        if random_ops:
            raise ValueError(f"the traced step draws random numbers ({random_ops[:3]}: dropout p > 0 or rand*), which "
                             "sharded ranks would draw differently: set dropout to 0 (or eval()) before tracing")
        self._graph, self._mesh = graph, mesh
        self._layouts = _check_layouts(graph, layouts, mesh)
        self._gm = (traced.module,)  # not a submodule: its parameters are the model's whole ones
        self._fx = {fx_node.name: fx_node for fx_node in traced.module.graph.nodes}
        self._order = {name: index for index, name in enumerate(self._fx)}
        self._members = {node.name: sorted(node.members or (node.name,), key=self._order.__getitem__)
                         for node in graph.nodes}
        self._value = {name: members[-1] for name, members in self._members.items()}
        self._stored = self._stored_layouts()
        self._fused = find_fused(graph, self._layouts, mesh.shape)
        self._check_nodes()  # before any group is made: a refused plan fails alike on every rank, with no traffic
        groups = mesh_axis_groups(mesh, group) if axis_groups is None else list(axis_groups)
        if len(groups) != mesh.ndim:
            raise ValueError(f"axis_groups has {len(groups)} groups for a {mesh.ndim}-axis mesh")
        coords = []
        for axis, axis_group in enumerate(groups):
            size = dist.get_world_size(process_group(axis_group) or dist.group.WORLD)
            if size != mesh.shape[axis]:
                raise ValueError(f"axis_groups[{axis}] has {size} ranks; mesh axis {axis} has {mesh.shape[axis]}")
            coords.append(dist.get_rank(process_group(axis_group) or dist.group.WORLD))
        self._coords = tuple(coords)
        self._axes = [AxisComm(g, mesh.shape[a], self._coords[a], algorithm) for a, g in enumerate(groups)]
        self._reshard_path = reshard_path
        self._hold_shards(traced.module)
        self._bucketed = self._bucketed_axes()
        entries = [(name, self.get_parameter(name), axes) for name, axes in reversed(self._bucketed.items())]
        self._buckets = GradBuckets(entries, self._axes, cap_bytes=max(1, int(bucket_cap_mb * 2**20)))

    # ----- construction ----------------------------------------------------------------------
    def _stored_layouts(self) -> dict[str, tuple]:
        stored = {}
        for node in self._graph.nodes:
            for name, layout in self._layouts.get(node.name, NodeLayout((), (), ())).params:
                stored.setdefault(name, layout)
        bad = {name: layout for name, layout in stored.items() if PARTIAL in layout}
        if bad:
            raise ValueError(f"parameters {sorted(bad)} are first read as a partial sum {list(bad.values())[0]}: a "
                             "parameter is stored replicated or sharded")
        return stored

    def _input_shapes(self, node) -> list[tuple]:
        return [tuple(self._graph.node(p).shape) for p in node.inputs]

    def _positions(self, node) -> dict[str, int]:
        positions = {}
        for index, producer in enumerate(node.inputs):
            positions.setdefault(self._value[producer], index)
        return positions

    def _check_nodes(self) -> None:
        mesh_shape = self._mesh.shape
        for node in self._graph.nodes:
            if node.kind in ("output", "input", "constant"):
                continue
            layout = self._layouts[node.name]
            shapes = self._input_shapes(node)
            for shape, placements in zip(shapes, layout.inputs):
                local_shape(shape, placements, mesh_shape)
            local_shape(node.shape, layout.output, mesh_shape)
            if node.name in self._fused.slices:
                continue  # a fused slice of a blocked shard: find_fused checked it
            if node.kind in ("view", "permute"):
                check_view(node, layout, shapes, self._fx, self._order, mesh_shape, self._positions(node))
                continue
            params = dict(layout.params)
            param_shapes = [self._graph.param(name).shape for name in params]
            for axis in range(self._mesh.ndim):
                got = expected_output(node, axis, [inp[axis] for inp in layout.inputs], shapes,
                                      {name: p[axis] for name, p in params.items()}, param_shapes)
                if got != layout.output[axis]:
                    raise LayoutRefused(f"node {node.name!r} ({node.kind}, {node.target}) on mesh axis {axis}: inputs "
                                        f"{[inp[axis] for inp in layout.inputs]} and params "
                                        f"{ {n: p[axis] for n, p in params.items()} } give output {got}, not the "
                                        f"{layout.output[axis]} the layout says")

    def _hold_shards(self, module) -> None:
        """Each parameter's shard of its stored layout as an nn.Parameter at the model's
        qualified name; buffers whole."""
        whole_params = dict(module.named_parameters(remove_duplicate=False))
        canonical = {id(whole_params[name]): name for name in self._stored if name in whole_params}
        self._aliases = {alias: canonical[id(param)] for alias, param in whole_params.items()
                         if alias not in self._stored and id(param) in canonical}  # tied: lm_head -> wte
        for name, layout in self._stored.items():
            whole = whole_params[name] if name in whole_params else module.get_parameter(name)
            shard = self.reference_shard(whole.detach(), name).clone()
            self._register(name, nn.Parameter(shard, requires_grad=whole.requires_grad))
        for name, buffer in module.named_buffers():
            self._register(name, buffer, buffer=True)

    def _splits(self, layout) -> list[bool]:
        """Per mesh axis: does the node split its work there (an input, a parameter or
        the output is not R)?"""
        return [any(p[axis] != REPLICATE for p in (*layout.inputs, layout.output, *(l for _, l in layout.params)))
                for axis in range(self._mesh.ndim)]

    def _bucketed_axes(self) -> dict[str, tuple[int, ...]]:
        """The parameters whose gradient all-reduce is bucketed (grad_buckets), with the
        mesh axes it runs over, in first-reading order: every node reading the parameter
        reads it at its stored layout and wraps it on the same (non-empty) set of axes of
        more than one rank. The others keep the per-node wrap (_wrap_params)."""
        readers: dict[str, set] = {}
        for node in self._graph.nodes:
            layout = self._layouts.get(node.name)
            if layout is None or node.kind in ("output", "input", "constant"):
                continue
            splits = self._splits(layout)
            additive = node.kind == "elementwise" and node.attr("op") in ADDITIVE
            bias = node.attr("bias") if node.kind in ("linear", "conv") else None
            for name, wanted in layout.params:
                summand = additive or name == bias
                axes = tuple(axis for axis in range(self._mesh.ndim)
                             if splits[axis] and wanted[axis] == REPLICATE and self._axes[axis].size > 1
                             and not (summand and layout.output[axis] == PARTIAL))
                same = tuple(wanted) == tuple(self._stored[name])
                readers.setdefault(name, set()).add(axes if same else None)
        bucketed = {}
        for name in self._stored:
            param = self.get_parameter(name)
            (axes, *others) = readers.get(name, {None})
            if not others and axes and param.requires_grad and torch.is_floating_point(param):
                bucketed[name] = axes
        return bucketed

    def _register(self, name: str, value, buffer: bool = False) -> None:
        *path, leaf = name.split(".")
        owner = self
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        if buffer:
            owner.register_buffer(leaf, value)
        else:
            owner.register_parameter(leaf, value)

    # ----- running ---------------------------------------------------------------------------
    def _path(self, src, dst, shape, itemsize):
        if self._reshard_path is None:
            return reshard_steps(src, dst)
        layouts = [tuple(layout) for layout in self._reshard_path(tuple(src), tuple(dst), tuple(shape), itemsize)]
        steps = []
        for before, after in zip(layouts, layouts[1:]):
            steps += [(axis, a, b) for axis, (a, b) in enumerate(zip(before, after)) if a != b]
        return steps

    def _reshard(self, tensor, src, dst, shape):
        if tuple(src) == tuple(dst):
            return tensor
        for axis, before, after in self._path(src, dst, shape, tensor.element_size()):
            tensor = reshard_step(tensor, self._axes[axis], before, after)
        return tensor

    def _prepare(self, tensor, wanted, node, layout, splits, summand: bool, skip_wrap: bool = False):
        """Wrap an R input on every axis where the node splits its work; an R summand
        of a P output becomes P (coordinate 0 keeps it) instead. ``skip_wrap``: the
        caller wraps it (a node's parameters together, one all-reduce)."""
        if not torch.is_floating_point(tensor):
            return tensor
        for axis, placement in enumerate(wanted):
            if placement != REPLICATE or not splits[axis]:
                continue
            if summand and layout.output[axis] == PARTIAL:
                tensor = partial_from_replicated(tensor, self._axes[axis])
            elif not skip_wrap:
                tensor = wrap_replicated(tensor, self._axes[axis])
        return tensor

    def _wrap_params(self, params: dict, layout, splits, summands: set) -> dict:
        """The node's R parameters wrapped per axis where it splits its work, all of one
        axis in one backward all-reduce (the summands of a P output are not wrapped)."""
        wanted = dict(layout.params)
        for axis in range(self._mesh.ndim):
            if not splits[axis]:
                continue
            names = [name for name, tensor in params.items() if wanted[name][axis] == REPLICATE
                     and torch.is_floating_point(tensor) and name not in self._bucketed
                     and not (name in summands and layout.output[axis] == PARTIAL)]
            for name, tensor in zip(names, wrap_replicated_many([params[name] for name in names], self._axes[axis])):
                params[name] = tensor
        return params

    def _run_node(self, node, values, user_inputs, wholes):
        layout = self._layouts.get(node.name)
        if node.kind == "input":
            index = node.attr("index", self._graph.inputs.index(node.name))
            return self._reshard(user_inputs[index], replicated(self._mesh.ndim), layout.output, node.shape)
        if node.kind == "constant":  # whole, from whole constants (a constant reads no input, no parameter)
            ctx = NodeContext(node, layout, self._fx, self._order, self._coords, self._mesh.shape, self._axes)
            earlier = {self._value[p]: wholes[p] for p in node.inputs}
            whole = run_members(ctx, lambda fx: earlier[fx.name] if fx.name in earlier else self._buffer_lookup(fx),
                                whole=True)
            wholes[node.name] = whole
            return self._reshard(whole.detach(), replicated(self._mesh.ndim), layout.output, node.shape)
        splits = self._splits(layout)
        additive = node.kind == "elementwise" and node.attr("op") in ADDITIVE
        shapes = self._input_shapes(node)
        inputs = []
        for producer, wanted, shape in zip(node.inputs, layout.inputs, shapes):
            tensor, have = values[producer]
            tensor = self._reshard(tensor, have, wanted, shape)
            inputs.append(self._prepare(tensor, wanted, node, layout, splits, summand=additive))
        bias = node.attr("bias") if node.kind in ("linear", "conv") else None
        params, summands = {}, set()
        for name, wanted in layout.params:
            tensor = self._reshard(self.get_parameter(name), self._stored[name], wanted, self._graph.param(name).shape)
            if additive or name == bias:
                summands.add(name)
            params[name] = self._prepare(tensor, wanted, node, layout, splits, summand=name in summands,
                                         skip_wrap=True)
        params = self._wrap_params(params, layout, splits, summands)
        ctx = NodeContext(node, layout, self._fx, self._order, self._coords, self._mesh.shape, self._axes,
                          inputs=inputs, input_shapes=shapes, params=params,
                          fused_divisor=self._fused.divisor(node.name), members=self._members[node.name])
        positions = self._positions(node)

        def lookup(fx_node):
            if fx_node.name in positions:
                return inputs[positions[fx_node.name]]
            if fx_node.op == "get_attr":
                return params[fx_node.target] if fx_node.target in params else self._buffer_lookup(fx_node)
            raise KeyError(f"node {node.name!r}: member input {fx_node.name} is neither a node's value nor a "
                           "parameter (the traced graph and its OpGraph disagree)")

        out = run_members(ctx, lookup)
        want = local_shape(node.shape, layout.output, self._mesh.shape)
        if tuple(out.shape) != want:
            raise LayoutRefused(f"node {node.name!r} ({node.kind}, {node.target}) gave a local {tuple(out.shape)}, "
                                f"not the {want} its output layout {layout.output} says")
        return out

    def _buffer_lookup(self, fx_node):
        if fx_node.op != "get_attr":
            raise KeyError(f"a constant reads {fx_node.name}, which is not a buffer or constant attribute")
        try:
            return self.get_buffer(fx_node.target)
        except AttributeError:
            return getattr(self._gm[0], fx_node.target) if hasattr(self._gm[0], fx_node.target) else \
                self._gm[0].get_submodule("").__getattr__(fx_node.target)

    def forward(self, *inputs):
        """The training step on the GLOBAL inputs (every rank passes the same); returns
        the output replicated (the loss, the same on every rank)."""
        if len(inputs) != len(self._graph.inputs):
            raise TypeError(f"the traced step takes {len(self._graph.inputs)} inputs, got {len(inputs)}")
        self._buckets.check_idle()
        values: dict[str, tuple] = {}
        wholes: dict[str, torch.Tensor] = {}  # constants' whole values
        for node in self._graph.nodes:
            if node.kind == "output":
                tensor, have = values[node.inputs[0]]
                out = self._reshard(tensor, have, replicated(self._mesh.ndim), self._graph.node(node.inputs[0]).shape)
                return self._buckets.mark(out)
            values[node.name] = (self._run_node(node, values, inputs, wholes), self._layouts[node.name].output)
        raise ValueError("the traced graph has no output node")

    # ----- inspection ------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (gathered from its shards) and every buffer, under the
        model's names (a tied parameter under each of its names, as the model's
        state_dict has it). Collective: every rank of the mesh calls it."""
        full = {}
        with torch.no_grad():
            for name, tensor in self.named_parameters(remove_duplicate=False):
                layout = self._stored[name]
                full[name] = self._reshard(tensor.detach(), layout, replicated(self._mesh.ndim),
                                           self._graph.param(name).shape).clone()
                if name in self._fused.params:  # gathered in rank order: put each part's blocks back together
                    dim, blocked = self._fused.params[name]
                    (axis, parts), = blocked.items()
                    full[name] = unblock(full[name], dim, parts, self._mesh.shape[axis])
            for name, buffer in self.named_buffers():
                full[name] = buffer.detach().clone()
        for alias, name in self._aliases.items():
            full[alias] = full[name]
        return full

    def stored_layout(self, name: str) -> tuple:
        """The layout parameter ``name``'s shard on this rank is of."""
        return self._stored[name]

    def reference_shard(self, whole: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's shard of ``whole`` (a full tensor shaped like parameter ``name``,
        e.g. a one-process gradient) under the parameter's stored layout: what its
        local shard or local gradient must equal. No communication."""
        if name in self._fused.params:
            dim, blocked = self._fused.params[name]
            (axis, parts), = blocked.items()
            return blocked_shard(whole, dim, parts, self._mesh.shape[axis], self._coords[axis])
        return shard_for(whole, self._stored[name], self._coords, self._mesh.shape)

    def gradient_buckets(self) -> list[tuple[tuple[str, ...], tuple[int, ...], int]]:
        """(parameter names, mesh axes, bytes) of each gradient bucket in launch order:
        each is all-reduced once per axis per backward (grad_buckets)."""
        return self._buckets.describe()

    def comm_stats(self) -> dict[str, dict]:
        """plait comm's counters over this rank's mesh-axis communicators: per collective
        calls, bytes_sent (what this rank handed to its transport), messages, time_s."""
        return merge_stats(comm.stats(axis.group) for axis in self._axes if axis.size > 1)

    def reset_comm_stats(self) -> None:
        for axis in self._axes:
            if axis.size > 1:
                comm.reset_stats(axis.group)


def _all_members(graph) -> set[str]:
    return {member for node in graph.nodes for member in (node.members or (node.name,))}


def auto_parallelize(model: nn.Module, example_inputs, layouts: dict, mesh: AutoMesh, *, group=None,
                     simplify: bool = True, **options) -> AutoParallelModule:
    """Trace ``model`` (whose forward returns the loss) on ``example_inputs`` with
    plait.parallel.auto.trace, simplify the graph as the planner does, and run it under
    ``layouts`` on ``mesh`` (see AutoParallelModule)."""
    traced = trace_graph(model, tuple(example_inputs))
    graph = simplify_graph(traced.graph) if simplify else traced.graph
    return AutoParallelModule(traced, layouts, mesh, group=group, graph=graph, **options)

