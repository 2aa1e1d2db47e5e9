"""Draw a torch.fx graph as a PNG with matplotlib (no graphviz): one labelled box per node.

Layout: a node's row is its depth, the length of the longest path from any graph input
to it (so every edge points downwards), and the nodes of one row sit side by side in
graph order. Edges are straight lines between adjacent rows and arcs where they skip
rows (a residual connection), so they do not run through the boxes in between. Box
colours say what a node is: graph input/output, module call, function or method call,
constant (get_attr).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch
from torch import fx

COLOURS = {"placeholder": "#9ecae1", "output": "#9ecae1", "call_module": "#fdd0a2",
           "call_function": "#c7e9c0", "call_method": "#dadaeb", "get_attr": "#f0f0f0"}
ROW_HEIGHT_IN = 0.42  # figure inches per row
COLUMN_WIDTH_IN = 2.3  # figure inches per node of the widest row
MAX_LABEL_CHARS = 26


def node_label(gm: fx.GraphModule, node: fx.Node) -> str:
    """Two lines: the node's name, then what it computes (module class, function or method)."""
    if node.op == "call_module":
        what = type(gm.get_submodule(node.target)).__name__
    elif node.op == "call_function":
        what = getattr(node.target, "__name__", str(node.target))
    elif node.op == "call_method":
        what = f".{node.target}()"
    elif node.op == "get_attr":
        what = f"get_attr {node.target}"
    else:
        what = node.op
    name = str(node.target) if node.op == "call_module" else node.name
    return f"{name[:MAX_LABEL_CHARS]}\n{what[:MAX_LABEL_CHARS]}"


def layout(graph: fx.Graph) -> dict[fx.Node, tuple[int, int]]:
    """(row, column) of every node: row = longest path from an input, column = order in its row."""
    rows: dict[fx.Node, int] = {}
    for node in graph.nodes:  # fx keeps nodes in topological order
        rows[node] = 1 + max((rows[parent] for parent in node.all_input_nodes), default=-1)
    positions, used = {}, {}
    for node in graph.nodes:
        row = rows[node]
        positions[node] = (row, used.get(row, 0))
        used[row] = used.get(row, 0) + 1
    return positions


def draw_graph(gm: fx.GraphModule, path: str | Path, title: str = "") -> Path:
    """Write ``gm``'s graph as a PNG at ``path`` (parent directories created); returns the path."""
    positions = layout(gm.graph)
    row_count = 1 + max((row for row, _ in positions.values()), default=0)
    widths = {}
    for row, column in positions.values():
        widths[row] = max(widths.get(row, 0), column + 1)
    widest = max(widths.values(), default=1)
    figure = Figure(figsize=(max(4.0, COLUMN_WIDTH_IN * widest), max(2.0, ROW_HEIGHT_IN * row_count + 0.8)))
    FigureCanvasAgg(figure)
    axes = figure.add_axes((0.01, 0.01, 0.98, 0.96 if title else 0.98))
    axes.set_xlim(-0.5, widest - 0.5)
    axes.set_ylim(row_count - 0.5, -0.5)  # row 0 at the top
    axes.axis("off")
    if title:
        figure.suptitle(title, fontsize=10)

    def centre(node: fx.Node) -> tuple[float, float]:
        row, column = positions[node]
        return column + (widest - widths[row]) / 2, row  # each row centred

    for node in gm.graph.nodes:
        for parent in node.all_input_nodes:
            (x0, y0), (x1, y1) = centre(parent), centre(node)
            skip = y1 - y0 > 1
            axes.add_patch(FancyArrowPatch((x0, y0 + 0.2), (x1, y1 - 0.2), arrowstyle="-|>", mutation_scale=8,
                                           linewidth=0.7, color="#555555", zorder=1,
                                           connectionstyle=f"arc3,rad={0.35 if skip else 0.0}"))
    for node in gm.graph.nodes:
        x, y = centre(node)
        axes.text(x, y, node_label(gm, node), ha="center", va="center", fontsize=6, zorder=2,
                  bbox={"boxstyle": "round,pad=0.25", "facecolor": COLOURS.get(node.op, "white"),
                        "edgecolor": "#333333", "linewidth": 0.6})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
