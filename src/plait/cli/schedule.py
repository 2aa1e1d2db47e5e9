"""`plait schedule <collective> <algorithm>`: print an algorithm's schedule as a
step x rank table, with its rounds, bytes and the cost formula from its docstring.
`plait schedule --schedule NAME --stages P --microbatches M`: a pipeline schedule's
action lists, its Gantt chart (ASCII, and a PNG with --out) from the unit-cost replay
(forward 1, backward 2) or from a recorded run (--timeline), bubble and in-flight
activations per rank next to their formulas.

    plait schedule all_reduce ring --nprocs 4 --numel 8
    plait schedule --schedule 1f1b --stages 4 --microbatches 8 --out schedule.png
    plait schedule --schedule interleaved_1f1b --stages 4 --microbatches 8 --virtual 2
    plait schedule --timeline run.json --out run.png
"""

from __future__ import annotations

import argparse
import json

from plait.cli.output_paths import output_file, prepare_output_paths
from plait.cli.work_limits import check_pipeline, check_transfers, estimated_transfers, MAX_SCHEDULE_TRANSFERS, uses_segments
from plait.comm.algorithms import build_schedule, COLLECTIVES, describe, ROOTED
from plait.comm.algorithms.hierarchical import parse_hierarchy
from plait.parallel.pipeline.draw import (
    ascii_gantt,
    ascii_legend,
    plot_gantt,
    theory,
    time_unit,
    timeline_from_json,
    timeline_peak_in_flight,
    with_chunk_labels,
)
from plait.names.schedules import CHIMERA, INTERLEAVED_1F1B
from plait.parallel.pipeline.replay import peak_in_flight, validate
from plait.parallel.pipeline.schedules import build, SCHEDULES

_PIPELINE_FLAGS = ("stages", "microbatches", "virtual", "out", "timeline", "width", "actions")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "schedule", help="print a collective algorithm's or a pipeline's schedule (who does what, when)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("collective", nargs="?", default=None, choices=COLLECTIVES)
    parser.add_argument("algorithm", nargs="?", default=None,
                        help="e.g. ring, tree, recursive_doubling, halving_doubling, hierarchical")
    parser.add_argument("-n", "--nprocs", type=int, default=4, help="world size p (default 4)")
    parser.add_argument("--numel", type=int, default=None,
                        help="buffer elements (default 2p; all_to_all: [input | output] = 2p)")
    parser.add_argument("--root", type=int, default=0, help="root rank of rooted collectives")
    parser.add_argument("--segments", type=int, default=1, help="pipeline segments (chains, binary trees)")
    parser.add_argument("--hierarchy", default=None, help="for hierarchical: '2x4', '3+5' or nested lists")
    parser.add_argument("--max-steps", type=int, default=64, help="rows to print")
    parser.add_argument("--max-transfers", type=int, default=MAX_SCHEDULE_TRANSFERS, metavar="N",
                        help=f"refuse schedules of more than about N transfers, estimated as 4 p (p + segments) before "
                             f"building (default {MAX_SCHEDULE_TRANSFERS:,}: a few seconds here)")
    pipeline = parser.add_argument_group("pipeline schedules (instead of a collective and algorithm)")
    pipeline.add_argument("--schedule", default=None, metavar="NAME", help=f"one of {', '.join(SCHEDULES)}")
    pipeline.add_argument("--stages", type=int, default=None, metavar="P", help="pipeline ranks p")
    pipeline.add_argument("--microbatches", type=int, default=None, metavar="M", help="micro-batches m per step")
    pipeline.add_argument("--virtual", type=int, default=None, metavar="V",
                          help="chunks per rank v (interleaved_1f1b only; default 1)")
    pipeline.add_argument("--out", default=None, metavar="PATH.png", help="also draw the Gantt chart as a PNG")
    pipeline.add_argument("--timeline", default=None, metavar="RUN.json",
                          help="draw a recorded run's timeline (plait.parallel.pipeline.draw.timeline_to_json)")
    pipeline.add_argument("--width", type=int, default=None, metavar="COLS",
                          help="time columns of the ASCII chart (default: one per unit cost, 80 for a real run)")
    pipeline.add_argument("--actions", action="store_true",
                          help="print the full action lists, sends and receives included")
    parser.set_defaults(run=run)
    return parser


def run(args) -> int:
    pipeline = args.schedule is not None or args.timeline is not None
    if pipeline and (args.collective or args.algorithm):
        raise ValueError(f"give either a collective and algorithm (plait schedule all_reduce ring) or a pipeline "
                         f"schedule (--schedule/--timeline), not both: got {args.collective!r} {args.algorithm!r} "
                         f"and --schedule {args.schedule!r}")
    if pipeline:
        return run_pipeline(args)
    if args.collective is None or args.algorithm is None:
        raise ValueError("give a collective and an algorithm (plait schedule all_reduce ring) or a pipeline "
                         "schedule (plait schedule --schedule 1f1b --stages 4 --microbatches 8)")
    stray = [f"--{flag}" for flag in _PIPELINE_FLAGS if getattr(args, flag) not in (None, False)]
    if stray:
        raise ValueError(f"{', '.join(stray)} {'apply' if len(stray) > 1 else 'applies'} to pipeline schedules "
                         "only: add --schedule NAME")
    p = args.nprocs
    if p < 1:
        raise ValueError(f"--nprocs must be >= 1, got {p}")
    numel = args.numel if args.numel is not None else 2 * p
    if numel < 0:
        raise ValueError(f"--numel must be >= 0, got {numel}")
    if args.segments < 1:
        raise ValueError(f"--segments must be >= 1, got {args.segments}")
    segments = args.segments if uses_segments(args.collective, args.algorithm) else 1
    check_transfers(estimated_transfers(p, segments), args.max_transfers, MAX_SCHEDULE_TRANSFERS,
                    f"{args.collective} {args.algorithm} on -n {p} ranks with --segments {args.segments}",
                    "use a smaller -n or fewer --segments")
    hierarchy = None
    if args.algorithm == "hierarchical":
        spec = args.hierarchy
        if spec and spec.lstrip().startswith("["):
            spec = json.loads(spec)
        hierarchy = parse_hierarchy(spec, p, 1)
    root = args.root if args.collective in ROOTED else None
    schedule = build_schedule(args.collective, args.algorithm, p, numel, root, args.segments, hierarchy)
    print(schedule.table(args.max_steps))
    print()
    print(f"cost: {describe(args.collective, args.algorithm)}")
    print(f"rounds {schedule.num_steps}; elements sent by the busiest rank {schedule.max_sent_numel()}; "
          f"on the critical path {schedule.critical_path_numel()}; on the wire in total "
          f"{schedule.total_numel_on_wire()}")
    if hierarchy is not None:
        print(f"hierarchy: {list(hierarchy)}")
    return 0


# ----- pipeline schedules --------------------------------------------------------------------
def _compute_text(schedule) -> list[str]:
    """Per rank, its forwards and backwards in order (F3.1: chunk 1 of a rank holding several)."""
    lines = []
    for rank in range(schedule.ranks):
        many = len(schedule.stages_of(rank)) > 1
        words = [action.label(schedule.chunk_of(rank, action.microbatch, action.stage) if many else None)
                 for action in schedule.compute_order(rank)]
        lines.append(f"rank {rank}: " + " ".join(words))
    return lines


def _load_timeline(path: str):

    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except OSError as error:
        raise ValueError(f"--timeline {path}: cannot read it ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--timeline {path}: not JSON ({error})") from None
    try:
        return timeline_from_json(document), dict(document.get("meta") or {})
    except ValueError as error:
        raise ValueError(f"--timeline {path}: {error}") from None


def _check_pipeline_size(name: str, p: int, m: int, virtual: int | None) -> None:
    """Refuse, before building, a schedule past plait.cli.work_limits' limits; the message
    gives the bubble formula's value, which needs no replay."""
    if name not in SCHEDULES:
        return  # build() names the valid ones
    for flag, value in (("--stages", p), ("--microbatches", m), ("--virtual", virtual)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")
    v = (2 if virtual is None else virtual) if name == INTERLEAVED_1F1B else 1
    try:
        check_pipeline(name, p, m, v)
    except ValueError as error:
        formula = theory(name, p, m, v)
        raise ValueError(f"{error}; the bubble by formula, with no replay: {formula['bubble_formula']} = "
                         f"{formula['bubble_fraction']:.4f}") from None


def run_pipeline(args) -> int:
    """Print (and with --out draw) a pipeline schedule's or a recorded run's Gantt chart."""

    if args.width is not None and args.width < 1:
        raise ValueError(f"--width {args.width}: give the ASCII chart's time columns, an int >= 1 (e.g. --width 80)")
    if args.out is not None and not args.out.lower().endswith(".png"):
        raise ValueError(f"--out {args.out}: the Gantt chart is written as PNG; use a path ending in .png")
    prepare_output_paths(output_file("--out", args.out))
    schedule = None
    if args.timeline is not None:
        timeline, meta = _load_timeline(args.timeline)
        name = args.schedule or meta.get("schedule")
        m = args.microbatches or meta.get("microbatches")
        v = args.virtual or meta.get("virtual") or 1
        p = timeline.ranks
        if args.stages is not None and args.stages != p:
            raise ValueError(f"--stages {args.stages} does not match the {p} ranks of --timeline {args.timeline}")
        print(f"recorded timeline {args.timeline}: {p} ranks, source {timeline.source!r}"
              + (f", schedule {name} m = {m}" + (f" v = {v}" if v != 1 else "") if name and m else ""))
        peaks = timeline_peak_in_flight(timeline)
    else:
        if args.stages is None or args.microbatches is None:
            raise ValueError(f"--schedule {args.schedule} needs --stages P and --microbatches M, "
                             "e.g. --stages 4 --microbatches 8")
        name, p, m = args.schedule, args.stages, args.microbatches
        _check_pipeline_size(name, p, m, args.virtual)
        schedule = build(name, p, m, args.virtual)
        v = schedule.stages // p  # chunks per rank (interleaved: --virtual, default 2)
        timeline = with_chunk_labels(validate(schedule), schedule)
        peaks = peak_in_flight(schedule)
        print(f"{name}: p = {p} pipeline ranks, m = {m} micro-batches, {schedule.stages} stages"
              + (f" (v = {v} chunks per rank)" if v != 1 else "") + "; unit costs: forward 1, backward 2"
              + (f", divided by v = {v}" if v != 1 else ""))
        if args.actions:
            print("actions per rank (sa/ra send/receive activation, sg/rg gradient, >to <from rank; AR all-reduce):")
            lines = schedule.text()
        else:
            print("compute order per rank (F forward, B backward of micro-batch n, .c chunk; --actions adds the "
                  "sends and receives):")
            lines = _compute_text(schedule)
        print("\n".join(lines))
    formula = theory(name, p, m, v) if name and m else None
    unit, factor = time_unit(timeline)
    print()
    print(f"Gantt: {ascii_legend(timeline, args.width)}")
    print("\n".join(ascii_gantt(timeline, args.width)))
    print()
    peak_unit = formula["peak_unit"] if formula else "micro-batches"
    print(f"{'rank':>4}  {'busy':>9}  {'idle':>9}  {'bubble':>7}  {'formula':>7}  {'in-flight':>9}  {'formula':>7}")
    span = timeline.makespan_s
    for rank in range(p):
        busy = timeline.busy_s(rank)
        formula_bubble = f"{formula['bubble_fraction']:.4f}" if formula else "-"
        formula_peak = formula["peak_in_flight"][rank] if formula and formula["peak_in_flight"] else "n/a"
        print(f"{rank:>4}  {busy * factor:>9.4g}  {(span - busy) * factor:>9.4g}  {timeline.bubble_fraction(rank):>7.4f}"
              f"  {formula_bubble:>7}  {peaks[rank]:>9}  {formula_peak!s:>7}")
    print(f"(busy and idle in {unit}; in-flight activations in {peak_unit})")
    overall = timeline.bubble_fraction()
    if formula:
        print(f"bubble {overall:.4f} (mean over ranks), formula {formula['bubble_formula']} = "
              f"{formula['bubble_fraction']:.4f}; makespan {span * factor:.4g} {unit}")
        bound = (f"max {formula['peak_in_flight_max']}" if formula["peak_in_flight_max"] is not None else "")
        print(f"peak in-flight {max(peaks, default=0)}, formula {formula['peak_formula']}" + (f": {bound}" if bound
              else ""))
    else:
        print(f"bubble {overall:.4f} (mean over ranks); makespan {span * factor:.4g} {unit}; peak in-flight "
              f"{max(peaks, default=0)} (no formula: give --schedule NAME --microbatches M)")
    if args.out is not None:
        title = (f"{name} p={p} m={m}" + (f" v={v}" if v != 1 else "") if name and m else args.timeline) \
            + f" ({timeline.source}): bubble {overall:.1%}" \
            + (f", formula {formula['bubble_fraction']:.1%}" if formula else "")
        chunk_names = ["down", "up"] if name == CHIMERA else None
        path = plot_gantt(timeline, args.out, title, chunk_names=chunk_names)
        print(f"wrote {path}")
    return 0
