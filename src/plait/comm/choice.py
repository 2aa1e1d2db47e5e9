"""Which algorithm a collective call runs: the measured default table per transport,
``algorithm="auto"`` (the configuration's override, else its tuner, else the table),
and the choice made again once a group's set-up has said whether the whole group
talks through shared memory."""

from __future__ import annotations

from plait.comm.algorithms import DEFAULT_NAMES, TORCH, builder
from plait.comm.communicator import Communicator
from plait.names.transports import GLOO, SHM


def default_algorithm(collective: str, nbytes: int, world_size: int, transport: str = GLOO) -> str:
    """The default table, used by algorithm="auto" when there is no calibrated profile.

    Small messages are latency-bound, so they take the fewest rounds: on this
    machine kind (gloo over loopback, more ranks than cores) a round costs about a
    millisecond, and the star's two rounds, where only the root does work, beat
    everything up to p = 4; beyond that the server's link grows with p and
    recursive doubling's lg p rounds win. Large messages take the
    bandwidth-optimal ring. Measured with ``plait bench`` (see the README).

    ``transport="shm"`` (the whole group on one host, through shared memory): the
    same, except broadcast and reduce take the binomial tree at every size, and the
    all-reduce's star reaches 2 MiB. A ring pipelines a large message through p - 1
    hops, each a copy into and out of a ring buffer on cores the ranks share; the
    tree's lg p rounds copy less and won from 512 KiB up at p = 4 (``plait bench
    broadcast -a all --transport shm``); at p = 4 the star (2.9 ms) and the tree
    (2.7 ms) beat the ring (3.3 ms) on a 2 MiB all-reduce, the ring wins from 4 MiB
    (median of 3 rounds, ``plait bench all_reduce -n 4 -b 1M``).
    """
    p = world_size
    if transport == SHM and collective in ("broadcast", "reduce"):
        return "tree"
    if transport == SHM and collective == "all_reduce" and nbytes <= (2 << 20):
        return "star" if p <= 4 else "recursive_doubling"
    small = nbytes <= 512 * 1024
    if collective == "all_reduce":
        if nbytes <= (1 << 20):
            return "star" if p <= 4 else "recursive_doubling"
        return "ring"
    if collective == "reduce_scatter":
        return "direct" if small and p <= 8 else "ring"
    if collective == "all_gather":
        return "bruck" if small else "ring"
    if collective in ("broadcast", "reduce"):
        return "tree" if small else "ring"
    if collective in ("gather", "scatter"):
        return "direct" if p <= 8 else "tree"
    if collective == "all_to_all":
        return "direct" if p <= 8 else "pairwise"
    return "bruck"  # barrier: dissemination


def auto_algorithm(collective: str, nbytes: int, world_size: int, config=None, transport: str = GLOO) -> str:
    """What algorithm="auto" runs under ``config`` (a CommConfig; None: the defaults):
    its override for the collective, else its tuner's choice, else the default table
    of ``transport`` ("shm" when the whole group talks through shared memory)."""
    if config is not None:
        override = config.algorithms.get(collective)
        if override:
            return override
        if config.tuner is not None:
            return config.tuner.choose(collective, nbytes, world_size)
    return default_algorithm(collective, nbytes, world_size, transport)


def transport_kind(communicator: Communicator) -> str:
    """"shm" when every other rank of the group is reached through shared memory, else
    "gloo" (the same answer on every rank: the set-up decides for the whole group)."""
    return SHM if communicator.transport.all_peers_local(communicator.size) else GLOO


def table_pending(algorithm, collective: str, communicator: Communicator) -> bool:
    """True when ``algorithm`` comes from a default table that depends on the group's
    transport and the group's set-up has not finished: the choice is then made again
    on the group's comm thread, after the set-up (its first job), by settled_algorithm."""
    config = communicator.config
    return (algorithm in DEFAULT_NAMES and not config.algorithms.get(collective) and config.tuner is None
            and not communicator.created.is_completed())


def settled_algorithm(collective: str, nbytes: int, communicator: Communicator) -> str:
    """The table's choice once the set-up has said which transport the whole group uses
    (every rank gets the same answer)."""
    return default_algorithm(collective, nbytes, communicator.size, transport_kind(communicator))


def resolve_algorithm(algorithm, collective: str, nbytes: int, communicator: Communicator) -> str:
    if algorithm in DEFAULT_NAMES:
        config = communicator.config
        if config.tuner is not None and collective not in config.algorithms:
            communicator.tuner_used = getattr(config.tuner, "source", "a tuner")
        # provisional while the group's set-up runs (see settled_algorithm); never wait for
        # it here: groups first used in different orders on different ranks would deadlock
        return auto_algorithm(collective, nbytes, communicator.size, config, transport_kind(communicator))
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, got {type(algorithm).__name__}")
    if algorithm != TORCH:
        builder(collective, algorithm)  # raises listing the valid names
    return algorithm
