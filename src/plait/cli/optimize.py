"""`plait optimize PKG.MOD:FUNCTION`: trace a model with torch.fx, apply plait's graph
rewrite rules (conv+BatchNorm folding and its kin, plait.graph), print what fired where
and why the rest did not, and check the optimized model gives the same outputs.

PKG.MOD is imported with the current directory on the import path (as `python -m`
has it), and FUNCTION is called with no arguments and returns ``(module, example_inputs)``: the
module (put it in eval mode: BatchNorm and dropout in training mode are refused) and a
tensor or a tuple of tensors it is called with (``plait plan --module`` takes the same
factory: plait.cli.factory). The module runs once on those inputs before it is traced,
so inputs of the wrong shape are named with the shape the failing layer expects. The
equivalence check compares the outputs on those inputs, ‖out − ref‖/‖ref‖ <= 1e-5 in
float32, 1e-12 in float64 (plait.graph.bench); if they differ, plait optimize shows the
difference and exits 1.

    plait optimize plait.graph.examples:resnet18_like
    plait optimize plait.graph.examples:mobilenet_like --rules fold_conv_bn,remove_dropout
    plait optimize plait.graph.examples:gpt_eval --leaf plait.graph.examples:GPT_LEAF_MODULES
    plait optimize plait.graph.examples:resnet18_like --bench --batch 8 --report out/resnet

--bench times inference (torch.inference_mode, batch as given) before and after, the
traced graph with no rules, and the peers torch.fx.experimental.optimization.fuse and
torch.ao.quantization.fuse_modules on the same model, alternating, and checks the
peers' outputs too. --report DIR writes report.md, report.json, graph-before.png and
graph-after.png.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from plait.cli.factory import check_forward, describe_tensor, FACTORY_HELP, import_attribute, load_factory
from plait.cli.output_paths import output_directory, prepare_output_paths
from plait.graph import RULES, optimize
from plait.graph.bench import (
    DEFAULT_REPEATS,
    compare_outputs,
    counted_flops,
    format_latency,
    fuse_modules_peer,
    fx_fuse_peer,
    measure_latency,
    output_tensors,
    paired_speedup,
    run_model,
    tolerance_for,
)
from plait.graph.drawing import draw_graph

DTYPES = {"float32": torch.float32, "float64": torch.float64}
EXIT_OUTPUTS_CHANGED = 1


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: use a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value}: use a positive integer")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "optimize", help="rewrite a model's torch.fx graph (conv+BatchNorm folding, ...), check and time it",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", metavar="PKG.MOD:FUNCTION",
                        help=f"{FACTORY_HELP}; e.g. plait.graph.examples:resnet18_like")
    parser.add_argument("--rules", type=_names, default=None, metavar="RULE,...",
                        help=f"rules to apply, in this order (default all: {', '.join(RULES)})")
    parser.add_argument("--leaf", type=_names, default=(), metavar="NAME,...",
                        help="modules torch.fx calls whole instead of tracing into: qualified names "
                             "(blocks.0) or PKG.MOD:CLASS (or a tuple of classes)")
    parser.add_argument("--bench", action="store_true", help="time before/after and the peers")
    parser.add_argument("--report", default=None, metavar="DIR",
                        help="write report.md, report.json, graph-before.png, graph-after.png here")
    parser.add_argument("--batch", type=_positive_int, default=None, metavar="N",
                        help="repeat the example inputs along dim 0 to N rows (default: as returned)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="convert the module and its float inputs (default: as returned)")
    parser.add_argument("--repeats", type=_positive_int, default=DEFAULT_REPEATS,
                        help=f"timing samples per variant with --bench (default {DEFAULT_REPEATS})")
    parser.set_defaults(run=run)
    return parser


def resolve_leaves(names: tuple[str, ...]) -> tuple:
    """--leaf entries: PKG.MOD:CLASS (a module class or a tuple of them) become classes,
    the rest stay qualified module names (plait.graph checks they exist)."""
    leaves: list = []
    for name in names:
        if ":" not in name:
            leaves.append(name)
            continue
        found = import_attribute(name, "--leaf", form="PKG.MOD:CLASS", example="plait.graph.examples:GPT_LEAF_MODULES")
        classes = found if isinstance(found, tuple) else (found,)
        for leaf in classes:
            if not (isinstance(leaf, type) and issubclass(leaf, nn.Module)):
                raise ValueError(f"--leaf {name} names {leaf!r}, not an nn.Module class (or a tuple of them)")
        leaves.extend(classes)
    return tuple(leaves)


def with_batch(inputs: tuple[torch.Tensor, ...], batch: int) -> tuple[torch.Tensor, ...]:
    """Each input repeated along dim 0 (cycling its rows) to ``batch`` rows; scalars kept."""
    resized = []
    for tensor in inputs:
        if tensor.dim() == 0 or tensor.shape[0] == 0:
            resized.append(tensor)
            continue
        copies = -(-batch // tensor.shape[0])  # ceil
        resized.append(tensor.repeat(copies, *([1] * (tensor.dim() - 1)))[:batch].contiguous())
    return tuple(resized)


def with_dtype(module: nn.Module, inputs: tuple[torch.Tensor, ...], dtype: torch.dtype):
    """The module and its floating-point inputs converted to ``dtype`` (integer inputs kept)."""
    return module.to(dtype), tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


def output_dtype(output) -> torch.dtype:
    """The dtype whose tolerance applies: the first floating-point output's (else float64: exact)."""
    floating = [tensor.dtype for tensor in output_tensors(output) if tensor.is_floating_point()]
    return floating[0] if floating else torch.float64


def rules_fired(report) -> str:
    """'fold_conv_bn x20, inplace_relu x17' (applied outcomes per rule), or 'none'."""
    counts = Counter(outcome.rule for outcome in report.applied)
    return ", ".join(f"{rule} x{count}" for rule, count in counts.items()) or "none"


def _shapes(inputs) -> str:
    return ", ".join(describe_tensor(t) for t in inputs)


def _bench(module, gm, before, inputs, reference, tolerance, repeats) -> list[dict]:
    """Time eager / traced / plait / peers (alternating) and check every variant's outputs."""
    batch = inputs[0].shape[0] if inputs and inputs[0].dim() else 1
    variants = {"eager (before)": (module, "the module as returned"),
                "traced, no rules": (before, "torch.fx GraphModule, no rewrites"),
                "plait optimize": (gm, "the rewritten graph")}
    skipped = []
    for peer in (fx_fuse_peer(module, before), fuse_modules_peer(module, before)):
        if peer.skipped:
            skipped.append({"name": peer.name, "detail": peer.detail, "skipped": True})
        else:
            variants[peer.name] = (peer.module, peer.detail)
    rows = []
    timings = measure_latency({name: model for name, (model, _) in variants.items()}, inputs, batch,
                              repeats=repeats)
    eager = timings["eager (before)"]
    for name, (model, detail) in variants.items():
        difference = compare_outputs(reference, run_model(model, inputs), tolerance)
        rows.append({"name": name, "detail": detail, "skipped": False, "correct": difference.ok,
                     "equivalence": difference.as_dict(), "timing": timings[name].as_dict(),
                     "latency": format_latency(timings[name]), "speedup": paired_speedup(eager, timings[name]),
                     "speedup_of_medians": eager.median_s / timings[name].median_s})
    return rows + skipped


def bench_table(rows: list[dict]) -> str:
    """The --bench rows as a markdown table (skipped peers with their reason)."""
    lines = ["| variant | correct (rel. error) | latency median (min-max) | throughput items/s | speedup | note |",
             "|---|---|---:|---:|---:|---|"]
    for row in rows:
        if row["skipped"]:
            lines.append(f"| {row['name']} | - | - | - | - | {row['detail']} |")
            continue
        verdict = "yes" if row["correct"] else "**WRONG**"
        lines.append(f"| {row['name']} | {verdict} ({row['equivalence']['relative_error']:.2g}) | {row['latency']} | "
                     f"{row['timing']['throughput_per_s']:,.0f} | {row['speedup']:.3f}x | {row['detail']} |")
    return "\n".join(lines)


def _write_report(directory: Path, result: dict, before, gm, markdown: list[str]) -> None:
    draw_graph(before, directory / "graph-before.png", f"{result['target']}: before ({len(before.graph.nodes)} nodes)")
    draw_graph(gm, directory / "graph-after.png", f"{result['target']}: after ({len(gm.graph.nodes)} nodes)")
    markdown += ["", "![before](graph-before.png) ![after](graph-after.png)", ""]
    (directory / "report.md").write_text("\n".join(markdown))
    (directory / "report.json").write_text(json.dumps(result, indent=2, default=str) + "\n")


def run(args) -> int:
    prepare_output_paths(output_directory("--report", args.report))
    module, inputs = load_factory(args.target)
    if args.dtype is not None:
        module, inputs = with_dtype(module, inputs, DTYPES[args.dtype])
    if args.batch is not None:
        inputs = with_batch(inputs, args.batch)
    check_forward(args.target, module, inputs)  # eagerly, before the trace: wrong shapes named in one line
    leaves = resolve_leaves(args.leaf)
    rules = None if args.rules is None else list(args.rules)
    before, _ = optimize(module, inputs, rules=[], leaf_modules=leaves)  # traced, nothing rewritten
    gm, report = optimize(module, inputs, rules=rules, leaf_modules=leaves)
    reference = run_model(module, inputs)
    tolerance = tolerance_for(output_dtype(reference))
    difference = compare_outputs(reference, run_model(gm, inputs), tolerance)
    header = (f"# plait optimize {args.target}: {type(module).__name__}, inputs {_shapes(inputs)}, "
              f"{torch.get_num_threads()} threads; graph {len(before.graph.nodes)} -> {len(gm.graph.nodes)} nodes")
    summary = (f"rules fired: {rules_fired(report)}; refused: {len(report.refused)}; predicted saving per forward: "
               f"{report.predicted_flops_saved:,.0f} FLOPs, {report.predicted_bytes_saved:,.0f} bytes")
    markdown = [header, "", report.table(), "", summary, "", f"equivalence: {difference.describe()}"]
    print("\n".join(markdown), flush=True)
    result = {"target": args.target, "model": type(module).__name__, "inputs": _shapes(inputs),
              "threads": torch.get_num_threads(), "nodes_before": len(before.graph.nodes),
              "nodes_after": len(gm.graph.nodes), "rules_fired": rules_fired(report), "report": report.as_dict(),
              "equivalence": difference.as_dict(), "bench": None}
    if not difference.ok:
        again = compare_outputs(reference, run_model(module, inputs), tolerance)
        if not again.ok:
            message = (f"the original module itself is not deterministic (two runs differ: relative error "
                       f"{again.relative_error:.3g}): dropout or BatchNorm in training mode? call module.eval() "
                       f"in {args.target}")
        else:
            message = "a rewrite changed the outputs"
        markdown.append(f"stopped: {message}" + ("; not timing (--bench)" if args.bench else ""))
        print(markdown[-1])
    elif args.bench:
        flops = counted_flops(module, inputs)
        rows = _bench(module, gm, before, inputs, reference, tolerance, args.repeats)
        result["bench"] = {"counted_flops": flops, "rows": rows}
        predicted = (f"predicted: {report.predicted_flops_saved:,.0f} FLOPs saved (torch's FlopCounterMode counts "
                     f"{flops:,} matmul/conv FLOPs per forward, no elementwise work), "
                     f"{report.predicted_bytes_saved:,.0f} bytes saved")
        markdown += ["", bench_table(rows), "", predicted]
        print("\n".join(markdown[-4:]))
    if args.report is not None:
        _write_report(Path(args.report), result, before, gm, markdown)
        print(f"report: {Path(args.report) / 'report.md'}")
    return 0 if difference.ok else EXIT_OUTPUTS_CHANGED
