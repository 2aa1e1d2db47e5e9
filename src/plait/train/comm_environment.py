"""The CommConfig the CLI built from the PLAIT_* variables, checked against one
``plait train`` run before any process starts (and in ``--dry-run``).

The CLI checks each variable's own range for every command (plait.comm.settings);
what only a run can say is checked here, each problem named with its variable:

- PLAIT_HIERARCHY must name exactly the ranks of every group that runs
  ``algorithm="hierarchical"``: the dp and tp groups with ``--algorithm hierarchical``
  (the gradient all-reduce, the tensor-parallel layers), every group of the run (dp,
  tp, pp lines and the world: metrics, the pipeline's loss, the loss scaler's
  overflow flag) when PLAIT_ALGORITHMS sends a collective's ``auto`` calls to it. A
  group of one rank runs nothing. Set but used by no group, it is reported as ignored.
- PLAIT_ALGORITHMS may not name an algorithm built from the cluster's topology (blink,
  synth): plait train gives its groups none.
- PLAIT_COMM_TIMEOUT_S: a run's collectives wait ``timeout_s`` (--timeout-s); a
  different value in the variable would be ignored, so it is refused.
- PLAIT_FAULT_KILL (a test hook, ``fault_kill_problems``): "RANK:STEP" naming one of
  the run's ranks.
"""

from __future__ import annotations

from plait.comm.algorithms import TOPOLOGY_ALGORITHMS
from plait.comm.config import ENVIRONMENT, CommConfig
from plait.comm.settings import hierarchy_ranks
from plait.names.axes import DP, PP, TP
from plait.train.config import TrainConfig
from plait.train.loop import FAULT_ENV

HIERARCHICAL = "hierarchical"
WORLD = "world"


def hierarchical_groups(config: TrainConfig, comm_config: CommConfig) -> dict[str, int]:
    """The run's groups of more than one rank that may run the hierarchical algorithm:
    {description: ranks per group}."""
    sizes = {DP: config.dp, TP: config.tp, PP: config.pp}
    names = set()
    if config.algorithm == HIERARCHICAL:
        names |= {DP, TP}
    if HIERARCHICAL in comm_config.algorithms.values():
        names |= {DP, TP, PP, WORLD}
    groups = {}
    for name in (WORLD, DP, TP, PP):
        size = config.world_size if name == WORLD else sizes[name]
        if name in names and size > 1:
            groups["the world" if name == WORLD else f"the {name} groups ({name}={size})"] = size  # what: ranks
    return groups


def comm_environment_problems(config: TrainConfig, comm_config: CommConfig) -> tuple[list[str], list[str]]:
    """(problems, warnings) of ``comm_config`` (the CLI's, from PLAIT_*) for this run;
    see the module docstring."""
    problems, warnings = [], []
    variable = ENVIRONMENT["hierarchy"]
    spec = comm_config.hierarchy
    groups = hierarchical_groups(config, comm_config)
    if isinstance(spec, str) and spec.strip():
        nranks = hierarchy_ranks(spec, variable)
        wrong = {what: size for what, size in groups.items() if size != nranks}
        if wrong:
            sizes = sorted(set(groups.values()))
            unset = f"unset {variable} (each group is then split by the ranks per node)"
            fix = (f"set {variable} to a hierarchy of {sizes[0]} ranks (e.g. {_example(sizes[0])}) or {unset}"
                   if len(sizes) == 1 else f"no one hierarchy fits groups of {' and '.join(map(str, sizes))} ranks: "
                   f"{unset}")
            problems.append(f"{variable}={spec!r} names {nranks} ranks, but the hierarchical algorithm runs on "
                            + ", ".join(f"{what} of {size} ranks" for what, size in wrong.items()) + f"; {fix}")
        elif not groups:
            warnings.append(f"{variable}={spec!r} is set, but no group of this run uses the hierarchical algorithm "
                            f"(--algorithm hierarchical, or {ENVIRONMENT['algorithms']}=all_reduce=hierarchical): "
                            "it is ignored")
    topology_only = sorted(f"{collective}={algorithm}" for collective, algorithm in comm_config.algorithms.items()
                           if algorithm in TOPOLOGY_ALGORITHMS)
    if topology_only:
        problems.append(f"{ENVIRONMENT['algorithms']}: {', '.join(topology_only)} is built from the cluster's "
                        "topology, which plait train does not give its groups: choose another algorithm")
    default_timeout_s = CommConfig().timeout_s
    if comm_config.timeout_s not in (default_timeout_s, config.timeout_s):
        problems.append(f"{ENVIRONMENT['timeout_s']}={comm_config.timeout_s:g} would be ignored: plait train's "
                        f"collectives wait timeout_s (--timeout-s, now {config.timeout_s:g}); pass --timeout-s "
                        f"{comm_config.timeout_s:g} and unset {ENVIRONMENT['timeout_s']}")
    return problems, warnings


def fault_kill_problems(spec: str | None, config: TrainConfig) -> list[str]:
    """Problems of the test hook PLAIT_FAULT_KILL (``spec``, the variable's text or None)
    for this run: "RANK:STEP", two ints, RANK one of the run's ranks, STEP >= 0. A
    malformed one failed in every rank after the world started (ValueError: invalid
    literal for int(), naming no variable); one naming no rank would never fire."""
    if spec is None or not spec.strip():
        return []
    parts = spec.split(":")
    try:
        rank, step = (int(part) for part in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        rank, step = None, None
    if rank is None or step < 0:
        return [f"{FAULT_ENV}={spec!r} must be RANK:STEP, two ints (the rank that kills itself before step STEP >= 0 "
                f"on its first attempt, a test hook), e.g. {FAULT_ENV}=1:3; or unset it"]
    if not 0 <= rank < config.world_size:
        return [f"{FAULT_ENV}={spec!r} names rank {rank}, but this run has ranks 0..{config.world_size - 1}: name "
                f"one of them, or unset {FAULT_ENV}"]
    return []


def _example(nranks: int) -> str:
    """A two-level hierarchy of ``nranks`` (groups of the smallest factor > 1), or flat."""
    inner = next((size for size in range(2, nranks) if nranks % size == 0), None)
    return f"'{nranks // inner}x{inner}'" if inner else f"'{nranks}'"


__all__ = ["comm_environment_problems", "fault_kill_problems", "hierarchical_groups"]
