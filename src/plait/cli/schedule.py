"""`plait schedule <collective> <algorithm>`: print an algorithm's schedule as a
step x rank table, with its rounds, bytes and the cost formula from its docstring.

    plait schedule all_reduce ring --nprocs 4 --numel 8
"""

from __future__ import annotations

import argparse

from plait.comm.algorithms import COLLECTIVES, ROOTED, build_schedule, describe
from plait.comm.algorithms.hierarchical import parse_hierarchy


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "schedule", help="print a collective algorithm's schedule (who sends what to whom, per step)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("collective", choices=COLLECTIVES)
    parser.add_argument("algorithm", help="e.g. ring, tree, recursive_doubling, halving_doubling, hierarchical")
    parser.add_argument("-n", "--nprocs", type=int, default=4, help="world size p (default 4)")
    parser.add_argument("--numel", type=int, default=None,
                        help="buffer elements (default 2p; all_to_all: [input | output] = 2p)")
    parser.add_argument("--root", type=int, default=0, help="root rank of rooted collectives")
    parser.add_argument("--segments", type=int, default=1, help="pipeline segments (chains, binary trees)")
    parser.add_argument("--hierarchy", default=None, help="for hierarchical: '2x4', '3+5' or nested lists")
    parser.add_argument("--max-steps", type=int, default=64, help="rows to print")
    parser.set_defaults(run=run)
    return parser


def run(args) -> int:
    p = args.nprocs
    if p < 1:
        raise ValueError(f"--nprocs must be >= 1, got {p}")
    numel = args.numel if args.numel is not None else 2 * p
    if numel < 0:
        raise ValueError(f"--numel must be >= 0, got {numel}")
    hierarchy = None
    if args.algorithm == "hierarchical":
        spec = args.hierarchy
        if spec and spec.lstrip().startswith("["):
            import json

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
