"""An auto plan as a ``parallelize`` plan: the ILP's per-operator choice on a 1-D mesh
compiled into module styles (plait.parallel.tensor), when every choice is one a style
makes; otherwise None and the first operator no style expresses (the executor then
runs the fx graph with plait's collectives at the reshards).

A style replaces a whole module and fixes what crosses its boundary (on the p ranks
of the mesh's one axis, "S(-1)" the last dim sharded):

    style                      weight        enters          leaves
    ColwiseParallel()          out features  R               S(-1)
    ColwiseParallel(gather)    out features  R               R      (all-gather inside)
    ColwiseParallel(fused=k)   out features  R               S(-1), then split in k equal parts
    RowwiseParallel()          in features   S(-1)           R      (all-reduce inside: P -> R)
    RowwiseParallel(input_is_parallel=False)  R (sliced)     R
    VocabParallel()            vocab rows    R (ids)         R      (all-reduce inside: P -> R)

Everything else runs the model's own code on whatever reaches it: so an operator
outside a styled module must need no collective of its own (``comm_s == 0``: no
data-parallel gradient sum, no Megatron f-identity on a replicated operand), hold no
partial sum, keep its parameters replicated, and every edge outside the styled
modules' boundaries must carry no reshard. Tied parameters keep one layout. These are
the conditions under which the styled model computes, rank by rank, exactly the
shards the chosen strategies say (the executor's gradient convention included: a
column-parallel module all-reduces its input gradient, a row-parallel one's bias is
added once after the sum).

Attention code that reads head counts (HF GPT2Attention's ``split_size``) learns its
local sizes from an adapter (plait.parallel.tensor.plans): ``adapter_for(model)``
finds the ready one of the model or of a submodule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.names.placements import PARTIAL, REPLICATE, layout_text, shard_dim
from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.opgraph import OpGraph, OpNode
from plait.parallel.tensor.convert import linear_sizes
from plait.parallel.tensor.plan import ParallelPlan, check_plan, match_plan
from plait.parallel.tensor.plans import plan_for
from plait.parallel.tensor.styles import COLWISE, ROWWISE, VOCAB, ColwiseParallel, RowwiseParallel, VocabParallel

__all__ = ["StyleCompilation", "compile_styles", "adapter_for", "effective_styles"]


@dataclass(frozen=True)
class StyleCompilation:
    """``plan`` (a ParallelPlan with one entry per sharded module, exact names) or None;
    ``reason`` says why not, naming ``node``, the first operator no style expresses."""

    plan: ParallelPlan | None
    reason: str | None = None
    node: str | None = None
    styles: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.plan is not None


class _Refused(Exception):
    def __init__(self, node: str, reason: str):
        super().__init__(reason)
        self.node, self.reason = node, reason


def _inside(node: OpNode, module: str) -> bool:
    return bool(module) and (node.module == module or node.module.startswith(module + "."))


def _sharded_param(strategy, name: str) -> bool:
    return any(placement != REPLICATE for placement in strategy.param_layout(name))


def _linear_dims(node: OpNode) -> tuple[int, int]:
    """(out-features dim, in-features dim) of the weight: the tracer's ``weight_out_dim``
    (0: torch's (out, in); 1: (in, out), HF Conv1D's addmm)."""
    out_dim = node.attr("weight_out_dim")
    if out_dim is None:
        out_dim = 0 if "linear" in node.target else 1
    return int(out_dim), 1 - int(out_dim)


def _module_kind(node: OpNode, strategy, graph: OpGraph) -> str | None:
    """The style a linear or embedding node's choice is (None: all replicated), or
    _Refused naming what no style does."""
    weight = node.attr("weight") or (node.params[0] if node.params else None)
    if weight is None or not _sharded_param(strategy, weight):
        if any(_sharded_param(strategy, name) for name in node.params):
            raise _Refused(node.name, f"node {node.name!r} ({node.kind} in {node.module!r}) shards a bias but not "
                                      f"its weight (strategy {strategy.name!r}): no style does")
        return None
    (placement,) = strategy.param_layout(weight)
    dim = shard_dim(placement)
    if node.kind == "embedding":
        if dim == 0 and strategy.output == (PARTIAL,):
            return VOCAB
        raise _Refused(node.name, f"node {node.name!r} (embedding in {node.module!r}) splits its table as "
                                  f"{placement} with output {layout_text(strategy.output)}: only VocabParallel "
                                  "(rows S0, partial output) is a style")
    out_dim, in_dim = _linear_dims(node)
    last = len(node.shape) - 1
    bias = node.attr("bias") if node.attr("weight") else (node.params[1] if len(node.params) > 1 else None)
    if dim == out_dim and strategy.output == (f"S{last}",) and (
            bias is None or strategy.param_layout(bias) == ("S0",)):
        return COLWISE
    if dim == in_dim and strategy.output == (PARTIAL,) and (
            bias is None or strategy.param_layout(bias) == (REPLICATE,)):
        return ROWWISE
    raise _Refused(node.name, f"node {node.name!r} (linear in {node.module!r}) chose {strategy.name!r} (weight "
                              f"{placement}, output {layout_text(strategy.output)}): neither column-parallel "
                              "(weight by out features, output S(-1)) nor row-parallel (weight by in features, "
                              "output partial) is what it does")


def _styled_modules(graph: OpGraph, choice: dict) -> dict[str, tuple[str, OpNode]]:
    """module name -> (style kind, its sharded node), from every linear/embedding whose
    weight is sharded; refuses a module holding two such nodes or none of its own."""
    modules: dict[str, tuple[str, OpNode]] = {}
    for node in graph.nodes:
        if node.kind not in ("linear", "embedding"):
            continue
        kind = _module_kind(node, choice[node.name], graph)
        if kind is None:
            continue
        if not node.module:
            raise _Refused(node.name, f"node {node.name!r} ({node.kind}) runs in the model's own forward, not in a "
                                      "submodule: a style shards a whole module")
        if node.module in modules:
            first = modules[node.module][1].name
            raise _Refused(node.name, f"module {node.module!r} runs two sharded operators ({first!r} and "
                                      f"{node.name!r}): a style shards a module of one linear or embedding")
        owner = next((module for module in modules if _inside(node, module)), None)
        if owner is not None:
            raise _Refused(node.name, f"node {node.name!r} runs inside styled module {owner!r}")
        modules[node.module] = (kind, node)
    return modules


def _boundary(graph: OpGraph, module: str):
    """(entering edges, leaving edges) of ``module``: (producer, consumer, position)."""
    entering, leaving = [], []
    for source, target, position in graph.edges():
        inside_source, inside_target = _inside(graph.node(source), module), _inside(graph.node(target), module)
        if inside_target and not inside_source:
            entering.append((source, target, position))
        elif inside_source and not inside_target:
            leaving.append((source, target, position))
    return entering, leaving


def _fused_parts(graph: OpGraph, leaving, last: int, width: int):
    """The parts when the edges leaving a column module all go into slices of its last
    dim that tile it (``width`` wide; HF's fused q|k|v split into getitems, which the
    tracer writes as slices): rank r then keeps its 1/p of each part,
    ColwiseParallel(fused=k) for k equal parts, else the part sizes. None: not so read."""
    readers = [graph.node(target) for _, target, _ in leaving]
    if any(reader.kind != "view" or reader.attr("op") != "slice" or tuple(reader.attr("sliced_dims", ())) != (last,)
           or reader.attr("start") is None or reader.attr("step", 1) != 1 for reader in readers):
        return None
    pieces = sorted({(int(reader.attr("start")), int(reader.shape[last])) for reader in readers})
    ends = [start + size for start, size in pieces]
    if len(pieces) < 2 or pieces[0][0] != 0 or ends[-1] != width or any(
            start != end for (start, _), end in zip(pieces[1:], ends)):
        return None
    sizes = [size for _, size in pieces]
    return len(sizes) if len(set(sizes)) == 1 else tuple(sizes)


def _style(graph: OpGraph, choice: dict, module: str, kind: str, node: OpNode):
    """The style of one module from the layouts on its boundary (see the table above)."""
    entering, leaving = _boundary(graph, module)
    sources = {choice[source].output for source, _, _ in entering if graph.node(source).kind != "constant"}
    arrivals = {choice[target].inputs[position] for _, target, position in leaving}
    where = f"module {module!r} ({kind}, node {node.name!r})"
    if not leaving:
        raise _Refused(node.name, f"{where}: nothing reads its output")
    if kind == VOCAB:
        if sources - {(REPLICATE,)} or arrivals != {(REPLICATE,)}:
            raise _Refused(node.name, f"{where}: VocabParallel takes replicated ids and all-reduces; the plan "
                                      f"feeds {sorted(map(layout_text, sources))} and reads "
                                      f"{sorted(map(layout_text, arrivals))}")
        return VocabParallel()
    last_in = len(graph.node(entering[0][0]).shape) - 1 if entering else 0
    last_out = len(graph.node(leaving[0][0]).shape) - 1
    if kind == COLWISE:
        if sources != {(REPLICATE,)}:
            raise _Refused(node.name, f"{where}: a column-parallel module takes its input replicated, the plan gives "
                                      f"{sorted(map(layout_text, sources))}")
        if arrivals == {(REPLICATE,)}:
            return ColwiseParallel(gather_output=True)
        if arrivals == {(f"S{last_out}",)}:
            width = graph.node(leaving[0][0]).shape[-1]
            return ColwiseParallel(fused=_fused_parts(graph, leaving, last_out, width))
        raise _Refused(node.name, f"{where}: its output is read as {sorted(map(layout_text, arrivals))}; a "
                                  f"column-parallel module gives S{last_out} (or R, gathered) to every reader")
    if arrivals != {(REPLICATE,)}:
        raise _Refused(node.name, f"{where}: a row-parallel module all-reduces its output (P -> R); the plan reads "
                                  f"it as {sorted(map(layout_text, arrivals))}")
    if sources == {(f"S{last_in}",)}:
        return RowwiseParallel()
    if sources == {(REPLICATE,)}:
        return RowwiseParallel(input_is_parallel=False)
    raise _Refused(node.name, f"{where}: a row-parallel module takes S{last_in} (or R, sliced), the plan gives "
                              f"{sorted(map(layout_text, sources))}")


def _check_followers(graph: OpGraph, choice: dict, modules: dict) -> None:
    """Every node outside the styled modules runs the model's own code on what reaches
    it: no collective of its own, no partial sums, replicated parameters, and no
    reshard on an edge that is not a styled module's boundary."""
    layouts = {}
    for node in graph.nodes:
        strategy = choice[node.name]
        owner = next((module for module in modules if _inside(node, module)), None)
        for name in node.params:
            layout = strategy.param_layout(name)
            if layouts.setdefault(name, (node.name, layout))[1] != layout:
                first, seen = layouts[name]
                raise _Refused(node.name, f"parameter {name!r} is {layout_text(seen)} in {first!r} but "
                                          f"{layout_text(layout)} in {node.name!r}: a style plan keeps one layout per "
                                          "parameter (tied weights: shard both readers alike)")
        if owner is not None:
            continue
        if node.kind == "input" and strategy.output != (REPLICATE,):
            raise _Refused(node.name, f"input {node.name!r} arrives {layout_text(strategy.output)}: a tensor-parallel "
                                      "plan gives every rank the whole batch (batch sharding is data parallelism)")
        if strategy.comm_s > 0:
            raise _Refused(node.name, f"node {node.name!r} ({node.kind}) chose {strategy.name!r}, which needs a "
                                      f"collective of its own ({strategy.comm_s:.3g} s): no style makes it")
        if PARTIAL in strategy.output or any(PARTIAL in layout for layout in strategy.inputs):
            raise _Refused(node.name, f"node {node.name!r} ({node.kind}) chose {strategy.name!r}, which keeps a "
                                      "partial sum outside a row-parallel module")
        sharded = [name for name in node.params if _sharded_param(strategy, name)]
        if sharded:
            raise _Refused(node.name, f"node {node.name!r} ({node.kind}) shards parameter {sharded[0]!r}: only "
                                      "linears and embeddings have styles")
        for position, source in enumerate(node.inputs):
            if any(_inside(graph.node(source), module) for module in modules):
                continue  # a module's boundary: _style checked it
            src, dst = choice[source].output, strategy.inputs[position]
            if src != dst:
                raise _Refused(node.name, f"edge {source!r} -> {node.name!r} reshards {layout_text(src)} -> "
                                          f"{layout_text(dst)}, which no module style does")


def compile_styles(graph: OpGraph, choice: dict, mesh: AutoMesh, *, model=None, adapter=None) -> StyleCompilation:
    """The ``parallelize`` plan that runs ``choice`` (node name -> Strategy, the ILP's)
    on a 1-D ``mesh``, or why none does (see the module docstring). With ``model`` (the
    traced nn.Module) the plan is also checked as ``parallelize`` would check it
    (module types, divisibility, ties, the adapter); ``adapter`` None takes
    ``adapter_for(model)``."""
    if mesh.ndim != 1:
        raise ValueError(f"compile_styles: a parallelize plan splits over one tensor-parallel axis; the mesh is "
                         f"{mesh.text()} (2-D plans run on the fx executor)")
    missing = [node.name for node in graph.nodes if node.kind != "output" and node.name not in choice]
    if missing:
        raise ValueError(f"compile_styles: no strategy chosen for nodes {missing[:4]}: pass the ILP's whole choice")
    try:
        modules = _styled_modules(graph, choice)
        styles = {module: _style(graph, choice, module, kind, node) for module, (kind, node) in modules.items()}
        _check_followers(graph, choice, modules)
    except _Refused as refused:
        return StyleCompilation(plan=None, reason=refused.reason, node=refused.node)
    if model is not None and adapter is None:
        adapter = adapter_for(model)
    plan = ParallelPlan(styles=styles, adapter=adapter)
    if model is not None:
        try:
            check_plan(model, plan, mesh.size)
        except (TypeError, ValueError) as error:
            node = next((node.name for module, (_, node) in modules.items() if module in str(error)), None)
            return StyleCompilation(plan=None, reason=f"parallelize refuses the compiled plan: {error}", node=node,
                                    styles=styles)
    return StyleCompilation(plan=plan, styles=styles)


class _NestedAdapter:
    """A ready plan's adapter for the submodule ``prefix`` of the traced model (a loss
    wrapper around an HF model): it sees that submodule and its styles' names."""

    def __init__(self, prefix: str, adapter):
        self.prefix, self.adapter, self.name = prefix, adapter, f"{adapter.name} at {prefix!r}"

    def _local(self, styles: dict) -> dict:
        head = self.prefix + "."
        return {name[len(head):]: style for name, style in styles.items() if name.startswith(head)}

    def check(self, model, styles: dict, tp_size: int) -> None:
        self.adapter.check(model.get_submodule(self.prefix), self._local(styles), tp_size)

    def localize(self, model, tp) -> None:
        self.adapter.localize(model.get_submodule(self.prefix), tp)

    def claimed_parameters(self, model) -> set[str]:
        claimed = getattr(self.adapter, "claimed_parameters", None)
        inner = set() if claimed is None else claimed(model.get_submodule(self.prefix))
        return {f"{self.prefix}.{name}" for name in inner}


def adapter_for(model):
    """The adapter of the ready plan (plait.parallel.tensor.plans.plan_for) of ``model``
    or, for a wrapper, of its first submodule that has one; None when none has."""
    for name, module in model.named_modules():
        try:
            adapter = plan_for(module).adapter
        except TypeError:
            continue
        if adapter is None:
            return None
        return adapter if not name else _NestedAdapter(name, adapter)
    return None


def _normal(style, out_features: int | None, tp_size: int):
    """What a sharding style does at sequence_parallel=False, written one way: fused as
    part sizes, pad only where tp does not divide, head_dim (a check) and a replicated
    input_layout (the default) dropped."""
    if style.kind != COLWISE:
        return RowwiseParallel(input_is_parallel=style.input_is_parallel) if style.kind == ROWWISE else VocabParallel()
    parts = style.parts(out_features) if out_features is not None else style.fused
    pad = style.pad and out_features is not None and out_features % tp_size != 0
    return ColwiseParallel(gather_output=style.gather_output, fused=parts, pad=pad)


def effective_styles(model, plan, tp_size: int) -> dict:
    """module name -> the sharding style ``plan`` gives it on ``model`` at ``tp_size``,
    normalised (see _normal): two plans are equivalent when these are equal. Replicate
    and SequenceParallel entries are dropped (no-ops without sequence parallelism)."""
    plan = plan if isinstance(plan, ParallelPlan) else ParallelPlan(styles=plan)
    out = {}
    for name, module, style in match_plan(model, plan.styles):
        if style.kind not in (COLWISE, ROWWISE, VOCAB):
            continue
        out_features = linear_sizes(module)[1] if style.kind == COLWISE else None
        out[name] = _normal(style, out_features, tp_size)
    return out
