"""The auto plan in words and pictures: a table of the chosen sharding per operator
group, the predicted step time and memory, why (the other meshes, the baselines, each
group's runner-up), and the graph coloured by layout, as Graphviz DOT text and as an
SVG laid out here (graphviz need not be installed). Torch-free: it reads an AutoPlan.

The picture follows ``plait.graph.drawing``'s layout: a node's row is its depth (the
longest path from a graph input), the nodes of one row side by side in graph order,
each row centred, edges straight between adjacent rows and arcs bowing out to the right
of the boxes where they skip rows (a residual). A node's fill is its output layout's
colour (legend on top); an edge that reshards is red and labelled with its forward
collectives (``all_gather@1``: over mesh axis 1), the steps
``plait.plan.auto.reshard_cost.reshard_steps`` prices and the executor runs.
"""

from __future__ import annotations

import re
from html import escape

from plait.names.placements import layout_text
from plait.plan.auto.auto_plan import AutoPlan, name_pattern, operator_groups, TOP_GROUP

__all__ = ["plan_table", "collapse_repeats", "summary_lines", "why_lines", "stage_lines", "report_lines",
           "layout_colours", "node_rows", "plan_dot", "plan_svg", "HEAVY_KINDS"]

HEAVY_KINDS = ("linear", "matmul", "attention", "conv", "embedding")  # the operators a group's row names
# fills for output layouts, in order of first appearance (ColorBrewer Set3: black text reads on each)
PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5", "#d9d9d9",
           "#bc80bd", "#ccebc5", "#ffed6f")
RESHARD_COLOUR = "#cb181d"
PLAIN_EDGE_COLOUR = "#555555"
MIB = 1 << 20
# SVG geometry in pixels: a box, a row's height, a column's width, the margin, the legend's height
BOX_W, BOX_H, ROW_H, COL_W, MARGIN, LEGEND_H = 176, 44, 88, 196, 16, 30
SKIP_BULGE_PX = 28  # how far an edge that skips rows bows out to the right of the boxes
_LABEL_CHARS = 27


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"


def _mib(nbytes: float | None) -> str:
    """Bytes in the unit that reads best: B, KiB, MiB or GiB (3 significant digits)."""
    if nbytes is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _short_name(node, group: str) -> str:
    """A node's name in its group's row: its module relative to the group, else its own name."""
    if group != TOP_GROUP and node.module.startswith(group + "."):
        return node.module[len(group) + 1:]
    if group == TOP_GROUP and node.module:
        return node.module
    return node.name


def _group_rows(plan: AutoPlan) -> list[tuple[str, ...]]:
    """(group, chosen sharding, out, compute, comm, reshard, memory) per operator group."""
    graph = plan.graph
    reshard_into: dict[str, float] = {}
    for edge in plan.edges:
        reshard_into[edge.target] = reshard_into.get(edge.target, 0.0) + edge.time_s
    rows = []
    for group, names in operator_groups(graph):
        nodes = [graph.node(name) for name in names]
        heavy = ([node for node in nodes if node.kind in HEAVY_KINDS]
                 or [node for node in nodes if node.kind != "output"][-1:] or nodes[-1:])
        chosen = ", ".join(f"{_short_name(node, group)} {plan.choice[node.name].name}" for node in heavy)
        strategies = [plan.choice[name] for name in names]
        rows.append((group, chosen, layout_text(plan.choice[names[-1]].output),
                     _seconds(sum(s.compute_s for s in strategies)), _seconds(sum(s.comm_s for s in strategies)),
                     _seconds(sum(reshard_into.get(name, 0.0) for name in names)),
                     _mib(sum(s.memory_bytes for s in strategies))))
    return rows


def _signature(row: tuple[str, ...]) -> tuple[str, ...]:
    """A row with the numbers of its group's and nodes' names taken out (h.3.mlp ~ h.4.mlp,
    add_7 ~ add_11), the strategies kept whole (column@0 is not column@1)."""
    chosen = tuple(name_pattern(entry.partition(" ")[0]) + " " + entry.partition(" ")[2]
                   for entry in row[1].split(", "))  # "name strategy, ...": only the names lose numbers
    return (name_pattern(row[0]), chosen, *row[2:])


def _ranged(names: list[str]) -> str:
    """The names of one group across the repeats as one, the numbers that change as bash
    ranges: h.0.mlp .. h.11.mlp -> ``h.{0..11}.mlp``; every second one: ``{0..10..2}``."""
    parts = [re.split(r"(\d+)", name) for name in names]
    if len({len(part) for part in parts}) != 1:
        return names[0]
    out = []
    for index, values in enumerate(zip(*parts)):
        if index % 2 == 0 or len(set(values)) == 1:
            out.append(values[0])
            continue
        numbers = [int(value) for value in values]
        steps = {b - a for a, b in zip(numbers, numbers[1:])}
        if len(steps) != 1:
            out.append("{" + ",".join(values) + "}")
        else:
            step = steps.pop()
            out.append(f"{{{numbers[0]}..{numbers[-1]}{'' if step == 1 else f'..{step}'}}}")
    return "".join(out)


def collapse_repeats(rows: list[tuple[str, ...]], max_period: int = 12) -> list[tuple[str, ...]]:
    """Runs of k rows repeated r >= 2 times (identical up to the numbers in their names:
    a model's identical blocks) shown once, each group named with its number range and
    ``(xr)``; the costs are one repeat's. The longest run starting at a row wins."""
    signatures = [_signature(row) for row in rows]
    out, index = [], 0
    while index < len(rows):
        best_period, best_repeats = 1, 1
        for period in range(1, max_period + 1):
            repeats = 1
            while signatures[index + repeats * period: index + (repeats + 1) * period] == \
                    signatures[index: index + period] and index + (repeats + 1) * period <= len(rows):
                repeats += 1
            if repeats >= 2 and period * repeats > best_period * best_repeats:
                best_period, best_repeats = period, repeats
        if best_repeats == 1:
            out.append(rows[index])
            index += 1
            continue
        for offset in range(best_period):
            names = [rows[index + repeat * best_period + offset][0] for repeat in range(best_repeats)]
            out.append((f"{_ranged(names)} (x{best_repeats})", *rows[index + offset][1:]))
        index += best_repeats * best_period
    return out


def plan_table(plan: AutoPlan, *, collapse: bool = True) -> list[str]:
    """One row per operator group: its name, the chosen strategy of its heavy nodes (else
    of its last node before the graph's output), its output layout, and per device per
    step its compute, its own collectives, the reshards into it and its memory. With
    ``collapse``, repeated blocks are shown once (``collapse_repeats``)."""
    rows = _group_rows(plan)
    rows = [("group", "chosen sharding", "out", "compute", "comm", "reshard", "memory")] + (
        collapse_repeats(rows) if collapse else rows)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        cells = [row[i].ljust(widths[i]) if i < 3 else row[i].rjust(widths[i]) for i in range(len(row))]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return lines


def summary_lines(plan: AutoPlan) -> list[str]:
    """The mesh, the predicted step time split and memory, the solve on the chosen mesh."""
    cost = plan.cost
    limit = "" if plan.memory_limit_bytes is None else f" of {_mib(plan.memory_limit_bytes)} allowed"
    return [f"mesh {plan.mesh.text()} ({plan.mesh.size} devices)",
            f"predicted step {_seconds(cost.step_time_s)} per device: compute {_seconds(cost.compute_s)}, "
            f"collectives {_seconds(cost.comm_s)}, reshards {_seconds(cost.reshard_s)}",
            f"memory {_mib(cost.memory_bytes)} per device{limit}",
            f"solved in {_seconds(plan.solve_s)} ({plan.status}, gap {plan.gap:.2%}); all meshes "
            f"{_seconds(plan.total_solve_s)}; {len(plan.graph.nodes)} nodes"]


def _mesh_text(shape) -> str:
    return "x".join(map(str, shape))


def why_lines(plan: AutoPlan) -> list[str]:
    """The alternatives: every mesh's best plan, the baselines, each group's runner-up."""
    best = plan.cost.step_time_s
    lines = ["why: the best plan on each mesh"]
    for outcome in plan.meshes:
        mark = "  <- chosen" if outcome.mesh_shape == plan.mesh.shape else ""
        if outcome.cost is None:
            lines.append(f"  mesh {_mesh_text(outcome.mesh_shape):<7} no plan ({outcome.status})")
            continue
        lines.append(f"  mesh {_mesh_text(outcome.mesh_shape):<7} {_seconds(outcome.cost.step_time_s):>9} "
                     f"({outcome.cost.step_time_s / best:.2f}x), memory {_mib(outcome.cost.memory_bytes)}, solved in "
                     f"{_seconds(outcome.solve_s)}, gap {outcome.gap:.2%}{mark}")
    if plan.baselines:
        lines.append("baselines (the same cost model)")
        for baseline in plan.baselines:
            if baseline.cost is None:
                lines.append(f"  {baseline.name}: no plan ({baseline.description})")
                continue
            over = ("  [over the memory limit]" if plan.memory_limit_bytes is not None
                    and baseline.cost.memory_bytes > plan.memory_limit_bytes else "")
            lines.append(f"  {baseline.name:<15} {_seconds(baseline.cost.step_time_s):>9} "
                         f"({baseline.cost.step_time_s / best:.2f}x), memory {_mib(baseline.cost.memory_bytes)}, mesh "
                         f"{_mesh_text(baseline.mesh_shape)}: {baseline.description}{over}")
    if plan.runner_ups:
        lines.append("runner-up per group (the best plan without the group's choice)")
        for runner in plan.runner_ups:
            name = _short_name(plan.graph.node(runner.node), runner.group)
            if runner.runner_up is None:
                lines.append(f"  {runner.group}: {name} {runner.chosen}; no other strategy fits ({runner.method})")
                continue
            alike = f"; {runner.alike} more group(s) alike" if runner.alike else ""
            lines.append(f"  {runner.group}: {name} {runner.chosen}; next {runner.runner_up} "
                         f"+{_seconds(runner.delta_s)} ({runner.method}{alike})")
    return lines


def stage_lines(plan: AutoPlan) -> list[str]:
    """The inter-operator plan (Alpa's stages on sub-meshes), when one was searched: its
    own section, apart from the intra-operator plan whose layouts are executed."""
    search = plan.stages
    if search is None:
        return []
    lines = ["inter-operator plan (Alpa's stage / sub-mesh pass over the ILP's per-stage optima; not in the "
             "executed layouts)"]
    lines += [f"  {line}" for line in search.describe().splitlines()]
    lines.append(f"  pipelined {_seconds(search.latency_s)} per step ({search.microbatches} micro-batches) vs "
                 f"{_seconds(plan.step_time_s)} for the intra-operator plan above "
                 f"({search.latency_s / plan.step_time_s:.2f}x); layers per stage "
                 f"{','.join(map(str, search.stage_layers))}")
    return lines


def report_lines(plan: AutoPlan) -> list[str]:
    """Everything ``plait plan --auto`` prints: model, cluster, summary, table, why (and stages)."""
    lines = [f"model: {plan.model_description}", f"cluster: {plan.cluster_description}"]
    lines += summary_lines(plan) + [""] + plan_table(plan) + [""] + why_lines(plan)
    stages = stage_lines(plan)
    return lines + ([""] + stages if stages else [])


# ----- pictures ----------------------------------------------------------------------------
def layout_colours(plan: AutoPlan) -> dict[str, str]:
    """Output layout text -> fill colour, in order of first appearance (the palette cycles)."""
    colours: dict[str, str] = {}
    for node in plan.graph.nodes:
        text = layout_text(plan.choice[node.name].output)
        if text not in colours:
            colours[text] = PALETTE[len(colours) % len(PALETTE)]
    return colours


def node_rows(plan: AutoPlan) -> dict[str, tuple[int, int]]:
    """(row, column) of every node: row = longest path from an input, column = order in its row."""
    rows: dict[str, int] = {}
    for node in plan.graph.nodes:  # topological order
        rows[node.name] = 1 + max((rows[source] for source in node.inputs), default=-1)
    positions, used = {}, {}
    for node in plan.graph.nodes:
        row = rows[node.name]
        positions[node.name] = (row, used.get(row, 0))
        used[row] = used.get(row, 0) + 1
    return positions


def _node_label(plan: AutoPlan, name: str) -> tuple[str, str, str]:
    node, strategy = plan.graph.node(name), plan.choice[name]
    merged = f" +{len(node.members) - 1}" if len(node.members) > 1 else ""
    return (name[:_LABEL_CHARS], f"{node.kind}{merged}: {strategy.name}"[:_LABEL_CHARS],
            f"out {layout_text(strategy.output)}"[:_LABEL_CHARS])


def plan_dot(plan: AutoPlan) -> str:
    """Graphviz DOT text of the graph (``dot -Tsvg``), nodes filled by output layout,
    resharding edges red and labelled with their collectives."""
    colours = layout_colours(plan)
    lines = ["digraph auto_plan {", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontsize=10];',
             f'  label="mesh {plan.mesh.text()}: predicted step {_seconds(plan.cost.step_time_s)}"; labelloc=t;']
    for node in plan.graph.nodes:
        label = "\\n".join(part.replace('"', "'") for part in _node_label(plan, node.name))
        fill = colours[layout_text(plan.choice[node.name].output)]
        lines.append(f'  "{node.name}" [label="{label}", fillcolor="{fill}"];')
    for edge in plan.edges:
        if edge.collectives:
            lines.append(f'  "{edge.source}" -> "{edge.target}" [color="{RESHARD_COLOUR}", fontcolor='
                         f'"{RESHARD_COLOUR}", label="{" + ".join(edge.collectives)}"];')
        else:
            lines.append(f'  "{edge.source}" -> "{edge.target}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def plan_svg(plan: AutoPlan) -> str:
    """An SVG picture of the graph laid out here (see the module doc)."""
    positions = node_rows(plan)
    widths: dict[int, int] = {}
    for row, column in positions.values():
        widths[row] = max(widths.get(row, 0), column + 1)
    widest = max(widths.values(), default=1)
    row_count = 1 + max((row for row, _ in positions.values()), default=0)
    colours = layout_colours(plan)
    width_px = max(2 * MARGIN + widest * COL_W + SKIP_BULGE_PX, 2 * MARGIN + 150 * (len(colours) + 1))  # + arcs
    height_px = 2 * MARGIN + LEGEND_H + row_count * ROW_H

    def centre(name: str) -> tuple[float, float]:
        row, column = positions[name]
        x = MARGIN + (column + (widest - widths[row]) / 2) * COL_W + COL_W / 2
        return x, MARGIN + LEGEND_H + row * ROW_H + BOX_H / 2 + 8

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width_px:.0f}" height="{height_px:.0f}" '
           f'viewBox="0 0 {width_px:.0f} {height_px:.0f}" font-family="sans-serif" font-size="11">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="context-stroke"/></marker></defs>',
           f'<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{MARGIN}" y="{MARGIN + 10}" font-weight="bold">{escape(_title(plan))}</text>']
    x = MARGIN
    for text, fill in colours.items():  # the legend: output layout -> colour
        out.append(f'<rect x="{x}" y="{MARGIN + 16}" width="14" height="12" fill="{fill}" stroke="#333"/>'
                   f'<text x="{x + 18}" y="{MARGIN + 26}">out {escape(text)}</text>')
        x += 150
    out.append(f'<line x1="{x}" y1="{MARGIN + 22}" x2="{x + 20}" y2="{MARGIN + 22}" stroke="{RESHARD_COLOUR}" '
               f'stroke-width="1.5"/><text x="{x + 24}" y="{MARGIN + 26}">reshard</text>')
    for edge in plan.edges:
        (x0, y0), (x1, y1) = centre(edge.source), centre(edge.target)
        colour = RESHARD_COLOUR if edge.collectives else PLAIN_EDGE_COLOUR
        if positions[edge.target][0] - positions[edge.source][0] > 1:
            # skips rows (a residual): from the right side of one box to the right side of the
            # other, bulging right (a quadratic curve reaches half its control point's offset)
            x0, x1 = x0 + BOX_W / 2, x1 + BOX_W / 2
            cx, cy = max(x0, x1) + SKIP_BULGE_PX * 2, (y0 + y1) / 2
        else:  # adjacent rows: bottom centre to top centre
            y0, y1 = y0 + BOX_H / 2, y1 - BOX_H / 2
            cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        out.append(f'<path d="M {x0:.1f} {y0:.1f} Q {cx:.1f} {cy:.1f} {x1:.1f} {y1:.1f}" fill="none" '
                   f'stroke="{colour}" stroke-width="{1.5 if edge.collectives else 0.8}" marker-end="url(#arrow)"/>')
        if edge.collectives:
            lx, ly = (x0 + 2 * cx + x1) / 4, (y0 + 2 * cy + y1) / 4  # the curve's midpoint
            out.append(f'<text x="{lx + 4:.1f}" y="{ly:.1f}" fill="{RESHARD_COLOUR}" font-size="9">'
                       f'{escape(" + ".join(edge.collectives))}</text>')
    for node in plan.graph.nodes:
        cx, cy = centre(node.name)
        fill = colours[layout_text(plan.choice[node.name].output)]
        out.append(f'<g><title>{escape(_node_title(plan, node.name))}</title>'
                   f'<rect x="{cx - BOX_W / 2:.1f}" y="{cy - BOX_H / 2:.1f}" width="{BOX_W}" height="{BOX_H}" rx="6" '
                   f'fill="{fill}" stroke="#333" stroke-width="0.8"/>')
        for index, line in enumerate(_node_label(plan, node.name)):
            weight = ' font-weight="bold"' if index == 0 else ""
            out.append(f'<text x="{cx:.1f}" y="{cy - 9 + 13 * index:.1f}" text-anchor="middle"{weight}>'
                       f'{escape(line)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _title(plan: AutoPlan) -> str:
    return (f"auto plan on mesh {plan.mesh.text()}: predicted step {_seconds(plan.cost.step_time_s)}, "
            f"memory {_mib(plan.cost.memory_bytes)} per device")


def _node_title(plan: AutoPlan, name: str) -> str:
    """The hover text: the whole node (module, members, every layout, costs)."""
    node, strategy = plan.graph.node(name), plan.choice[name]
    inputs = "; ".join(layout_text(layout) for layout in strategy.inputs)
    params = "; ".join(f"{param} {layout_text(layout)}" for param, layout in strategy.params)
    return (f"{name} ({node.kind}, module {node.module or '-'}, members {', '.join(node.members or (name,))}): "
            f"{strategy.name}, inputs {inputs or '-'}, params {params or '-'}, compute {_seconds(strategy.compute_s)}, "
            f"comm {_seconds(strategy.comm_s)}")
