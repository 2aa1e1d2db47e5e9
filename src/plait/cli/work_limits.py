"""How much `plait simulate` and `plait schedule` may build, checked before they build it.

Both commands build schedules as plain data (plait.comm.algorithms, plait.parallel.pipeline)
and replay them; their time grows with the schedule, so a large request is refused
up front, with the limit, instead of running for minutes with no output.

Collective schedules. Measured over every algorithm of every collective at p = 5, 16,
33 and 1, 8, 64 segments: a schedule holds at most 4 p (p + s) transfers (ring all-reduce
2 p (p - 1); a pipelined double binary tree tends to 4 p s). Building and simulating cost
about 10 us per transfer here (2 shared cores: ring all-reduce at p = 512, 523,264
transfers, built in 5.0 s and simulated in 0.55 s on 64 DGX A100 nodes), so
plait simulate allows MAX_SIMULATED_TRANSFERS = 2**20 estimated transfers (at most about
5 s of real ones) per command. plait schedule also counts each rank's sent elements by
scanning every transfer once per rank (p x transfers: ring all-reduce at p = 256 takes
2.5 s of its 3.3 s there), so it allows MAX_SCHEDULE_TRANSFERS = 2**18 (ring at p = 255:
2.3 s). --max-transfers raises either. A preset builds every device of its nodes first: 16,384 DGX
A100 devices take about 1 s here, MAX_PRESET_DEVICES.

Pipeline schedules (plait schedule --schedule). Measured here, after start-up: 1f1b
p = 16, m = 512 in 2.4 s and p = 64, m = 1024 in 32 s (about 0.3 ms per forward or
backward, the replay and the text), interleaved_1f1b p = 16, m = 128, v = 4 (m p v = 8,192)
in 7.4 s; p = 1024, m = 1 in 1.7 s and p = 2048, m = 1 in 18 s
(the chart: p rows of about 3 (m v + p) unit-time columns). zero_bubble and chimera are
built by a greedy list scheduler whose time grows as (m p)^2: zero_bubble p = 8, m = 64
(m p = 512) in about 2 s, p = 16, m = 128 in 45 s. Hence the limits below (a few seconds
each).
"""

from __future__ import annotations

from plait.comm.algorithms import build_schedule, ROOTED
from plait.parallel.pipeline.schedules import LIST_SCHEDULED

MAX_SIMULATED_TRANSFERS = 1 << 20
MAX_SCHEDULE_TRANSFERS = 1 << 18
MAX_PRESET_DEVICES = 16_384
MAX_PIPELINE_COMPUTATIONS = 4_096  # m x p x v forwards (as many backwards)
MAX_PIPELINE_CHART_CELLS = 1 << 21  # p x 3 (m v + p - 1)
MAX_LIST_SCHEDULED = 512  # m x p for the list-scheduled schedules


def estimated_transfers(world_size: int, segments: int = 1) -> int:
    """Upper bound on one collective schedule's transfers: 4 p (p + s) (module docstring)."""
    return 4 * world_size * (world_size + max(1, segments))


def uses_segments(collective: str, algorithm: str) -> bool:
    """Whether ``algorithm`` pipelines in segments (chains, binary trees): its schedule on
    4 ranks changes from 1 segment to 2. The others ignore --segments, whatever its value."""
    numel = 64
    root = 0 if collective in ROOTED else None
    try:
        one, two = (build_schedule(collective, algorithm, 4, numel, root, segments) for segments in (1, 2))
    except (ValueError, KeyError):
        return True  # cannot tell: count the segments
    return one.num_steps != two.num_steps or one.total_numel_on_wire() != two.total_numel_on_wire() or \
        sum(len(step.transfers) for step in one.steps) != sum(len(step.transfers) for step in two.steps)


def check_transfers(estimate: int, limit: int, default: int, what: str, fix: str) -> None:
    """Raise ValueError if ``estimate`` transfers exceed ``limit`` (the fix names the flags)."""
    if limit < 1:
        raise ValueError(f"--max-transfers {limit} must be >= 1")
    if estimate > limit:
        raise ValueError(f"{what} is up to {estimate:,} transfers (4 p (p + segments) per schedule), more than the "
                         f"limit of {limit:,} (about 10 us each to build and replay here); {fix}, or raise "
                         f"--max-transfers (default {default:,})")


def check_preset_devices(name: str, devices: int) -> None:
    if devices > MAX_PRESET_DEVICES:
        raise ValueError(f"--topology {name} with {devices:,} devices is more than the {MAX_PRESET_DEVICES:,} a preset "
                         "is built with here (about 1 s): use fewer --nodes or --devices-per-node, or describe the "
                         "cluster in a --topology-file")


def check_pipeline(name: str, ranks: int, microbatches: int, virtual: int) -> None:
    """Raise ValueError if a pipeline schedule of p = ``ranks``, m = ``microbatches`` and
    v = ``virtual`` chunks per rank is past the limits (module docstring)."""
    p, m, v = ranks, microbatches, virtual
    if name in LIST_SCHEDULED and m * p > MAX_LIST_SCHEDULED:
        raise ValueError(f"{name} with --stages {p} --microbatches {m} has m x p = {m * p:,} computations to list-"
                         f"schedule; the greedy list scheduler's time grows as (m p)^2 and the limit is "
                         f"{MAX_LIST_SCHEDULED:,} (about 2 s here): use fewer stages or micro-batches")
    if m * p * v > MAX_PIPELINE_COMPUTATIONS:
        raise ValueError(f"--schedule {name} --stages {p} --microbatches {m}"
                         + (f" --virtual {v}" if v != 1 else "")
                         + f" has m x p x v = {m * p * v:,} forwards (and as many backwards), more than the limit of "
                           f"{MAX_PIPELINE_COMPUTATIONS:,} (about 3 s here): use fewer stages or micro-batches")
    cells = p * 3 * (m * v + p - 1)
    if cells > MAX_PIPELINE_CHART_CELLS:
        raise ValueError(f"--schedule {name} --stages {p} --microbatches {m}: the unit-cost chart has p x 3 (m v + p - 1)"
                         f" = {cells:,} cells, more than the limit of {MAX_PIPELINE_CHART_CELLS:,} (about 2 s here): "
                         "use fewer stages")
