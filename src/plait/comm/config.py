"""A communicator's configuration: frozen, passed in, never read from the environment.

Every value that steers a collective (its deadline, how its arguments are checked,
how its messages are cut, which algorithm ``algorithm="auto"`` runs) lives here, on
the :class:`~plait.comm.communicator.Communicator` of one process group. The CLI may
build one from flags and ``PLAIT_COMM_*`` variables
(``plait.cli.comm_config.config_from_environment``); the library never does.

    timeout_s               how long a collective may wait for a peer (300 s)
    check                   "inband": each call's first message to every peer carries a
                            header (call number, collective, algorithm, elements, dtype,
                            op, root) checked by the receiver, no extra message on small
                            calls; "deep": a separate agreement all-gather before each
                            call (debugging; also what NCCL's grouped steps use);
                            "off": no check
    segment_bytes           messages above this are split so reductions stream (4 MiB;
                            0 never splits; on shared memory at most a quarter of
                            shm_ring_bytes: plait.comm.transport.stream_segment_bytes);
                            every rank of the group must agree
    pipeline_segment_bytes  segment size of pipelined chains and binary trees (256 KiB)
    hierarchy               default hierarchy of algorithm="hierarchical"
    local_world_size        ranks per host: algorithm="hierarchical" on the world with no
                            hierarchy (and no topology) groups that many consecutive ranks
                            (None: one flat group); the CLI passes the launcher's
                            LOCAL_WORLD_SIZE
    topology                the group's cluster (a plait.cost.topology.Topology, rank i
                            on its i-th device), which algorithm="blink" and "synth"
                            are built from (None: those algorithms are refused); it
                            also groups "hierarchical" by host when no hierarchy is
                            given
    algorithms              per-collective algorithm that algorithm="auto" runs instead
                            of the tuner's choice, e.g. {"all_reduce": "ring"}
    tuner                   a plait.comm.tuner.Tuner (built from a named calibration
                            profile) that prices algorithm="auto"; None: the default table
    transport               how messages to ranks on this host travel on a gloo group:
                            "auto" (shared memory where the set-up works, gloo otherwise,
                            saying why), "shm" (shared memory or fail naming the reason),
                            "gloo" (never shared memory); ranks on other hosts use gloo
    shm_ring_bytes          bytes of each shared-memory ring (one per pair of local ranks;
                            a host of n ranks needs about n(n-1) of them; 4 MiB)
    shm_spin_us             how long a waiting rank polls its rings before it blocks on
                            its doorbell (20 us; none when the host's ranks outnumber its
                            cores; bench/shm_wait.py measures the choice)
    shm_spin_max_us         how long a waiting rank polls while its recent long polls
                            ended their waits without blocking (500 us): a peer's per-call time is then
                            covered by polling instead of a block and a wake-up (50-300 us
                            each); with more local ranks than cores it polls with
                            sched_yield this long (0: shm_spin_us only, never yields)
    shm_dir                 where the segments are created (and unlinked at once): /dev/shm
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType

from plait.comm.settings import checked_setting
from plait.cost.topology import Topology
from plait.cost.topology_io import topology_fingerprint
from plait.names.transports import TRANSPORTS

CHECK_MODES = ("inband", "deep", "off")


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    """What one communicator does; see the module docstring for each field."""

    timeout_s: float = 300.0
    check: str = "inband"
    segment_bytes: int = 4 << 20
    pipeline_segment_bytes: int = 256 << 10
    hierarchy: object = None
    local_world_size: int | None = None
    topology: object = None
    algorithms: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    tuner: object = None
    transport: str = "auto"
    shm_ring_bytes: int = 4 << 20
    shm_spin_us: float = 20.0
    shm_spin_max_us: float = 500.0
    shm_dir: str = "/dev/shm"

    def __post_init__(self):
        problems = []
        checked = {}
        for name in ("timeout_s", "segment_bytes", "algorithms", "hierarchy"):
            value = getattr(self, name)
            if name == "algorithms" and isinstance(value, MappingProxyType):
                value = dict(value)
            try:
                checked[name] = checked_setting(name, value, name)
            except (TypeError, ValueError) as error:
                problems.append(str(error))
        if self.check not in CHECK_MODES:
            problems.append(f"check={self.check!r}: must be one of {', '.join(map(repr, CHECK_MODES))}")
        if (isinstance(self.pipeline_segment_bytes, bool) or not isinstance(self.pipeline_segment_bytes, int)
                or self.pipeline_segment_bytes <= 0):
            problems.append(f"pipeline_segment_bytes={self.pipeline_segment_bytes!r}: must be a whole number of "
                            "bytes > 0, e.g. 262144")
        if self.transport not in TRANSPORTS:
            problems.append(f"transport={self.transport!r}: must be one of {', '.join(map(repr, TRANSPORTS))}")
        if (isinstance(self.shm_ring_bytes, bool) or not isinstance(self.shm_ring_bytes, int)
                or self.shm_ring_bytes < 4096 or self.shm_ring_bytes % 4096):
            problems.append(f"shm_ring_bytes={self.shm_ring_bytes!r}: must be a whole number of 4096-byte pages "
                            ">= 4096, e.g. 4194304")
        if (isinstance(self.shm_spin_us, bool) or not isinstance(self.shm_spin_us, (int, float))
                or not 0 <= self.shm_spin_us <= 1e6):
            problems.append(f"shm_spin_us={self.shm_spin_us!r}: must be a number of microseconds in [0, 1e6]")
        if (isinstance(self.shm_spin_max_us, bool) or not isinstance(self.shm_spin_max_us, (int, float))
                or not 0 <= self.shm_spin_max_us <= 1e6):
            problems.append(f"shm_spin_max_us={self.shm_spin_max_us!r}: must be a number of microseconds in "
                            "[0, 1e6], e.g. 500")
        if self.local_world_size is not None and (isinstance(self.local_world_size, bool) or not isinstance(
                self.local_world_size, int) or self.local_world_size < 1):
            problems.append(f"local_world_size={self.local_world_size!r}: must be a whole number of ranks per host "
                            ">= 1, or None")
        if not isinstance(self.shm_dir, str) or not self.shm_dir:
            problems.append(f"shm_dir={self.shm_dir!r}: must be a directory path, e.g. '/dev/shm'")
        if self.topology is not None and not isinstance(self.topology, Topology):
            problems.append(f"topology={self.topology!r}: must be a plait.cost.topology.Topology (e.g. "
                            "plait.cost.topology_io.load_topology(path)) or None")
        if self.tuner is not None and not callable(getattr(self.tuner, "choose", None)):
            problems.append(f"tuner={self.tuner!r}: must be a plait.comm.tuner.Tuner (or None for the default "
                            "table)")
        if problems:
            raise ValueError("CommConfig: " + "; ".join(problems))
        for name, value in checked.items():
            if name == "algorithms":
                value = MappingProxyType(dict(value))
            object.__setattr__(self, name, value)

    def replace(self, **changes) -> CommConfig:
        """A copy with ``changes`` (checked again)."""
        if "algorithms" in changes and changes["algorithms"] is not None:
            changes["algorithms"] = dict(changes["algorithms"])
        return replace(self, **changes)

    def describe(self) -> str:
        overrides = ",".join(f"{k}={v}" for k, v in sorted(self.algorithms.items())) or "none"
        tuner = getattr(self.tuner, "source", None) or "default table"
        return (f"timeout {self.timeout_s:g}s, check {self.check}, segments {self.segment_bytes} B, "
                f"overrides {overrides}, auto from {tuner}, transport {self.transport}")

    def agreement_key(self) -> tuple:
        """What every rank of a group must agree on (the messages' shapes and the check)."""
        return (self.check, self.segment_bytes, self.pipeline_segment_bytes, repr(self.hierarchy),
                tuple(sorted(self.algorithms.items())),
                None if self.topology is None else topology_fingerprint(self.topology), self.transport,
                self.shm_ring_bytes)  # not shm_dir: each host may keep its segments elsewhere


# the variable the CLI reads for each field (plait.cli.comm_config.config_from_environment)
ENVIRONMENT = {"timeout_s": "PLAIT_COMM_TIMEOUT_S", "check": "PLAIT_COMM_CHECK",
               "segment_bytes": "PLAIT_COMM_SEGMENT_BYTES", "hierarchy": "PLAIT_HIERARCHY",
               "algorithms": "PLAIT_ALGORITHMS"}


__all__ = ["CHECK_MODES", "TRANSPORTS", "CommConfig", "ENVIRONMENT"]
