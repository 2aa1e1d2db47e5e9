"""plait's collectives: torch.distributed's signatures plus ``algorithm=``.

The life of an all_reduce. ``all_reduce(t, op, group, async_op, algorithm=...)``:

1. finds the group's :class:`~plait.comm.communicator.Communicator` (``group=None``:
   the world; a Communicator may be passed as the group), whose frozen ``CommConfig``
   holds the deadline, check mode, segment sizes and algorithm choice;
2. checks this rank's arguments as torch does (dtype, op, sizes) and resolves
   ``algorithm`` ("auto": the config's override, else its tuner, else the measured
   default table, ``plait.comm.choice``); a call like an earlier one on the group (same
   collective, algorithm argument, dtype, elements, device, op, root) reuses what that
   one derived (``Communicator.call_plans``) and only prepares its buffer;
3. lays the tensors out in one flat buffer (``plait.comm.layout``; a view of ``t``
   when it is contiguous, so results land in place);
4. submits a job to the communicator's own comm thread (inline when nothing is queued
   on the group and ``async_op`` is False), which numbers the call on the group;
5. the job builds the algorithm's schedule (``plait.comm.algorithms``: plain data,
   cached) and runs this rank's part of it with the executor
   (``plait.comm.executor``): a small call (at most ``INLINE_BYTES``) in lock step from
   a cached step list (``run_small``); a larger one over gloo as a dataflow of single
   messages; each first message to a peer carries the in-band header
   (``plait.comm.inband``) that the peer checks against its own call; over NCCL as
   one grouped post per step;
6. copies results back if the buffer was not a view, records the call's bytes,
   messages, time and algorithm, and completes the Handle.

``algorithm="torch"`` runs torch.distributed's own collective through the same comm
thread, so plait and torch calls on a group stay in program order.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.comm import layout
from plait.comm.agreement import REFUSED_ROOT, carried_payload_bytes, code as agreement_code, exchange
from plait.comm.algorithms import (DEFAULT_NAMES, REDUCING, ROOTED, TOPOLOGY_ALGORITHMS, TORCH, build_schedule,
                                   checked_topology_fingerprint)
from plait.comm.algorithms.hierarchical import parse_hierarchy
from plait.comm.choice import resolve_algorithm, settled_algorithm, table_pending
from plait.comm.communicator import Communicator, all_communicators, communicator_for, process_group
from plait.comm.engine import merge_stats
from plait.comm.errors import CommError, CommTimeoutError, MismatchError
from plait.comm.inband import INLINE_BYTES, CallSignature, InbandCall
from plait.comm.ops import COMBINE, check_carried, check_reducible, op_name
from plait.comm.transport import stages_through_host, stream_segment_bytes
from plait.cost.alpha_beta import pipeline_segments

ReduceOp = dist.ReduceOp

_CALL_PLANS = 256  # derived calls kept per communicator (_launch)

_TORCH_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "min": ReduceOp.MIN, "max": ReduceOp.MAX,
              "prod": ReduceOp.PRODUCT, "band": ReduceOp.BAND, "bor": ReduceOp.BOR, "bxor": ReduceOp.BXOR}


def _carried_signature(signature: CallSignature, carried: int | None) -> CallSignature:
    """A carried call says so in its agreement ("bruck": what runs), so a rank that named
    the algorithm (not carried) against one that did not is a named mismatch, not a rank
    waiting for a schedule its peer never runs."""
    return signature if carried is None else dataclasses.replace(signature, algorithm="bruck")


def _grouped(tensor) -> bool:
    return tensor.device.type != "cpu"


def _torch_wait(work, collective: str, communicator: Communicator) -> None:
    """Wait for torch's own collective with plait's deadline, naming what hung."""
    if work is None:
        return
    timeout_s = communicator.config.timeout_s
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        kwargs = dict(rank=communicator.rank, collective=collective, algorithm=TORCH, step="torch", peer="?",
                      reason=reason)
        if "timed out" in reason.lower() or "timeout" in reason.lower():
            raise CommTimeoutError(timeout_s=timeout_s, **kwargs) from error
        raise CommError(**kwargs) from error


def default_device(group=None):
    """Where a collective's own small tensors go (a barrier's token, an agreement
    check): the current GPU for NCCL, else the CPU."""
    group = process_group(group)  # a Communicator's or a 1-D DeviceMesh's process group
    if group is None:
        group = dist.group.WORLD
    return torch.device("cuda") if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")


def _launch(collective, communicator, async_op, algorithm, prepare, *, tensor, nbytes, op="none", root=None,
            torch_call=None, hierarchy=None, check_numel=None, output=None):
    """Common path of every collective; returns None or a Handle.

    ``tensor`` is the rank's data tensor (its elements, dtype and device go into the
    check), ``nbytes`` the collective's size as nccl-tests counts it (it picks the
    default algorithm). ``prepare(rank, p)`` validates and lays out plait's buffer;
    ``torch_call(communicator)`` runs torch's collective and waits with ``_torch_wait``.
    ``output``: what the Handle's ``get_future()`` holds (the list torch's future would).
    """
    if communicator is None:
        return None  # this rank is not in the group, as torch does
    rank, p, config = communicator.rank, communicator.size, communicator.config
    dtype = tensor.dtype
    # a call like an earlier one (same arguments, dtype, size, device) takes what that one
    # derived (checks passed, algorithm, signature): only its buffer is prepared again
    key = (collective, algorithm, dtype, tensor.numel(), tensor.device, nbytes, op, root, check_numel)
    known = communicator.call_plans.get(key) if hierarchy is None and (algorithm is None or type(algorithm) is str) \
        else None
    if known is not None:
        algorithm, signature, description, staged, grouped, check = known
        prepared = prepare(rank, p) if algorithm != TORCH else None
        return _submit(collective, communicator, async_op, algorithm, signature, description, prepared, staged,
                       grouped, check, nbytes, op, root, torch_call, output, tensor.device)
    check_carried(dtype, collective)  # refused by name before any message (plait.names.wire)
    if collective in REDUCING:
        check_reducible(dtype, op, collective)
    pending = table_pending(algorithm, collective, communicator)
    chosen_by_plait = algorithm in DEFAULT_NAMES  # the user named none: a small rooted call may carry its payload
    algorithm = resolve_algorithm(algorithm, collective, nbytes, communicator)
    if algorithm == TORCH and p > 1 and "gloo" in str(dist.get_backend(communicator.group)):
        check_carried(dtype, collective, torch_gloo=True)  # gloo's own collectives take fewer dtypes
    # a tensor on a GPU over gloo travels through a host copy (gloo moves CPU memory)
    staged = p > 1 and stages_through_host(communicator.group, tensor.device)
    grouped = _grouped(tensor) and not staged
    check = "off" if p == 1 else ("deep" if config.check == "inband" and grouped else config.check)
    # A rooted call's ranks agree on the root before any data moves: with different roots,
    # ranks that each take themselves for the root would only send (a broadcast, a scatter)
    # and return with different data, or only receive (a reduce, a gather) until the
    # deadline, and no in-band header would ever be compared
    agree_first = check == "inband" and collective in ROOTED
    refused = None  # this rank's own arguments, refused: a rooted call still tells its peers
    try:
        prepared = prepare(rank, p) if algorithm != TORCH or agree_first else None  # validates them now
    except (ValueError, TypeError) as error:
        if not agree_first:
            raise
        prepared, refused = None, error
    carried = None
    if agree_first and chosen_by_plait and algorithm != TORCH:  # the same answer on every rank that agrees
        carried = carried_payload_bytes(collective, tensor.numel() * tensor.element_size(), p)
    tree = shape = None
    if algorithm == "hierarchical":
        spec = hierarchy if hierarchy is not None else config.hierarchy
        if spec is None and config.topology is not None and config.topology.world_size == p:
            spec = config.topology.hierarchy()  # the group's hosts, as its topology has them
        world = communicator.group is dist.group.WORLD
        tree = parse_hierarchy(spec, p, config.local_world_size if world else 1)
        shape = repr(tree)
    elif algorithm in TOPOLOGY_ALGORITHMS and prepared is not None:
        # refused now (no topology, or one for another group size), not inside the job. The
        # schedule is built here (the job finds it cached) and its digest checked with the
        # arguments: ranks whose solves differ (a synthesis stopped by its clock on one rank
        # only) are named instead of exchanging mismatched messages
        fingerprint = checked_topology_fingerprint(config.topology, algorithm, p)
        schedule = build_schedule(collective, algorithm, p, prepared.numel, root,
                                  pipeline_segments(nbytes, config.pipeline_segment_bytes), None, config.topology)
        shape = f"{fingerprint}:{schedule.digest()}"
    signature = CallSignature(collective, algorithm, tensor.numel() if check_numel is None else check_numel, dtype,
                              op, REFUSED_ROOT if refused is not None else root,
                              0 if shape is None else agreement_code(shape), config.segment_bytes,
                              config.pipeline_segment_bytes)
    description = signature.describe()
    if not (pending or agree_first or refused or carried or shape) and hierarchy is None and (
            key[1] is None or type(key[1]) is str):
        if len(communicator.call_plans) >= _CALL_PLANS:
            communicator.call_plans.clear()
        communicator.call_plans[key] = (algorithm, signature, description, staged, grouped, check)
    return _submit(collective, communicator, async_op, algorithm, signature, description, prepared, staged, grouped,
                   check, nbytes, op, root, torch_call, output, tensor.device, pending=pending,
                   agree_first=agree_first, refused=refused, carried=carried, tree=tree)


def _submit(collective, communicator, async_op, algorithm, signature, description, prepared, staged, grouped, check,
            nbytes, op, root, torch_call, output, device, *, pending=False, agree_first=False, refused=None,
            carried=None, tree=None):
    """Submit the call's job (see the module docstring, steps 4-6) to the communicator's
    comm thread; returns None or a Handle."""
    rank, p, config = communicator.rank, communicator.size, communicator.config

    def job(seq):
        nonlocal algorithm, signature
        if pending:  # the set-up has finished now: it ran first on this thread
            settled = settled_algorithm(collective, nbytes, communicator)
            if settled != algorithm:
                algorithm, signature = settled, dataclasses.replace(signature, algorithm=settled)
        host_or_device = torch.device("cpu") if staged else device
        if refused is not None:  # the peers learn it from the exchange (and raise), then this rank raises
            try:
                exchange(communicator, _carried_signature(signature, carried), host_or_device, seq=seq,
                         carried=carried)
            except MismatchError:
                pass
            raise refused
        if check == "deep":
            exchange(communicator, signature, host_or_device)
        start = time.perf_counter()
        if algorithm == TORCH:
            if agree_first:
                exchange(communicator, signature, host_or_device, seq=seq)
            torch_call(communicator)  # waits with plait's deadline (_torch_wait)
            communicator.record(collective, TORCH, nbytes, 0, time.perf_counter() - start)
            return nbytes
        buffer = prepared.build()  # reads the inputs now, after earlier queued collectives
        device_buffer, buffer = (buffer, buffer.cpu()) if staged else (None, buffer)
        sent = messages = 0
        if agree_first:
            # the agreement first; a small broadcast, scatter or gather ends with it (its payload
            # rides in the exchange's blocks: plait.comm.agreement), the others run their schedule
            sent, messages = exchange(communicator, _carried_signature(signature, carried), buffer.device, seq=seq,
                                      carried=carried, buffer=buffer, root=root)
        if p > 1 and carried is None:
            segments = pipeline_segments(nbytes, config.pipeline_segment_bytes)
            schedule = build_schedule(collective, algorithm, p, prepared.numel, root, segments, tree,
                                      config.topology)
            transport = communicator.transport
            if check == "inband" and not agree_first:  # an agreed call's messages need no header
                small = buffer.numel() * buffer.element_size() <= INLINE_BYTES
                transport = InbandCall(transport, signature, seq, rank, collective, communicator.known_calls, small,
                                       buffers=communicator.executor.inband)
            segment_bytes = stream_segment_bytes(config, communicator.backend)  # a quarter ring at most on shm
            segment_numel = segment_bytes // buffer.element_size() if segment_bytes else 0
            combine = COMBINE[op if op != "none" else "sum"]
            if not grouped and buffer.numel() * buffer.element_size() <= INLINE_BYTES:  # latency-bound
                payload_sent, payload_messages = communicator.executor.run_small(
                    schedule, rank, transport, buffer, combine, timeout_s=config.timeout_s, label=collective,
                    segment_numel=segment_numel)
            else:
                payload_sent, payload_messages = communicator.executor.run(
                    schedule, rank, transport, buffer, combine, timeout_s=config.timeout_s, label=collective,
                    grouped=grouped, segment_numel=segment_numel)
            sent, messages = sent + payload_sent, messages + payload_messages
        prepared.finish(buffer)  # a staged call finishes (averages) on the host, as on a CPU
        if device_buffer is not None:
            device_buffer.copy_(buffer)
        # what ran: a carried call is the agreement's Bruck all-gather alone
        communicator.record(collective, "bruck" if carried is not None else algorithm, sent, messages,
                            time.perf_counter() - start)
        return sent

    handle = communicator.submit(job, description, async_op, signature)
    if handle is not None:
        handle.output = output
    return handle


# ----- the public collectives ------------------------------------------------------------
# ``group`` is a process group (None: the world) or a Communicator; torch's collective
# under algorithm="torch" runs on ``communicator.group``.
def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm=None, hierarchy=None):
    """All-reduce ``tensor`` in place across the group (see plait.comm.algorithms for
    each algorithm's steps and cost). ``hierarchy`` only matters for "hierarchical"."""
    layout.check_tensor(tensor, "tensor", "all_reduce")
    name = op_name(op)
    communicator = communicator_for(group)

    def torch_call(comm):
        data = tensor.detach()
        _torch_wait(dist.all_reduce(data, _TORCH_OPS[name], group=comm.group, async_op=True), "all_reduce", comm)
        if name == "avg":  # gloo has no AVG
            data.div_(comm.size)

    return _launch("all_reduce", communicator, async_op, algorithm,
                   lambda rank, p: layout.prepare_all_reduce(tensor, rank, p, name),
                   tensor=tensor, nbytes=_nbytes(tensor), op=name, torch_call=torch_call, hierarchy=hierarchy,
                   output=[tensor])


def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm=None):
    """Reduce ``input`` (p equal chunks) across ranks; rank r gets chunk r in ``output``."""
    layout.check_tensor(output, "output", "reduce_scatter")
    layout.check_tensor(input, "input", "reduce_scatter")
    name = op_name(op)
    communicator = communicator_for(group)

    def torch_call(comm):
        out = output.detach()
        work = dist.reduce_scatter_tensor(out, input.detach(), _TORCH_OPS[name], group=comm.group, async_op=True)
        _torch_wait(work, "reduce_scatter", comm)
        if name == "avg":
            out.div_(comm.size)

    return _launch("reduce_scatter", communicator, async_op, algorithm,
                   lambda rank, p: layout.prepare_reduce_scatter(output, input, rank, p, name),
                   tensor=input, nbytes=_nbytes(input), op=name, torch_call=torch_call, output=[output])


def all_gather_single(output, input, group=None, async_op=False, *, algorithm=None):
    """Gather every rank's ``input`` into ``output`` (p * input elements), rank order."""
    layout.check_tensor(output, "output", "all_gather")
    layout.check_tensor(input, "input", "all_gather")
    communicator = communicator_for(group)

    def torch_call(comm):
        work = dist.all_gather_into_tensor(output.detach(), input.detach(), group=comm.group, async_op=True)
        _torch_wait(work, "all_gather", comm)

    return _launch("all_gather", communicator, async_op, algorithm,
                   lambda rank, p: layout.prepare_all_gather(output, input, rank, p),
                   tensor=input, nbytes=_nbytes(output), torch_call=torch_call, output=[output])


reduce_scatter_tensor = reduce_scatter_single
all_gather_into_tensor = all_gather_single


def _rooted(collective, communicator, async_op, algorithm, root, prepare, torch_call, **kwargs):
    """Rooted collectives: ``root`` is the group rank (from torch's global ``src``/``dst``
    or ``group_src``/``group_dst``); torch's own call takes the global rank."""
    return _launch(collective, communicator, async_op, algorithm,
                   lambda rank, p: prepare(rank, p, root),
                   root=root, torch_call=lambda comm: torch_call(comm, comm.ranks[root]), **kwargs)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None, *, algorithm=None):
    """Copy ``tensor`` from rank ``src`` (a global rank, as in torch; or ``group_src``, a
    group rank; default global rank 0) to every rank."""
    layout.check_tensor(tensor, "tensor", "broadcast")
    communicator = communicator_for(group)
    if communicator is None:
        return None
    root = layout.group_root(communicator, src, group_src, "src")

    def torch_call(comm, global_root):
        _torch_wait(dist.broadcast(tensor.detach(), global_root, group=comm.group, async_op=True), "broadcast", comm)

    return _rooted("broadcast", communicator, async_op, algorithm, root,
                   lambda rank, p, root: layout.prepare_broadcast(tensor, rank, p, root),
                   torch_call, tensor=tensor, nbytes=_nbytes(tensor), output=[tensor])


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None, *, algorithm=None):
    """Reduce every rank's ``tensor`` into rank ``dst``'s (a global rank; or ``group_dst``;
    others are left unchanged)."""
    layout.check_tensor(tensor, "tensor", "reduce")
    name = op_name(op)
    communicator = communicator_for(group)
    if communicator is None:
        return None
    root = layout.group_root(communicator, dst, group_dst, "dst")

    def torch_call(comm, global_root):
        data = tensor.detach() if comm.rank == root else tensor.detach().clone()
        _torch_wait(dist.reduce(data, global_root, _TORCH_OPS[name], group=comm.group, async_op=True), "reduce", comm)
        if comm.rank == root and name == "avg":
            data.div_(comm.size)

    return _rooted("reduce", communicator, async_op, algorithm, root,
                   lambda rank, p, root: layout.prepare_reduce(tensor, rank, p, root, name),
                   torch_call, tensor=tensor, nbytes=_nbytes(tensor), op=name, output=[tensor])


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None, *, algorithm=None):
    """Gather every rank's ``tensor`` into ``gather_list`` on rank ``dst`` (global; or ``group_dst``)."""
    layout.check_tensor(tensor, "tensor", "gather")
    communicator = communicator_for(group)
    if communicator is None:
        return None
    root = layout.group_root(communicator, dst, group_dst, "dst")

    def torch_call(comm, global_root):
        targets = [t.detach() for t in gather_list] if comm.rank == root else None
        _torch_wait(dist.gather(tensor.detach(), targets, global_root, group=comm.group, async_op=True), "gather",
                    comm)

    return _rooted("gather", communicator, async_op, algorithm, root,
                   lambda rank, p, root: layout.prepare_gather(tensor, gather_list, rank, p, root),
                   torch_call, tensor=tensor, nbytes=_nbytes(tensor) * communicator.size,
                   output=list(gather_list or []))


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None, *, algorithm=None):
    """Rank ``src`` (global; or ``group_src``) sends ``scatter_list[r]`` to rank r, which
    receives it in ``tensor``."""
    layout.check_tensor(tensor, "tensor", "scatter")
    communicator = communicator_for(group)
    if communicator is None:
        return None
    root = layout.group_root(communicator, src, group_src, "src")

    def torch_call(comm, global_root):
        sources = [t.detach() for t in scatter_list] if comm.rank == root else None
        _torch_wait(dist.scatter(tensor.detach(), sources, global_root, group=comm.group, async_op=True), "scatter",
                    comm)

    return _rooted("scatter", communicator, async_op, algorithm, root,
                   lambda rank, p, root: layout.prepare_scatter(tensor, scatter_list, rank, p, root),
                   torch_call, tensor=tensor, nbytes=_nbytes(tensor) * communicator.size, output=[tensor])


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False, *, algorithm=None):
    """Rank s's input chunk d goes to rank d's output chunk s (equal chunks; with
    split sizes, torch.distributed's own all-to-all runs)."""
    layout.check_tensor(output, "output", "all_to_all")
    layout.check_tensor(input, "input", "all_to_all")
    uneven = bool(output_split_sizes or input_split_sizes)
    communicator = communicator_for(group)
    if uneven and communicator is not None:
        # torch hands these to gloo unchecked: a negative size corrupted the heap (SIGABRT)
        for name, sizes, tensor in (("output_split_sizes", output_split_sizes, output),
                                    ("input_split_sizes", input_split_sizes, input)):
            layout.check_split_sizes(name, sizes, tensor, communicator.size)
    if uneven:
        if algorithm not in DEFAULT_NAMES and algorithm != TORCH:
            raise ValueError(
                f"all_to_all_single: algorithm={algorithm!r} takes equal splits; drop the split sizes, "
                "or leave algorithm unset (or 'torch') to use torch.distributed's for uneven ones"
            )
        algorithm = TORCH

    def torch_call(comm):
        work = dist.all_to_all_single(output.detach(), input.detach(), output_split_sizes, input_split_sizes,
                                      group=comm.group, async_op=True)
        _torch_wait(work, "all_to_all", comm)

    return _launch("all_to_all", communicator, async_op, algorithm,
                   lambda rank, p: layout.prepare_all_to_all(output, input, rank, p),
                   tensor=input, nbytes=_nbytes(input), torch_call=torch_call,
                   check_numel=-1 if uneven else None, output=[output])


def barrier(group=None, async_op=False, *, algorithm=None, device=None):
    """Block until every rank of the group has reached the barrier."""
    communicator = communicator_for(group)
    if communicator is None:
        return None
    token = torch.zeros(1, dtype=torch.int32, device=device or default_device(communicator.group))
    return _launch("barrier", communicator, async_op, algorithm,
                   lambda rank, p: layout.prepare_barrier(token.device),
                   tensor=token, nbytes=0,
                   torch_call=lambda comm: _torch_wait(dist.barrier(group=comm.group, async_op=True), "barrier",
                                                       comm), output=[])


def synchronize(group=None) -> None:
    """Wait for every collective queued with async_op=True on ``group`` (None: on every
    communicator of this process); re-raises the first failure among them."""
    targets = all_communicators() if group is None else [communicator_for(group)]
    for communicator in targets:
        if communicator is not None:
            communicator.synchronize()


def enqueue(job, description: str, group=None):
    """Run ``job()`` on ``group``'s comm thread after every collective queued on it
    (see Communicator.enqueue); returns its Handle."""
    communicator = communicator_for(group)
    if communicator is None:
        raise ValueError(f"enqueue({description!r}): this rank is not a member of the group it was given")
    return communicator.enqueue(job, description)


def stats(group=None) -> dict[str, dict]:
    """Per collective on this rank: calls, bytes_sent, messages, time_s, and calls per
    algorithm, of ``group``'s communicator, or (None) of every communicator added up.
    (For algorithm="torch", bytes are what the call moves, as torch does not report
    its own traffic.)"""
    if group is not None:
        communicator = communicator_for(group)
        return {} if communicator is None else communicator.stats()
    return merge_stats(communicator.stats() for communicator in all_communicators())


def reset_stats(group=None) -> None:
    targets = all_communicators() if group is None else [communicator_for(group)]
    for communicator in targets:
        if communicator is not None:
            communicator.reset_stats()
