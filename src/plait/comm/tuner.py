"""The tuner: ``algorithm="auto"`` runs the algorithm with the lowest predicted time.

Predictions are the alpha-beta-gamma closed forms of ``plait.cost.alpha_beta`` on a
link model: a calibration profile named by the caller (``tuner_from_profile``) or a
link you give (``Tuner(link)``), passed in as ``CommConfig(tuner=...)``: nothing is
read behind the caller's back. A choice is made once per (collective, world size,
power-of-two size bucket) at the bucket's geometric middle and cached, so every
rank picks the same algorithm whatever order its calls come in. Without a profile
the measured default table (``plait.comm.choice.default_algorithm``) decides.

Overrides beat both: ``CommConfig(algorithms={"all_reduce": "ring"})`` (the CLI takes
``PLAIT_ALGORITHMS="all_reduce=ring,broadcast=tree"``).

Every rank must see the same profile (the same file, or copies): ranks that pick
different algorithms are stopped by the argument check (``check_args``) with a
MismatchError naming the algorithms.
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

from plait.comm.algorithms import (COLLECTIVES, ROOTED, TORCH, algorithms_for, build_schedule,
                                   builder)
from plait.comm.algorithms.hierarchical import parse_hierarchy
from plait.cost import LinkModel
from plait.cost.alpha_beta import pipeline_segments, predict_time_s, shared_host_terms, uniform_hierarchy_dims
from plait.cost.simulator import simulate
from plait.cost.topology import Topology

__all__ = ["Tuner", "tuner_from_profile", "parse_overrides", "size_bucket", "size_ranges"]


def size_bucket(nbytes: int) -> tuple[int, int, int]:
    """(lo, hi, representative) of the power-of-two bucket [lo, hi) holding nbytes;
    the representative is the bucket's geometric middle."""
    if nbytes <= 0:
        return 0, 1, 0
    b = int(nbytes).bit_length()
    lo, hi = 1 << (b - 1), 1 << b
    return lo, hi, int(round(lo * math.sqrt(2))) if lo > 1 else 1


def size_ranges(choose, min_nbytes: int, max_nbytes: int) -> list[tuple[int, int, str]]:
    """[(lo, hi, name)]: ``choose(nbytes)`` over the power-of-two buckets from
    min_nbytes to max_nbytes, equal neighbours merged; the last range ends at
    max_nbytes + 1."""
    ranges: list[list] = []
    nbytes = max(1, min_nbytes)
    while nbytes <= max_nbytes:
        lo, hi, _ = size_bucket(nbytes)
        choice = choose(nbytes)
        if ranges and ranges[-1][2] == choice:
            ranges[-1][1] = hi
        else:
            ranges.append([lo, hi, choice])
        nbytes = hi
    if ranges:
        ranges[-1][1] = min(ranges[-1][1], max_nbytes + 1)
    return [tuple(r) for r in ranges]


def parse_overrides(spec) -> dict[str, str]:
    """``{"all_reduce": "ring"}`` or ``"all_reduce=ring,broadcast=tree"``, checked."""
    if spec is None or spec == "":
        return {}
    if isinstance(spec, str):
        pairs = {}
        for item in spec.split(","):
            if not item.strip():
                continue
            if "=" not in item:
                raise ValueError(f"algorithm override {item!r} must look like collective=algorithm (all_reduce=ring)")
            collective, algorithm = (x.strip() for x in item.split("=", 1))
            pairs[collective] = algorithm
        spec = pairs
    if not isinstance(spec, dict):
        raise TypeError(f"algorithm overrides must be a dict or 'collective=algorithm,...', got {spec!r}")
    for collective, algorithm in spec.items():
        if collective not in COLLECTIVES:
            raise ValueError(f"algorithm override for unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
        if algorithm != TORCH:
            builder(collective, algorithm)  # raises listing the valid algorithms
    return dict(spec)


class Tuner:
    """Picks, per (collective, size bucket, world size), the algorithm the model prices lowest.

    ``link`` is one LinkModel or one per hierarchy level (outermost first);
    ``hierarchy`` (a spec ``parse_hierarchy`` takes, equal groups) makes
    ``hierarchical`` a candidate; ``call_overhead_s`` is the fixed cost of a call,
    the same for every algorithm, so it changes predictions, not choices.
    ``shared_host_ranks`` switches from the one-port closed forms to the shared-host
    model (``plait.cost.alpha_beta.shared_host_terms``, priced on the schedule): for
    ranks that share one host's cores, as plait calibrate's profile on CPU measures.
    ``topology`` (a Topology of the group's ranks, e.g. `plait testbed probe`'s) prices
    every candidate's schedule with the contention simulator on those links instead,
    and adds the topology algorithms (blink, synth) and ``hierarchical`` over its hosts
    to the candidates; ``link`` may then be None.
    """

    def __init__(self, link: LinkModel | Sequence[LinkModel] | None, *, call_overhead_s: float = 0.0,
                 hierarchy=None, source: str = "given link", candidates: dict | None = None,
                 shared_host_ranks: int | None = None, topology: Topology | None = None) -> None:
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a plait.cost.topology.Topology, got {type(topology).__name__}")
        self.topology = topology
        if link is None and topology is not None:
            self.links = []
        elif isinstance(link, LinkModel):
            self.links = [link]
        else:
            self.links = list(link)
            if not self.links or not all(isinstance(x, LinkModel) for x in self.links):
                raise TypeError(f"link must be a LinkModel or a sequence of them, got {link!r}")
        if not (isinstance(call_overhead_s, (int, float)) and call_overhead_s >= 0):
            raise ValueError(f"call_overhead_s={call_overhead_s!r} must be >= 0 seconds")
        self.call_overhead_s = float(call_overhead_s)
        if shared_host_ranks is not None and (not isinstance(shared_host_ranks, int) or shared_host_ranks < 1):
            raise ValueError(f"shared_host_ranks={shared_host_ranks!r} must be an integer >= 1 or None")
        self.shared_host_ranks = shared_host_ranks
        self.hierarchy = hierarchy
        self.source = source
        self.candidates = candidates or {}
        self._cache: dict[tuple, str] = {}
        self._lock = threading.Lock()

    def _hierarchy_for(self, world_size: int):
        if self.topology is not None:
            hierarchy = self.topology.hierarchy()
            return hierarchy if len(hierarchy) > 1 else None
        if self.hierarchy is None:
            return None
        tree = parse_hierarchy(self.hierarchy, world_size)
        dims = uniform_hierarchy_dims(tree)
        return tree if dims is not None and sum(d > 1 for d in dims) > 1 else None

    def algorithms(self, collective: str, world_size: int) -> list[str]:
        """Candidates for ``collective``: every plait algorithm with a model
        (``hierarchical`` only with a multi-level hierarchy of equal groups)."""
        names = self.candidates.get(collective) or algorithms_for(collective, with_topology=self.topology is not None)
        if "hierarchical" in names and self._hierarchy_for(world_size) is None:
            names = [n for n in names if n != "hierarchical"]
        return list(names)

    def predict_s(self, collective: str, algorithm: str, nbytes: int, world_size: int) -> float:
        """Predicted seconds of one call, fixed call overhead included."""
        if world_size == 1:
            return 0.0
        hierarchy = self._hierarchy_for(world_size) if algorithm == "hierarchical" else None
        if self.topology is not None:
            return self.call_overhead_s + self._simulated_s(collective, algorithm, nbytes, world_size, hierarchy)
        if self.shared_host_ranks is not None:
            return self.call_overhead_s + self._shared_host_s(collective, algorithm, nbytes, world_size, hierarchy)
        links = self.links if algorithm == "hierarchical" else self.links[:1]
        if algorithm == "hierarchical" and len(links) > 1:
            levels = sum(d > 1 for d in uniform_hierarchy_dims(hierarchy))
            links = links[-levels:] if levels <= len(links) else links[:1]
        link = links[0] if len(links) == 1 else links
        return self.call_overhead_s + predict_time_s(collective, algorithm, nbytes, world_size, link,
                                                     hierarchy=hierarchy)

    def _schedule(self, collective, algorithm, nbytes, world_size, hierarchy):
        """(the schedule a call of ``nbytes`` runs, its itemsize)."""
        itemsize = 4 if nbytes % (4 * world_size) == 0 else 1  # whole elements where the size allows
        numel = nbytes // itemsize
        if collective == "all_to_all":
            numel = 2 * (numel - numel % world_size)  # [input | output]
        elif collective == "all_gather":
            numel = max(world_size, numel - numel % world_size)  # p equal inputs, as a real call has
        root = 0 if collective in ROOTED else None
        return build_schedule(collective, algorithm, world_size, numel, root, pipeline_segments(nbytes), hierarchy,
                              self.topology), itemsize

    def _shared_host_s(self, collective, algorithm, nbytes, world_size, hierarchy) -> float:
        schedule, itemsize = self._schedule(collective, algorithm, nbytes, world_size, hierarchy)
        return shared_host_terms(schedule, itemsize, self.shared_host_ranks).time_s(self.links[0])

    def _simulated_s(self, collective, algorithm, nbytes, world_size, hierarchy) -> float:
        schedule, itemsize = self._schedule(collective, algorithm, nbytes, world_size, hierarchy)
        return simulate(schedule, self.topology, itemsize).total_time_s

    def predictions(self, collective: str, nbytes: int, world_size: int) -> dict[str, float]:
        return {name: self.predict_s(collective, name, nbytes, world_size)
                for name in self.algorithms(collective, world_size)}

    def choose(self, collective: str, nbytes: int, world_size: int) -> str:
        """The cheapest algorithm for the bucket holding ``nbytes`` (cached)."""
        lo, _, representative = size_bucket(nbytes)
        key = (collective, world_size, lo)
        with self._lock:
            choice = self._cache.get(key)
        if choice is None:
            predicted = self.predictions(collective, representative, world_size)
            # ties (e.g. p = 2, where many algorithms are the same exchange) go to the first listed
            choice = min(predicted, key=predicted.get)
            with self._lock:
                self._cache[key] = choice
        return choice

    def switch_points(self, collective: str, world_size: int, min_nbytes: int = 1,
                      max_nbytes: int = 1 << 30) -> list[tuple[int, int, str]]:
        """[(lo, hi, algorithm)]: the size ranges [lo, hi) over which each algorithm
        is chosen, merged across buckets, like NCCL's tuning table; the last range
        ends at max_nbytes + 1."""
        return size_ranges(lambda nbytes: self.choose(collective, nbytes, world_size), min_nbytes, max_nbytes)


# ----- a tuner from a calibration profile ---------------------------------------------------------
def tuner_from_profile(profile, *, source: str = "calibration profile", shared_host: bool | None = None,
                       hierarchy=None) -> Tuner:
    """A tuner on a calibration profile's link and call overhead, for a
    ``CommConfig(tuner=...)``. ``hierarchy`` (equal groups) makes "hierarchical" a
    candidate. ``shared_host`` (default: the profile was measured on CPU, where the
    ranks share one host's cores) prices schedules with the shared-host model over the
    profile's world size; otherwise the one-port closed forms."""
    if shared_host is None:
        shared_host = getattr(profile, "device", "") == "cpu"
    return Tuner(profile.link, call_overhead_s=profile.call_overhead_s, hierarchy=hierarchy, source=source,
                 shared_host_ranks=profile.world_size if shared_host else None)
