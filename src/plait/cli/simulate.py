"""`plait simulate`: replay collective schedules on a cluster topology, with contention.

For each algorithm: simulated time, algbw (bytes / time), busbw, the busiest directed
link and its utilisation (bytes / (capacity x time)), and the critical path's most
frequent bottleneck. Topologies are presets (dgx-a100, dgx-h100, fat-tree, ring,
local) or JSON/TOML files (plait.cost.topology_io).

    plait simulate --topology dgx-a100 --nodes 2 --algorithm ring,halving_doubling,hierarchical --nbytes 1GB
    plait simulate --topology dgx-a100 --nodes 2 --allocation 3+5 --sizes 1KB:1GB --plot sizes.png
    plait simulate --topology-file cluster.toml --nbytes 64MB --json
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

from plait.bench.collectives import busbw_factor
from plait.cli.bench import parse_collective, parse_nbytes
from plait.cli.environment import cache_dir
from plait.cli.output_paths import output_file, prepare_output_paths
from plait.cli.work_limits import check_preset_devices, check_transfers, estimated_transfers, MAX_SIMULATED_TRANSFERS, uses_segments
from plait.comm.algorithms import algorithms_for, build_schedule, COLLECTIVES, ROOTED
from plait.cost.alpha_beta import pipeline_segments
from plait.cost.presets import preset, PRESETS
from plait.cost.simulator import MAX_NBYTES, simulate
from plait.cost.topology_io import load_topology, save_topology

DEFAULT_ALGORITHMS = "ring,halving_doubling,hierarchical"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="simulate collectives on a cluster topology (flow-level, with contention)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", default="dgx-a100",
                        help="preset: dgx-a100, dgx-h100, fat-tree, ring, local (default dgx-a100)")
    parser.add_argument("--topology-file", default=None, metavar="F.json|F.toml",
                        help="load the topology from a file instead of a preset")
    parser.add_argument("--nodes", type=int, default=None, help="nodes of the preset (default: the preset's)")
    parser.add_argument("--devices-per-node", type=int, default=None,
                        help="devices per node (fat-tree, ring, local; DGX nodes have 8)")
    parser.add_argument("--allocation", default=None,
                        help="devices to use: per-node counts like 3+5, or comma-separated device names")
    parser.add_argument("--profile", default=None,
                        help="calibration profile whose link the 'local' preset uses (default: the saved one)")
    parser.add_argument("--collective", type=parse_collective, default="all_reduce",
                        help=f"one of {', '.join(COLLECTIVES)} (default all_reduce)")
    parser.add_argument("--algorithm", "--algorithms", dest="algorithms", default=None,
                        help=f"comma-separated algorithms, or 'all' (default: {DEFAULT_ALGORITHMS} for "
                             "all_reduce, every algorithm of other collectives)")
    parser.add_argument("--nbytes", default="1GB", help="message size, e.g. 1GB (binary units; default 1GB)")
    parser.add_argument("--sizes", default=None, metavar="MIN:MAX",
                        help="sweep sizes MIN, 2 MIN, ... MAX (e.g. 1KB:1GB) instead of --nbytes")
    parser.add_argument("--itemsize", type=int, default=4, help="bytes per element (default 4, float32)")
    parser.add_argument("--root", type=int, default=0, help="root rank of rooted collectives")
    parser.add_argument("--segments", type=int, default=None,
                        help="pipeline segments of chains and binary trees (default: plait's rule for the size)")
    parser.add_argument("--max-transfers", type=int, default=MAX_SIMULATED_TRANSFERS, metavar="N",
                        help="refuse runs of more than about N transfers in all, estimated as 4 p (p + segments) per "
                             f"algorithm and size before building (default {MAX_SIMULATED_TRANSFERS:,}: a few seconds "
                             "here)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="time vs size per algorithm (with --sizes), else the busiest links' utilisation")
    parser.add_argument("--save-topology", default=None, metavar="F.json|F.toml",
                        help="write the topology used to a file")
    parser.set_defaults(run=run)
    return parser


# ----- inputs -------------------------------------------------------------------------------------
def parse_size(text: str, flag: str) -> int:
    """A byte count via plait bench's parse_nbytes, with range errors for the simulator."""

    try:
        value = float(text)
    except ValueError:
        value = None
    if str(text).strip().startswith("-") or (value is not None and (value != value or value > MAX_NBYTES
                                                                     or value < 1)):
        raise ValueError(f"{flag} {text!r} is out of range: sizes must be whole numbers of bytes from 1 to "
                         f"2**53 ({MAX_NBYTES}), e.g. 1KB, 64MB or 1GB")
    try:
        nbytes = parse_nbytes(text)
    except argparse.ArgumentTypeError as error:
        raise ValueError(f"{flag}: {error}") from None
    if nbytes > MAX_NBYTES:
        raise ValueError(f"{flag} {text!r} = {nbytes} bytes is more than the simulator's 2**53 bytes "
                         "(where float64 byte counts stop being exact); use a smaller size")
    return nbytes


def sizes_from_args(args) -> list[int]:
    if args.sizes is None:
        return [parse_size(args.nbytes, "--nbytes")]
    low, sep, high = args.sizes.partition(":")
    if not sep:
        raise ValueError(f"--sizes {args.sizes!r} must be MIN:MAX, e.g. 1KB:1GB")
    min_nbytes, max_nbytes = parse_size(low, "--sizes"), parse_size(high, "--sizes")
    if max_nbytes < min_nbytes:
        raise ValueError(f"--sizes {args.sizes!r}: MAX ({max_nbytes}) is below MIN ({min_nbytes})")
    sizes = []
    size = min_nbytes
    while size <= max_nbytes:
        sizes.append(size)
        size *= 2
    return sizes


def algorithms_from_args(args) -> list[str]:
    valid = algorithms_for(args.collective)
    if args.algorithms is None:
        return DEFAULT_ALGORITHMS.split(",") if args.collective == "all_reduce" else valid
    if args.algorithms.strip().lower() == "all":
        return valid
    names = list(dict.fromkeys(name.strip() for name in args.algorithms.split(",") if name.strip()))
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        raise ValueError(f"unknown algorithm(s) {', '.join(map(repr, unknown)) or '(none given)'} for "
                         f"{args.collective}; valid: {', '.join(valid)}")
    return names


def preset_devices(args) -> int | None:
    """Devices the preset of ``args`` builds (nodes x devices per node, the preset's
    defaults where not given), or None where the preset or a count is invalid (preset()
    then says why)."""
    builder = PRESETS.get(args.topology)
    if builder is None:
        return None
    defaults = inspect.signature(builder).parameters
    nodes = args.nodes if args.nodes is not None else defaults["nodes"].default
    per_node = 8  # DGX nodes
    if "devices_per_node" in defaults:
        per_node = args.devices_per_node if args.devices_per_node is not None else defaults["devices_per_node"].default
    if not all(isinstance(count, int) and count >= 1 for count in (nodes, per_node)):
        return None
    return nodes * per_node


def topology_from_args(args):
    if args.topology_file:
        return load_topology(args.topology_file, allocation=args.allocation)
    devices = preset_devices(args)
    if devices is not None:
        check_preset_devices(args.topology, devices)
    params = {}
    if args.nodes is not None:
        params["nodes"] = args.nodes
    if args.devices_per_node is not None:
        params["devices_per_node"] = args.devices_per_node
    if args.allocation is not None:
        params["allocation"] = args.allocation
    if args.topology == "local":
        params["link"] = _calibrated_link(args.profile)
    return preset(args.topology, **params)


def _calibrated_link(path):
    """The calibration profile's link, or None (the preset's documented placeholder)."""
    try:
        from plait.cost.profile import load_profile
    except ImportError:
        return None
    profile = load_profile(path, cache_dir=cache_dir())
    if profile is None and path is not None:
        raise ValueError(f"no calibration profile at {path}; run plait calibrate --output {path}")
    return None if profile is None else profile.link


# ----- running ----------------------------------------------------------------------------------------
def simulate_one(topology, collective: str, algorithm: str, nbytes: int, itemsize: int, root: int,
                 segments: int | None = None):
    """(table row, SimulationResult) of one algorithm at one size."""

    p = topology.world_size
    numel = max(1, nbytes // itemsize)
    if collective == "all_to_all":  # buffer = [input | output], p equal chunks each
        numel = max(2 * p, 2 * numel - (2 * numel) % (2 * p))
    hierarchy = topology.hierarchy() if algorithm == "hierarchical" else None
    started = time.perf_counter()
    segments = pipeline_segments(numel * itemsize) if segments is None else segments
    schedule = build_schedule(collective, algorithm, p, numel, root if collective in ROOTED else None,
                              segments=segments, hierarchy=hierarchy)
    built = time.perf_counter()
    result = simulate(schedule, topology, itemsize)
    done = time.perf_counter()
    moved = (numel // 2 if collective == "all_to_all" else numel) * itemsize
    algbw = moved / result.total_time_s if result.total_time_s > 0 else float("inf")
    busiest = result.busiest_links(1)[0]
    row = {
        "algorithm": algorithm, "nbytes": moved, "time_s": result.total_time_s, "steps": len(result.step_times_s),
        "algbw_bytes_per_s": algbw, "busbw_bytes_per_s": algbw * busbw_factor(collective, p),
        "busiest_link": busiest.name, "busiest_utilisation": busiest.utilisation,
        "critical": result.critical_summary(),
        "critical_links": [{"link": n, "steps": c, "time_share": s} for n, c, s in result.critical_links()[:3]],
        "build_wall_s": built - started, "simulate_wall_s": done - built,
    }
    return row, result


def _human_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3f} {unit}"
    return f"{seconds * 1e9:.1f} ns"


def _human_bytes(nbytes: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}B"


def format_table(rows: list[dict]) -> str:
    header = ["algorithm", "size", "time", "algbw GB/s", "busbw GB/s", "busiest link", "util", "critical path"]
    body = [[r["algorithm"], _human_bytes(r["nbytes"]), _human_time(r["time_s"]), f"{r['algbw_bytes_per_s'] / 1e9:.2f}",
             f"{r['busbw_bytes_per_s'] / 1e9:.2f}", r["busiest_link"], f"{r['busiest_utilisation']:.0%}", r["critical"]]
            for r in rows]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [header] + body)


def plot(path: str, rows: list[dict], results: dict, sizes: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(sizes) > 1:
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
            points = [(r["nbytes"], r["time_s"]) for r in rows if r["algorithm"] == algorithm]
            axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=algorithm)
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("message size (bytes)")
        axes.set_ylabel("simulated time (s)")
        axes.legend()
    else:
        figure, all_axes = plt.subplots(len(results), 1, figsize=(8, 2.8 * len(results)), squeeze=False)
        for axes, (algorithm, result) in zip(all_axes[:, 0], results.items()):
            loads = result.busiest_links(12)
            axes.barh([load.name for load in loads][::-1], [load.utilisation for load in loads][::-1])
            axes.set_xlim(0, 1)
            axes.set_title(f"{algorithm}: busiest links (utilisation)", fontsize=9)
            axes.tick_params(labelsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args) -> int:
    if args.itemsize < 1:
        raise ValueError(f"--itemsize {args.itemsize} must be >= 1 byte")
    if args.segments is not None and args.segments < 1:
        raise ValueError(f"--segments {args.segments} must be >= 1")
    sizes = sizes_from_args(args)
    algorithms = algorithms_from_args(args)
    topology = topology_from_args(args)
    if args.collective in ROOTED and not 0 <= args.root < topology.world_size:
        raise ValueError(f"--root {args.root} must be in [0, {topology.world_size})")
    p = topology.world_size
    estimate = sum(estimated_transfers(p, (args.segments or pipeline_segments(nbytes))
                                       if uses_segments(args.collective, algorithm) else 1)
                   for nbytes in sizes for algorithm in algorithms)
    check_transfers(estimate, args.max_transfers, MAX_SIMULATED_TRANSFERS,
                    f"{len(algorithms)} algorithm(s) x {len(sizes)} size(s) on {p} ranks ({topology.summary()})",
                    "use fewer nodes, algorithms or sizes")
    prepare_output_paths(output_file("--plot", args.plot), output_file("--save-topology", args.save_topology))
    if args.save_topology:
        save_topology(topology, args.save_topology)
    rows, results = [], {}
    for nbytes in sizes:
        for algorithm in algorithms:
            row, result = simulate_one(topology, args.collective, algorithm, nbytes, args.itemsize, args.root,
                                       args.segments)
            rows.append(row)
            results[algorithm] = result
    if args.plot:
        plot(args.plot, rows, results, sizes)
    if args.json:
        print(json.dumps({"topology": topology.summary(), "world_size": topology.world_size,
                          "hierarchy": [list(g) for g in topology.hierarchy()],
                          "collective": args.collective, "results": rows}, indent=1))
    else:
        print(f"{topology.summary()}")
        print(f"{args.collective}, {args.itemsize}-byte elements; simulated (flow-level, max-min fair links)")
        print(format_table(rows))
        if args.save_topology:
            print(f"topology written to {args.save_topology}")
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0
