"""One Communicator per process group: its configuration, its own comm thread and call
counter, its transport and its counters.

Groups progress independently, as in torch: a collective on one group never waits
for another group's queue, so any threads may call on any groups in any
interleaving that torch.distributed completes (calls on one group in the same order
on all its ranks, as torch requires).

A communicator is created by all ranks of its group together: the creation is one
small exchange with the group's rank 0 that checks every rank asks for the same
``CommConfig`` (what shapes the messages) and names the ranks that never came
(rather than leaving the first collective to time out). It runs as the first job of
the group's comm thread: creating communicators never blocks the caller, so groups
first used in different orders on different ranks cannot deadlock; its failure fails
the group's calls, naming it.

Which communicator a ``group=`` means (:func:`communicator_for`, the one resolver that
collectives, p2p and the parallel wrappers use): a Communicator is itself; a process
group (None: the world) means *its* communicator, the one ``init_communicator(group,
config)`` made, or, when it has none yet, one created on its first use with the
program's stated config: the config the world's communicator was created with
(``init_communicator(None, config)`` once, at the top of the program, states it for
every group; without it, ``CommConfig()``). A group inherits everything but the
fields that describe the world's own ranks (``hierarchy``, ``topology``). Every rank
of a group makes that first call, so every rank creates it with the same config.
A torch ``DeviceMesh`` of one dimension (``init_device_mesh("cpu", (4,))``, or one
named dimension of a larger mesh, ``mesh["dp"]``) means its process group
(``mesh.get_group()``), so it resolves to the very communicator that group has; a mesh
of several dimensions is refused by name (which dimension is meant?), and so is
plait's own ``plait.parallel.mesh.DeviceMesh`` (one group per axis: ``mesh.group["dp"]``).
"""

from __future__ import annotations

import atexit
import threading
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait.comm import tags
from plait.comm.config import CommConfig
from plait.comm.engine import Engine, Handle, Stats
from plait.comm.errors import CommTimeoutError, MismatchError
from plait.comm.executor import Executor
from plait.comm.shm_setup import establish
from plait.comm.transport import Transport

CREATE_TAG = tags.CREATE
CREATE_REPLY_TAG = tags.CREATE_REPLY


def _require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "plait.comm needs a process group: call torch.distributed.init_process_group(...) first "
            "(or launch with torchrun / plait.testing)"
        )


def group_ranks(group) -> list[int]:
    """The global ranks of ``group`` in group-rank order."""
    if group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


class Communicator:
    """The collectives of one process group on this rank.

    ``config``: a frozen :class:`CommConfig`. ``rank``/``size``: this rank in the group
    and the group's size. ``stats()``: per collective calls, bytes, messages, time and
    algorithms; ``transport.bytes_sent``: the bytes handed to torch.distributed (headers
    included), counted independently of the schedules.
    """

    def __init__(self, group=None, config: CommConfig | None = None):
        _require_initialized()
        if isinstance(group, Communicator):
            raise TypeError("Communicator(group=...) takes a process group, not a Communicator")
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError(f"this rank (global rank {dist.get_rank()}) is not a member of the group it was given "
                             f"(global ranks {group_ranks(self.group)})")
        self.size = dist.get_world_size(self.group)
        self.ranks = group_ranks(self.group)
        self.config = CommConfig() if config is None else config
        if not isinstance(self.config, CommConfig):
            raise TypeError(f"config must be a plait.comm.CommConfig, got {type(self.config).__name__}")
        self.backend = str(dist.get_backend(self.group))
        self.transport = Transport(self.group)
        if self.size == 1:
            self.transport.description = "none (a group of one rank sends nothing)"
        self.executor = Executor()
        self.call_plans: dict[tuple, tuple] = {}  # what earlier calls derived (plait.comm.collectives._launch)
        self.engine = Engine(name=f"plait-comm{self.ranks if len(self.ranks) <= 8 else ''}")
        self._stats = Stats()
        self.submit = self.engine.submit
        self.known_calls = self.engine.known_calls
        self.tuner_used = None  # the tuner's source, once algorithm="auto" consulted it
        # the creation exchange is the group's first job on its own comm thread, so a rank
        # creating communicators for several groups in any order never waits here
        self.created = self.engine.submit(self._create if self.size > 1 else (lambda: None),
                                          f"creating the communicator of the {self.describe()}", async_op=True)

    def describe(self) -> str:
        return f"group of global ranks {self.ranks}" if len(self.ranks) <= 16 else f"group of {self.size} ranks"

    # ----- creation ------------------------------------------------------------------------
    def _create(self) -> None:
        self._agree()
        if self.config.transport != "gloo" and "gloo" in self.backend.lower():
            self.transport.use_shm(establish(
                self.transport, self.rank, self.size, directory=self.config.shm_dir,
                ring_bytes=self.config.shm_ring_bytes, spin_s=self.config.shm_spin_us * 1e-6,
                spin_max_s=self.config.shm_spin_max_us * 1e-6, required=self.config.transport == "shm", timeout_s=self.config.timeout_s))

    def _agree(self) -> None:
        """Every rank sends its config key to group rank 0, which waits for all of them
        (one deadline) and answers each: all here and agreeing, or who differs / who
        never came. Tags of their own, so it cannot meet other traffic."""
        key = zlib.crc32(repr(self.config.agreement_key()).encode())  # the same on every process
        timeout_s = self.config.timeout_s
        deadline = time.monotonic() + timeout_s
        mine = torch.tensor([key, self.rank], dtype=torch.int64)
        where = f"creating the communicator of the {self.describe()}"
        if self.rank != 0:
            sent = self.transport.send(mine, 0, CREATE_TAG)
            reply = torch.zeros(2 + self.size, dtype=torch.int64)
            work = self.transport.recv(reply, 0, CREATE_REPLY_TAG)
            # rank 0 answers by its own deadline: wait for its answer twice as long
            self._wait_create(work, deadline + timeout_s, 2 * timeout_s, where, 0,
                              "group rank 0 never answered: has it created this communicator (its first collective "
                              "on this group, or init_communicator) yet?")
            sent.wait()  # answered, so delivered
            self._raise_create(reply.tolist(), where)
            return
        rows = {0: key}
        works = {}
        for peer in range(1, self.size):
            buffer = torch.zeros(2, dtype=torch.int64)
            works[peer] = (buffer, self.transport.recv(buffer, peer, CREATE_TAG))
        # each receive is waited for on a thread of its own, without a gloo timeout: one
        # would close the connections over which the ranks that came are told who is missing
        arrived: dict[int, threading.Event] = {peer: threading.Event() for peer in works}

        def wait_for(peer):
            try:
                works[peer][1].wait()
                arrived[peer].set()
            except RuntimeError:
                pass

        for peer in works:
            threading.Thread(target=wait_for, args=(peer,), daemon=True, name=f"plait-create-{peer}").start()
        for peer, event in arrived.items():
            if event.wait(max(deadline - time.monotonic(), 0.0)):
                rows[peer] = int(works[peer][0][0])
        missing = sorted(peer for peer, event in arrived.items() if not event.is_set())
        differ = [peer for peer, value in rows.items() if value != key]
        status = 2 if missing else (1 if differ else 0)
        listed = missing if missing else differ
        reply = torch.tensor([status, len(listed)] + listed + [0] * (self.size - len(listed)), dtype=torch.int64)
        for peer in rows:
            if peer != 0:
                try:
                    self.transport.send_detached(reply, peer, CREATE_REPLY_TAG)
                except RuntimeError:
                    pass  # that rank is gone since it checked in; it will not need the answer
        self._raise_create(reply.tolist(), where)

    def _wait_create(self, work, deadline, timeout_s, where, peer, reason):
        try:
            work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as error:
            raise CommTimeoutError(timeout_s=timeout_s, rank=self.rank, collective=where, algorithm="-",
                                   step="create", peer=self.transport.describe(peer), reason=reason) from error

    def _raise_create(self, reply, where):
        status, count = reply[0], reply[1]
        listed = [self.transport.describe(peer) for peer in reply[2 : 2 + count]]
        if status == 2:
            raise CommTimeoutError(timeout_s=self.config.timeout_s, rank=self.rank, collective=where, algorithm="-",
                                   step="create", peer=", ".join(listed),
                                   reason=f"group ranks {', '.join(listed)} never created their communicator")
        if status == 1:
            raise MismatchError(  # the group cannot run calls with these configs: it stays broken
                f"{where}: group ranks {', '.join(listed)} asked for a different CommConfig from group rank 0's (check mode, "
                f"segment sizes, hierarchy or algorithm overrides); this rank {self.rank}: "
                f"{self.config.describe()}. Every rank of a group must pass the same configuration")

    # ----- running calls -------------------------------------------------------------------
    # ``submit(job, description, async_op, signature)``: queue or run ``job(seq)`` (seq: its
    # number among the group's calls, given when it starts) in program order; returns None
    # or a Handle. ``known_calls()``: this rank's recent calls and the ones queued after the
    # running one, by call number (for naming calls issued in different orders). Both are
    # the comm thread's own (bound in __init__: no frame of this class on the call path).

    def enqueue(self, job, description: str) -> Handle:
        """Run ``job()`` on this group's comm thread after every collective queued before
        it, and return its Handle at once (``handle.result`` is what it returned).

        For composite communication (compress, all-gather, decompress) that must stay
        in program order with the group's other collectives: collectives on this group
        that the job calls run inline on the comm thread. Every rank must enqueue the
        same jobs in the same order."""
        return self.engine.submit(job, description, async_op=True)

    def synchronize(self) -> None:
        """Wait for every collective queued on this group; re-raise the first failure
        among them that no handle's wait() raised."""
        self.engine.synchronize()

    def record(self, collective: str, algorithm: str, bytes_sent: int, messages: int, time_s: float) -> None:
        self._stats.record(collective, algorithm, bytes_sent, messages, time_s)

    def close(self) -> None:
        """Run what is queued (up to the timeout), then stop the comm thread and let go
        of the process group; later calls on this communicator raise. Called by
        ``plait.comm.destroy_process_group`` before torch destroys the group."""
        stopped = self.engine.close(f"the communicator of the {self.describe()} was closed (its process group was "
                                    "destroyed); a new group gets a new communicator", self.config.timeout_s)
        if stopped:  # a job still running keeps using the group: leave it to the job
            self.transport.close(self.config.timeout_s)
            self.group = None

    def stats(self) -> dict[str, dict]:
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()


# ----- which communicator a group= means ------------------------------------------------------
class _Registry:
    """The communicator of each process group of this process (created on first use
    with the stated config, or by init_communicator). Holds the group objects, so an id
    is never reused."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_group: dict[int, tuple[object, Communicator]] = {}

    def get(self, group) -> Communicator:
        with self._lock:  # creating one is local: its exchange with the peers is queued on its thread
            entry = self._by_group.get(id(group))
            if entry is None or entry[0] is not group:
                entry = (group, Communicator(group, self._stated_config(group)))
                self._by_group[id(group)] = entry
            return entry[1]

    def _stated_config(self, group) -> CommConfig:
        """The config a group without a communicator gets (see the module docstring):
        the world communicator's, less what names the world's own ranks; else the
        defaults. Called with the lock held."""
        world = self._by_group.get(id(dist.group.WORLD))
        if world is None or world[0] is not dist.group.WORLD:
            return CommConfig()
        config = world[1].config
        return config if group is dist.group.WORLD else config.replace(hierarchy=None, topology=None)

    def stated_config(self, group) -> CommConfig:
        """The config ``group``'s communicator has, or would be created with (without
        creating one: p2p, which is pairwise, reads its deadline here)."""
        with self._lock:
            entry = self._by_group.get(id(group))
            if entry is not None and entry[0] is group:
                return entry[1].config
            return self._stated_config(group)

    def create(self, group, config) -> Communicator:
        old = self.lookup(group)
        if old is not None:
            old.synchronize()
        communicator = Communicator(group, config)
        communicator.created.wait()  # raises what the creation exchange found
        with self._lock:
            self._by_group[id(group)] = (group, communicator)
        return communicator

    def lookup(self, group) -> Communicator | None:
        with self._lock:
            entry = self._by_group.get(id(group))
        return entry[1] if entry is not None and entry[0] is group else None

    def release(self, group=None) -> None:
        """Close and forget the communicator of ``group`` (None: every one), so nothing
        here keeps its process group alive once torch destroys it."""
        with self._lock:
            if group is None:
                released = [communicator for _, communicator in self._by_group.values()]
                self._by_group.clear()
            else:
                entry = self._by_group.get(id(group))
                released = [entry[1]] if entry is not None and entry[0] is group else []
                if released:
                    del self._by_group[id(group)]
        for communicator in released:
            communicator.close()

    def all(self) -> list[Communicator]:
        with self._lock:
            return [communicator for _, communicator in self._by_group.values()]


REGISTRY = _Registry()


def _is_plait_mesh(group) -> bool:
    """plait's own ``plait.parallel.mesh.DeviceMesh`` (comm/ does not import parallel/:
    known by its shape, a ``dims`` and a dict of one process group per axis)."""
    return hasattr(group, "dims") and isinstance(getattr(group, "group", None), dict)


def _mesh_group(mesh: DeviceMesh):
    """The process group of a 1-D torch DeviceMesh (``NON_GROUP_MEMBER`` on a rank
    outside it, as ``new_group`` gives there), or a TypeError naming a mesh of more
    dimensions and the fix."""
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names
        fix = (f"pass one dimension, e.g. mesh[{names[0]!r}]" if names else
               "pass one dimension's process group, e.g. mesh.get_group(0), or name the dimensions "
               "(init_device_mesh(..., mesh_dim_names=...)) and pass mesh['name']")
        dims = f" with dims {tuple(names)!r}" if names else f" of shape {tuple(mesh.shape)}"
        raise TypeError(f"group={mesh!r} is a {mesh.ndim}-D DeviceMesh{dims}: a group= is one dimension of it; {fix}")
    if mesh.get_coordinate() is None:
        return dist.GroupMember.NON_GROUP_MEMBER
    return mesh.get_group()


def check_group(group) -> None:
    """A TypeError naming ``group=`` when it is none of what it may be: None (the world),
    a torch ProcessGroup, a 1-D torch DeviceMesh (or ``mesh["dp"]`` of a larger one) or a
    plait Communicator (a name, a list of ranks, a number, a mesh of several dimensions
    or plait's own per-axis mesh is not a group: torch's own message for one is an
    unrelated "not registered")."""
    if group is None or isinstance(group, (Communicator, dist.ProcessGroup)):
        return
    if isinstance(group, DeviceMesh):
        _mesh_group(group)  # a mesh of several dimensions is refused, naming them
        return
    if group == dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on a rank outside it
        return
    hint = ""
    if isinstance(group, (list, tuple)) and any(isinstance(item, DeviceMesh) for item in group):
        hint = (": a (mesh, dim) pair is torch's functional-collective spelling; pass the dimension itself, "
                "e.g. mesh['dp'] (or mesh.get_group(dim))")
    elif isinstance(group, (list, tuple)):
        hint = f": make one with torch.distributed.new_group({list(group)!r})"
    elif _is_plait_mesh(group):
        axes = ", ".join(repr(axis) for axis in group.group)
        raise TypeError(f"group= is a plait.parallel.mesh.DeviceMesh ({type(group).__name__}, one process group per "
                        f"axis {axes}): pass one axis's group, e.g. mesh.group['dp']")
    raise TypeError(f"group={group!r} ({type(group).__name__}) is not a process group; pass None (the world), a "
                    f"torch.distributed ProcessGroup, a 1-D torch DeviceMesh (or mesh['dp'] of a larger one) or a "
                    f"plait Communicator{hint}")


def process_group(group):
    """torch's ProcessGroup behind ``group=`` (checked: :func:`check_group`): a
    Communicator's group, a 1-D DeviceMesh's ``get_group()``; None and a process group
    stay as they are. For what torch's own calls take (``all_gather_object``,
    ``get_rank``), where plait's go through :func:`communicator_for`."""
    check_group(group)
    if isinstance(group, Communicator):
        return group.group
    if isinstance(group, DeviceMesh):
        return _mesh_group(group)
    return group


def communicator_for(group) -> Communicator | None:
    """The communicator ``group=`` means (the one resolver; see the module docstring):
    a Communicator itself; None (the world), a process group or a 1-D DeviceMesh (its
    process group): its communicator, created on first use with the program's stated
    config (the world communicator's, from ``init_communicator(None, config)``) when it
    has none; None when this rank is not in the group (the call is then a no-op, as in
    torch). A TypeError names a ``group=`` that is none of these."""
    if isinstance(group, Communicator):
        return group
    if group is None:  # the world (every rank is a member): the common case, in the fewest calls
        _require_initialized()
        return REGISTRY.get(dist.group.WORLD)
    group = process_group(group)
    _require_initialized()
    group = dist.group.WORLD if group is None else group
    if group == dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        return None
    return REGISTRY.get(group)


def init_communicator(group=None, config: CommConfig | None = None) -> Communicator:
    """Create the communicator of ``group`` (None: the world) with ``config`` (None:
    ``CommConfig()``); every rank of the group must call it. It replaces the group's
    earlier one (after its queued collectives finish), so the collectives' ``group=``
    then use this configuration; a wrapper built before keeps the one it was given.

    The world's config is the program's stated config: call ``init_communicator(None,
    config)`` once at the top of the program, before any group is used, and every group
    without a communicator of its own is created with it on first use (less
    ``hierarchy`` and ``topology``, which name the world's ranks)."""
    _require_initialized()
    if isinstance(group, DeviceMesh):
        group = _mesh_group(group)  # its process group's communicator
    group = dist.group.WORLD if group is None else group
    return REGISTRY.create(group, config)


def all_communicators() -> list[Communicator]:
    return REGISTRY.all()


def destroy_process_group(group=None) -> None:
    """``torch.distributed.destroy_process_group(group)``, closing plait's communicator
    of that group first (None: every group and the world, as in torch): its queued
    collectives finish, its comm thread stops, and nothing keeps the group alive.

    Call this (not torch's directly) once a group plait used is done with: a group
    still referenced when the interpreter exits keeps gloo's worker threads running
    into Python's shutdown. Communicators left at exit are released by an atexit hook."""
    if isinstance(group, Communicator):
        group = group.group
    REGISTRY.release(group)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group(group)


atexit.register(REGISTRY.release)  # communicators of groups the program destroyed with torch's own call


__all__ = ["Communicator", "all_communicators", "communicator_for", "destroy_process_group", "group_ranks",
           "init_communicator", "process_group"]
