"""`plait testbed`: a multi-host cluster on one machine, from network namespaces joined
by veths through a bridge, with the links between hosts shaped (plait.testbed).

    plait testbed up --preset 2x2-slow
    plait testbed up --hosts 3 --ranks-per-host 2 --link 0-1:rate=100mbit --link 0-2:rate=1gbit
    plait testbed status
    plait testbed run [--timeout SECONDS] -- job.py [ARGS...]
    plait testbed probe --out topology.json
    plait testbed down

Host i is the namespace plait-tb-h<i> with address 198.18.0.<i+1> (198.18.0.0/15 is
reserved for benchmarking); the bridge lives in plait-tb-sw. Nothing is created
outside those namespaces, and `down` deletes them all (their veths and qdiscs with
them). `run` starts one torchrun agent per host inside its namespace (c10d rendezvous
on host 0's address, gloo on each host's eth0), so the job is multi-node: the shaped
links between hosts, loopback inside one. A link's rate is an htb class at each end
for the other's address. `probe` measures every host pair's TCP rate and latency (and
each host's own) and writes them as a plait topology file. Delay is
not offered: this kernel has no netem qdisc. Needs root. Presets: 2x2-slow (2 hosts x
2 ranks, 100 Mbit between), partial-3+5 (3 ranks on one host, 5 on the other, 200
Mbit between).
"""

from __future__ import annotations

import argparse
import math

from plait.cli.output_paths import output_file, prepare_output_paths
from plait.cost.topology_io import save_topology
from plait.testbed import netns
from plait.testbed.probe import probe, profiled_topology
from plait.testbed.run import check_command, run_on_testbed
from plait.testbed.spec import PRESETS, spec_from


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("testbed", prog="plait testbed", help="a multi-host cluster on this machine",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", prog="plait testbed up", help="create the namespaces, links and shaping")
    up.add_argument("--preset", default=None, help=f"one of {', '.join(PRESETS)}")
    up.add_argument("--hosts", type=int, default=None, help="number of hosts (namespaces)")
    up.add_argument("--ranks-per-host", type=int, default=None, help="ranks each host runs (default 1)")
    up.add_argument("--link", action="append", default=[], metavar="A-B:rate=RATE",
                    help="the rate between hosts A and B, e.g. 0-1:rate=100mbit (repeatable)")
    up.set_defaults(run=run_up)
    actions.add_parser("down", prog="plait testbed down", help="delete every testbed namespace").set_defaults(
        run=run_down)
    actions.add_parser("status", prog="plait testbed status", help="the testbed's hosts, addresses and rates") \
        .set_defaults(run=run_status)
    job = actions.add_parser("run", prog="plait testbed run", help="run a torchrun job across the testbed's hosts")
    job.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="stop every agent after this long (exit 124)")
    job.add_argument("job", metavar="command", nargs=argparse.REMAINDER, help="-- then the script and its arguments, as for torchrun")
    job.set_defaults(run=run_job)
    measure = actions.add_parser("probe", prog="plait testbed probe",
                                 help="measure every host pair and write a plait topology file")
    measure.add_argument("--out", required=True, metavar="PATH", help="topology file to write (.json or .toml)")
    measure.set_defaults(run=run_probe)
    return parser


def run_probe(args) -> int:
    try:
        netns.check_privileges()
        testbed = netns.Testbed.current()
    except netns.TestbedError as error:
        raise ValueError(str(error)) from None
    prepare_output_paths(output_file("--out", args.out))
    measured = probe(testbed)
    print(f"{'hosts':<8}{'given Mbit/s':>14}{'measured Mbit/s':>17}{'ratio':>7}{'latency us':>12}")
    for entry in measured:
        given = None if entry.a == entry.b else testbed.spec.rate_between(entry.a, entry.b)
        rate = entry.bytes_per_s * 8
        print(f"{f'{entry.a}-{entry.b}':<8}{'-' if given is None else f'{given / 1e6:g}':>14}{rate / 1e6:>17.1f}"
              f"{'' if given is None else f'{rate / given:.3f}':>7}{entry.latency_s * 1e6:>12.1f}")
    path = save_topology(profiled_topology(testbed, measured), args.out)
    print(f"topology: {path}")
    return 0


def run_job(args) -> int:
    command = args.job[1:] if args.job[:1] == ["--"] else args.job
    if args.timeout is not None and not 0 < args.timeout < math.inf:  # nan fails both
        raise ValueError(f"--timeout {args.timeout}: give a finite number of seconds > 0 (or leave it out: no limit)")
    check_command(command)  # before any namespace is touched: a missing script is one line, not a traceback per rank
    try:
        netns.check_privileges()
        testbed = netns.Testbed.current()
    except netns.TestbedError as error:
        raise ValueError(str(error)) from None
    return run_on_testbed(testbed, command, timeout_s=args.timeout)


def run_up(args) -> int:
    spec = spec_from(args.preset, args.hosts, args.ranks_per_host, args.link)
    testbed = netns.Testbed(spec)
    try:
        testbed.up()
    except netns.TestbedError as error:
        raise ValueError(str(error)) from None
    for host in testbed.hosts:
        print(f"host {host.index}: namespace {host.namespace}, {host.address}, {host.ranks} rank(s)")
    for link in spec.links:
        print(f"link {link.a}-{link.b}: {link.rate_bits_per_s / 1e6:g} Mbit/s each way")
    return 0


def run_down(args) -> int:
    try:
        netns.check_privileges()
        removed = netns.down()
    except netns.TestbedError as error:
        raise ValueError(str(error)) from None
    print(f"removed {', '.join(removed)}" if removed else "no testbed is up")
    return 0


def run_status(args) -> int:
    try:
        lines = netns.status()
    except netns.TestbedError as error:
        raise ValueError(str(error)) from None
    print("\n".join(lines) if lines else "no testbed is up")
    return 0
