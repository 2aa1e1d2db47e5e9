"""What a tensor-parallel plan says, read for the planner without loading plait.parallel.

A plan maps module names (``"h.*.mlp.c_fc"``: fnmatch on dotted names, ``*`` one
component) to styles: ``plait.parallel.tensor``'s ColwiseParallel, RowwiseParallel,
VocabParallel, SequenceParallel, Replicate (or a ``ParallelPlan`` holding them), or
their ``.kind`` strings "colwise", "rowwise", "vocab", "sequence", "replicate". The
styles are read by duck typing (``.kind``, ``gather_output``, ``input_layout``,
``output_layout``, ``entry``, ``exit``, ``fused``, ``pad``), so plait.plan never imports
plait.parallel (and with it the distributed runtime).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping

__all__ = ["KINDS", "SHARDED_KINDS", "style_kind", "style_flags", "match_plan", "sharded_dims"]

KINDS = ("colwise", "rowwise", "vocab", "sequence", "replicate")
SHARDED_KINDS = ("colwise", "rowwise", "vocab")


def style_kind(style) -> str:
    """A style's kind: the string itself, or ``style.kind`` (plait.parallel.tensor's styles)."""
    kind = style if isinstance(style, str) else getattr(style, "kind", None)
    if kind not in KINDS:
        raise TypeError(f"plan style {style!r} is not one of {', '.join(KINDS)} (or a ColwiseParallel(), ... "
                        "from plait.parallel.tensor, whose .kind is one of them)")
    return kind


def style_flags(style) -> frozenset:
    """What a style does beyond its kind, as the pricing needs it: "gather" (a colwise
    output all-gathered), "input_replicated" (a colwise input not sequence-sharded under
    sequence parallelism), "output_replicated" (a rowwise output all-reduced even then),
    "output_sequence" (a vocab output reduce-scattered), "entry" / "exit" (a sequence
    module that splits its input / gathers its output). A kind string: its defaults."""
    # the layout names are plait.parallel.tensor.layout's; a style object means that module is
    # loaded (plait.plan never imports plait.parallel: it would load the distributed runtime)
    layout = sys.modules.get("plait.parallel.tensor.layout")
    replicated, sharded = (layout.REPLICATED, layout.SEQUENCE_SHARDED) if layout else (None, None)
    given_in, given_out = getattr(style, "input_layout", None), getattr(style, "output_layout", None)
    flags = {"gather": getattr(style, "gather_output", False) is True,
             "input_replicated": replicated is not None and given_in == replicated,
             "output_replicated": replicated is not None and given_out == replicated and style_kind(style) == "rowwise",
             "output_sequence": sharded is not None and given_out == sharded,
             "entry": getattr(style, "entry", False) is True, "exit": getattr(style, "exit", False) is True}
    return frozenset(name for name, on in flags.items() if on)


def _pattern(entry: str):
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", entry)) + "$")


def match_plan(model, plan) -> dict[str, tuple[str, object]]:
    """{module name: (kind, style)} for every module ``plan`` names; an entry matching
    no module, a module matched twice, or a sharded kind on a module without a 2-D
    weight is refused by name."""
    plan = getattr(plan, "styles", plan)  # plait.parallel.tensor's ParallelPlan: its styles by name
    if not isinstance(plan, Mapping) or not all(isinstance(key, str) for key in plan):
        raise TypeError(f"plan must be a dict of module-name patterns to styles (or a ParallelPlan), got "
                        f"{type(plan).__name__}")
    names = [name for name, _ in model.named_modules() if name]
    matched: dict[str, tuple[str, object]] = {}
    for entry, style in plan.items():
        kind = style_kind(style)
        hits = [name for name in names if _pattern(entry).match(name)]
        if not hits:
            near = ", ".join(names[:6])
            raise ValueError(f"plan entry {entry!r} matches no module of {type(model).__name__} (its modules: "
                             f"{near}, ...): fix the name ('*' stands for one dotted component)")
        for name in hits:
            if name in matched and matched[name][0] != kind:
                raise ValueError(f"module {name!r} is matched as {matched[name][0]} and as {kind} (entry {entry!r}): "
                                 "give it one style")
            matched[name] = (kind, style)
    modules = dict(model.named_modules())
    for name, (kind, _) in matched.items():
        weight = getattr(modules[name], "weight", None)
        if kind in SHARDED_KINDS and (weight is None or weight.dim() != 2):
            raise ValueError(f"plan gives {kind} to {name!r}, a {type(modules[name]).__name__} without a 2-D weight: "
                             f"{kind} shards a Linear, HF Conv1D or Embedding; use 'replicate' or name its child")
    return matched


def sharded_dims(model, matched) -> list[tuple[str, int]]:
    """(what, size) pairs that tp must divide: each sharded dimension of the plan (not a
    vocabulary, which VocabParallel and ColwiseParallel(pad=True) pad to a multiple of
    tp, as Megatron) and, from an HF-style ``config``, the attention and key/value heads."""
    modules = dict(model.named_modules())
    sizes = []
    for name, (kind, style) in matched.items():
        module = modules[name]
        if kind not in ("colwise", "rowwise") or getattr(style, "pad", False) is True:
            continue
        rows, cols = module.weight.shape
        conv1d = type(module).__name__ == "Conv1D"  # HF's Conv1D keeps its weight (in, out)
        if kind == "colwise":
            fused = getattr(style, "fused", None) or 1
            out = cols if conv1d else rows
            parts = fused if isinstance(fused, (tuple, list)) else [out // fused] * fused
            sizes += [(f"{name} output" + (f" (part {i})" if len(parts) > 1 else ""), size)
                      for i, size in enumerate(parts)]
        else:
            sizes.append((f"{name} input", rows if conv1d else cols))
    config = getattr(model, "config", None)
    if any(kind in SHARDED_KINDS for kind, _ in matched.values()):
        for keys in (("num_attention_heads", "n_head"), ("num_key_value_heads",)):  # GPT-2 names n_head too
            key = next((key for key in keys if isinstance(getattr(config, key, None), int)), None)
            if key is not None:
                sizes.insert(0, (f"config.{key}", getattr(config, key)))
    return sizes
