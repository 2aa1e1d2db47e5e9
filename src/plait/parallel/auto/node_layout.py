"""What an auto-parallel plan says about one node: the layout each input must arrive
in, the layout of its output and of each parameter it reads (torch-free, so plan files
and the planner share it with the executor)."""

from __future__ import annotations

from dataclasses import dataclass

from plait.names.placements import check_placement, replicated

__all__ = ["NodeLayout"]


@dataclass(frozen=True)
class NodeLayout:
    """``inputs``: one Layout per ``OpNode.inputs`` entry; ``output``: the node's output
    Layout; ``params``: ((qualified parameter name, Layout), ...). A Layout is a tuple
    of placements ("R", "P", "S<d>"), one per mesh axis."""

    inputs: tuple
    output: tuple
    params: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(tuple(layout) for layout in self.inputs))
        object.__setattr__(self, "output", tuple(self.output))
        object.__setattr__(self, "params", tuple((name, tuple(layout)) for name, layout in self.params))

    @classmethod
    def replicated(cls, node, mesh_ndim: int) -> "NodeLayout":
        """Every input, the output and every parameter replicated: the node runs whole on every rank."""
        whole = replicated(mesh_ndim)
        return cls(inputs=tuple(whole for _ in node.inputs), output=whole,
                   params=tuple((name, whole) for name in node.params))

    def check(self, node, mesh_ndim: int) -> None:
        """ValueError naming what does not fit ``node`` on a ``mesh_ndim``-axis mesh."""
        where = f"NodeLayout of {node.name!r} ({node.kind})"
        if len(self.inputs) != len(node.inputs):
            raise ValueError(f"{where} gives {len(self.inputs)} input layouts for its {len(node.inputs)} inputs "
                             f"{list(node.inputs)}")
        names = [name for name, _ in self.params]
        if sorted(names) != sorted(node.params):
            raise ValueError(f"{where} lays out parameters {names}, but the node reads {list(node.params)}")
        for layout in (*self.inputs, self.output, *(layout for _, layout in self.params)):
            if len(layout) != mesh_ndim:
                raise ValueError(f"{where}: layout {layout!r} needs one placement per mesh axis ({mesh_ndim})")
            for placement in layout:
                check_placement(placement)
