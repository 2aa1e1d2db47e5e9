"""Alpa's graph simplification: fewer nodes for the sharding ILP, same program.

``simplify(graph)`` merges

- every shape-preserving elementwise node whose tensor inputs all come from one merged
  node (a unary op, or an op whose other operands are Python scalars or the chain's own
  values: GPT-2's new-GELU ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``, dropout,
  casts, copies) and that reads no parameter, into that producer (the "head"); the
  merged node keeps the head's name, kind, inputs, params, attrs and FLOPs (the
  members' FLOPs go to ``attrs['member_flops']``), takes the value's dtype, and lists
  ``members`` = (head's members..., merged fx nodes in graph order);
- every constant whose consumers are all constants of one group into that group (the
  group named after its latest member, whose value it is).

A group's value must be its last member: a member whose value is read outside the
group while a later member exists undoes the joins after it (the merge is retried with
those node -> head joins banned; the undone nodes may head groups of their own), so a residual ``x + f(x)`` where ``x`` feeds another branch keeps ``x``
as its own node. Binary elementwise ops over two different nodes (residual adds) stay
nodes. ``attrs['merged_ops']`` names the merged ops and ``attrs['partial_ok']`` says
whether the chain is linear in its input (only scaling by scalars, negation, copies,
casts and dropout), i.e. whether the head may still output a partial sum ("P"): a
strategy with a P output on a node whose ``partial_ok`` is False is wrong, since
gelu(a) + gelu(b) != gelu(a + b).
"""

from __future__ import annotations

from dataclasses import replace

from plait.parallel.auto.opgraph import OpGraph, OpNode

__all__ = ["simplify", "LINEAR_IN_VALUE"]

# elementwise ops f with f(a + b) = f(a) + f(b) when their other operands are scalars
LINEAR_IN_VALUE = frozenset({"mul", "div", "neg", "dropout", "clone", "contiguous", "alias", "detach", "to",
                             "_to_copy", "lift_fresh_copy", "positive"})
NO_HEAD = frozenset({"input", "output", "constant"})


def simplify(graph: OpGraph) -> OpGraph:
    """The merged graph (module docstring); node order stays topological."""
    banned: set[str] = set()
    while True:
        head_of, bad = _merge(graph, banned)
        if not bad:
            break
        banned |= bad
    head_of.update(_constant_groups(graph))
    groups: dict[str, list[OpNode]] = {}
    for node in graph.nodes:
        groups.setdefault(head_of.get(node.name, node.name), []).append(node)
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    merged = []
    for node in graph.nodes:
        members = groups.get(node.name)
        if members is None or head_of.get(node.name, node.name) != node.name:
            continue
        if len(members) == 1:
            new = node
        elif node.kind == "constant":
            new = _constant(members, head_of, position)
        else:
            new = _chain(members, head_of)
        merged.append(replace(new, inputs=tuple(head_of.get(name, name) for name in new.inputs)))
    return OpGraph(nodes=tuple(merged), params=graph.params, inputs=graph.inputs, output=graph.output)


def _merge(graph: OpGraph, banned: set) -> tuple[dict, set]:
    """{merged node: head} for the elementwise chains, and the (node, head) joins to ban
    when a group's value is not its last member."""
    head_of: dict[str, str] = {}
    shape_of = {node.name: node.shape for node in graph.nodes}
    kind_of = {node.name: node.kind for node in graph.nodes}
    for node in graph.nodes:
        if node.kind != "elementwise" or node.params or not node.inputs:
            continue
        heads = {head_of.get(name, name) for name in node.inputs}
        if len(heads) != 1:
            continue
        head = heads.pop()
        if kind_of[head] in NO_HEAD or shape_of[head] != node.shape or (node.name, head) in banned:
            continue
        head_of[node.name] = head
    members: dict[str, list[str]] = {}
    for node in graph.nodes:
        head = head_of.get(node.name, node.name)
        members.setdefault(head, []).append(node.name)
    bad = set()
    consumers = _consumers(graph)
    for node in graph.nodes:
        group = head_of.get(node.name, node.name)
        for consumer in consumers[node.name]:
            if head_of.get(consumer.name, consumer.name) == group or node.name == members[group][-1]:
                continue
            # node's value escapes before the group's end: ban the members after it
            after = members[group][members[group].index(node.name) + 1:]
            bad.update((name, group) for name in after)
    return head_of, bad


def _constant_groups(graph: OpGraph) -> dict[str, str]:
    """{constant: the constant group it joins} for constants read only by constants of one group."""
    group_of: dict[str, str] = {}
    readers = _consumers(graph)
    for node in reversed(graph.nodes):
        if node.kind != "constant":
            continue
        consumers = readers[node.name]
        targets = {group_of.get(c.name, c.name) for c in consumers}
        if consumers and all(c.kind == "constant" for c in consumers) and len(targets) == 1:
            group_of[node.name] = targets.pop()
    return group_of


def _consumers(graph: OpGraph) -> dict[str, list[OpNode]]:
    readers: dict[str, list[OpNode]] = {node.name: [] for node in graph.nodes}
    for node in graph.nodes:
        for name in dict.fromkeys(node.inputs):
            readers[name].append(node)
    return readers


def _chain(members: list[OpNode], head_of: dict) -> OpNode:
    head, rest = members[0], members[1:]
    ops = tuple(str(node.attr("op", node.target)) for node in rest)
    attrs = dict(head.attrs)
    linear = all(op in LINEAR_IN_VALUE and len(node.inputs) == 1 and node.attr("partial_ok", True)
                 for op, node in zip(ops, rest))
    # a node merged before (simplify run twice) brings its own merged ops along
    merged_ops = head.attr("merged_ops", ()) + tuple(
        op for own, node in zip(ops, rest) for op in (own, *node.attr("merged_ops", ())))
    attrs.update(merged_ops=merged_ops, partial_ok=linear and head.attr("partial_ok", True),
                 member_flops=head.attr("member_flops", 0.0) + sum(
                     node.flops + node.attr("member_flops", 0.0) for node in rest))
    names = list(head.members) + [name for node in rest for name in node.members]
    value = rest[-1]
    return replace(head, dtype=value.dtype, itemsize=value.itemsize, attrs=tuple(attrs.items()),
                   members=tuple(names))


def _constant(members: list[OpNode], head_of: dict, position: dict) -> OpNode:
    value = max(members, key=lambda node: position[node.name])
    outside = tuple(dict.fromkeys(name for node in members for name in node.inputs
                                  if head_of.get(name, name) != head_of.get(value.name, value.name)))
    names = [value.name] + sorted((name for node in members for name in node.members if name != value.name),
                                  key=lambda name: position.get(name, -1))
    return replace(value, inputs=outside, members=tuple(names))
