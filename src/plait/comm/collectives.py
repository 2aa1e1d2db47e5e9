"""plait's collectives: torch.distributed's signatures plus ``algorithm=``.

Each call validates its arguments on this rank, lays its tensors out in one flat
buffer (``plait.comm.layout``), optionally checks with the other ranks that they
agree on sizes, dtype, op, root and algorithm, then runs the algorithm's schedule on
the communication engine (inline, or on the background thread with ``async_op=True``).
``algorithm="torch"`` runs torch.distributed's own collective through the same engine,
so plait and torch calls stay in program order.
"""

from __future__ import annotations

import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.comm import layout
from plait.comm.algorithms import DEFAULT_NAMES, REDUCING, TORCH, build_schedule, builder
from plait.comm.algorithms.hierarchical import parse_hierarchy
from plait.comm.engine import CONFIG, check_enabled, engine, record
from plait.comm.errors import CommError, CommTimeoutError, MismatchError
from plait.comm.executor import Transport
from plait.comm.ops import COMBINE, check_reducible, op_name
from plait.comm.tuner import active_tuner
from plait.cost.alpha_beta import pipeline_segments

ReduceOp = dist.ReduceOp

_DTYPE_CODES = {
    dtype: code
    for code, dtype in enumerate(
        [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
         torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
    )
}
_OP_CODES = {"none": 0, "sum": 1, "avg": 2, "min": 3, "max": 4, "prod": 5, "band": 6, "bor": 7, "bxor": 8}
_TORCH_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "min": ReduceOp.MIN, "max": ReduceOp.MAX,
              "prod": ReduceOp.PRODUCT, "band": ReduceOp.BAND, "bor": ReduceOp.BOR, "bxor": ReduceOp.BXOR}


def default_algorithm(collective: str, nbytes: int, world_size: int) -> str:
    """The default table, used by algorithm="auto" when there is no calibrated profile.

    Small messages are latency-bound, so they take the fewest rounds: on this
    machine kind (gloo over loopback, more ranks than cores) a round costs about a
    millisecond, and the star's two rounds, where only the root does work, beat
    everything up to p = 4; beyond that the server's link grows with p and
    recursive doubling's lg p rounds win. Large messages take the
    bandwidth-optimal ring. Measured with ``plait bench`` (see the README).
    """
    p = world_size
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


def _resolve_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "plait.comm needs a process group: call torch.distributed.init_process_group(...) first "
            "(or launch with torchrun / plait.testing)"
        )
    if group is None:
        group = dist.group.WORLD
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        return None, -1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        return None, -1, 0
    return group, rank, dist.get_world_size(group)


def _group_root(group, root: int, world_size: int, name: str) -> int:
    """torch takes global ranks for src/dst; schedules use group ranks."""
    if not isinstance(root, int):
        raise TypeError(f"{name} must be an int rank, got {type(root).__name__}")
    if group is dist.group.WORLD:
        if not 0 <= root < world_size:
            raise ValueError(f"{name}={root} is not a rank of this group of {world_size} ranks")
        return root
    try:
        return dist.get_group_rank(group, root)
    except (ValueError, RuntimeError):
        raise ValueError(f"{name}={root} (a global rank) is not a member of this group") from None


def auto_algorithm(collective: str, nbytes: int, world_size: int, backend: str = "gloo") -> str:
    """What algorithm="auto" runs: the configured override for the collective, else
    the tuner's choice (calibrated profile), else the default table."""
    override = CONFIG.algorithms.get(collective)
    if override:
        return override
    tuner = active_tuner(backend)
    if tuner is not None:
        return tuner.choose(collective, nbytes, world_size)
    return default_algorithm(collective, nbytes, world_size)


def _resolve_algorithm(algorithm, collective: str, nbytes: int, world_size: int, group=None) -> str:
    if algorithm in DEFAULT_NAMES:
        backend = dist.get_backend(group) if group is not None and world_size > 1 else "gloo"
        return auto_algorithm(collective, nbytes, world_size, str(backend))
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, got {type(algorithm).__name__}")
    if algorithm != TORCH:
        builder(collective, algorithm)  # raises listing the valid names
    return algorithm


def _code(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


_CHECK_FIELDS = ("collective", "algorithm", "elements", "dtype", "op", "root", "hierarchy",
                 "segment_bytes", "pipeline_segment_bytes")


def _check_agreement(collective, algorithm, transport, rank, p, numel, device, dtype, op, root, hierarchy):
    """Exchange what must agree across ranks (collective, algorithm, the tensor's
    elements and dtype, op, root, hierarchy, and the segment sizes that shape the
    messages) over a Bruck all-gather; every rank raises the same MismatchError if
    they differ. ``numel`` < 0 leaves sizes out (uneven all-to-all)."""
    mine = [_code(collective), _code(algorithm), numel, _DTYPE_CODES.get(dtype, 99), _OP_CODES[op],
            -1 if root is None else root, _code(repr(hierarchy)), CONFIG.segment_bytes,
            CONFIG.pipeline_segment_bytes]
    k = len(mine)
    table = torch.zeros(p * k, dtype=torch.int64, device=device)
    table[rank * k : (rank + 1) * k] = torch.tensor(mine, dtype=torch.int64)
    schedule = build_schedule("all_gather", "bruck", p, p * k)
    engine().executor.run(schedule, table, rank, transport, COMBINE["sum"], timeout_s=CONFIG.timeout_s,
                          label=f"{collective} argument check")
    rows = table.view(p, k).tolist()
    bad = [i for i in range(k) if len({row[i] for row in rows}) > 1]
    if not bad:
        return
    parts = []
    for i in bad:
        if _CHECK_FIELDS[i] in ("elements", "root", "segment_bytes", "pipeline_segment_bytes"):
            parts.append(f"{_CHECK_FIELDS[i]}: " + ", ".join(f"rank {r}={row[i]}" for r, row in enumerate(rows)))
        else:
            groups: dict[int, list[int]] = {}
            for r, row in enumerate(rows):
                groups.setdefault(row[i], []).append(r)
            parts.append(f"{_CHECK_FIELDS[i]} differs between ranks {list(groups.values())}")
    raise MismatchError(
        f"{collective}: ranks disagree ({'; '.join(parts)}); every rank must call the same collective "
        f"with the same algorithm, op, root, tensor size and dtype, and plait.comm.configure segment "
        f"sizes (this rank {rank}: {numel} elements of {dtype})"
    )


def _torch_wait(work, collective: str, rank: int) -> None:
    """Wait for torch's own collective with plait's deadline, naming what hung."""
    if work is None:
        return
    try:
        work.wait(timedelta(seconds=CONFIG.timeout_s))
    except RuntimeError as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        kwargs = dict(rank=rank, collective=collective, algorithm=TORCH, step="torch", peer="?", reason=reason)
        if "timed out" in reason.lower() or "timeout" in reason.lower():
            raise CommTimeoutError(timeout_s=CONFIG.timeout_s, **kwargs) from error
        raise CommError(**kwargs) from error


def default_device(group=None):
    """Where a collective's own small tensors go (a barrier's token, an agreement
    check): the current GPU for NCCL, else the CPU."""
    if group is None:
        group = dist.group.WORLD
    return torch.device("cuda") if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")


def _launch(collective, group, async_op, algorithm, prepare, *, tensor, nbytes, op="none", root=None,
            torch_call=None, hierarchy=None, check_numel=None):
    """Common path of every collective; returns None or a Handle.

    ``tensor`` is the rank's data tensor (its elements, dtype and device go into the
    check), ``nbytes`` the collective's size as nccl-tests counts it (it picks the
    default algorithm). ``prepare(rank, p)`` validates and lays out plait's buffer;
    ``torch_call(rank, p)`` runs torch's collective and waits for it with ``_torch_wait``.
    """
    group, rank, p = _resolve_group(group)
    if group is None:
        return None  # this rank is not in the group, as torch does
    dtype = tensor.dtype
    if collective in REDUCING:
        check_reducible(dtype, op, collective)
    algorithm = _resolve_algorithm(algorithm, collective, nbytes, p, group)
    prepared = prepare(rank, p) if algorithm != TORCH else None  # validates this rank's arguments now
    tree = None
    if algorithm == "hierarchical":
        spec = hierarchy if hierarchy is not None else CONFIG.hierarchy
        world = group is dist.group.WORLD
        tree = parse_hierarchy(spec, p, None if world else 1)
    check = check_enabled() and p > 1
    numel = tensor.numel() if check_numel is None else check_numel

    def job():
        transport = Transport(group, tensor.device) if p > 1 else None
        if check:
            _check_agreement(collective, algorithm, transport, rank, p, numel, tensor.device, dtype, op, root, tree)
        start = time.perf_counter()
        if algorithm == TORCH:
            torch_call(rank, p)  # waits with plait's deadline (_torch_wait)
            record(collective, TORCH, nbytes, 0, time.perf_counter() - start)
            return nbytes
        buffer = prepared.build()  # reads the inputs now, after earlier queued collectives
        sent = messages = 0
        if p > 1:
            segments = pipeline_segments(nbytes, CONFIG.pipeline_segment_bytes)
            schedule = build_schedule(collective, algorithm, p, prepared.numel, root, segments, tree)
            segment_numel = CONFIG.segment_bytes // buffer.element_size() if CONFIG.segment_bytes else 0
            sent, messages = engine().executor.run(
                schedule, buffer, rank, transport, COMBINE[op if op != "none" else "sum"],
                timeout_s=CONFIG.timeout_s, segment_numel=segment_numel, label=collective,
            )
        prepared.finish(buffer)
        record(collective, algorithm, sent, messages, time.perf_counter() - start)
        return sent

    return engine().submit(job, f"{collective}(algorithm={algorithm})", async_op)


# ----- the public collectives ------------------------------------------------------------
def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _world_size(group) -> int:
    resolved, _, p = _resolve_group(group)
    return p if resolved is not None else 1


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm=None, hierarchy=None):
    """All-reduce ``tensor`` in place across the group (see plait.comm.algorithms for
    each algorithm's steps and cost). ``hierarchy`` only matters for "hierarchical"."""
    name = op_name(op)

    def torch_call(rank, p):
        data = tensor.detach()
        _torch_wait(dist.all_reduce(data, _TORCH_OPS[name], group=group, async_op=True), "all_reduce", rank)
        if name == "avg":  # gloo has no AVG
            data.div_(p)

    return _launch("all_reduce", group, async_op, algorithm,
                   lambda rank, p: layout.prepare_all_reduce(tensor, rank, p, name),
                   tensor=tensor, nbytes=_nbytes(tensor), op=name, torch_call=torch_call, hierarchy=hierarchy)


def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm=None):
    """Reduce ``input`` (p equal chunks) across ranks; rank r gets chunk r in ``output``."""
    name = op_name(op)

    def torch_call(rank, p):
        out = output.detach()
        work = dist.reduce_scatter_tensor(out, input.detach(), _TORCH_OPS[name], group=group, async_op=True)
        _torch_wait(work, "reduce_scatter", rank)
        if name == "avg":
            out.div_(p)

    return _launch("reduce_scatter", group, async_op, algorithm,
                   lambda rank, p: layout.prepare_reduce_scatter(output, input, rank, p, name),
                   tensor=input, nbytes=_nbytes(input), op=name, torch_call=torch_call)


def all_gather_single(output, input, group=None, async_op=False, *, algorithm=None):
    """Gather every rank's ``input`` into ``output`` (p * input elements), rank order."""

    def torch_call(rank, p):
        work = dist.all_gather_into_tensor(output.detach(), input.detach(), group=group, async_op=True)
        _torch_wait(work, "all_gather", rank)

    return _launch("all_gather", group, async_op, algorithm,
                   lambda rank, p: layout.prepare_all_gather(output, input, rank, p),
                   tensor=input, nbytes=_nbytes(output), torch_call=torch_call)


reduce_scatter_tensor = reduce_scatter_single
all_gather_into_tensor = all_gather_single


def _rooted(collective, group, async_op, algorithm, root, root_name, prepare, torch_call, **kwargs):
    """Rooted collectives: torch takes a global rank; schedules take the group rank."""
    resolved, _, p = _resolve_group(group)
    if resolved is None:
        return None
    group_root = _group_root(resolved, root, p, root_name)
    return _launch(collective, group, async_op, algorithm,
                   lambda rank, p: prepare(rank, p, group_root),
                   root=group_root, torch_call=lambda rank, p: torch_call(rank, p, group_root), **kwargs)


def broadcast(tensor, src=0, group=None, async_op=False, *, algorithm=None):
    """Copy ``tensor`` from rank ``src`` (a global rank, as in torch) to every rank."""

    def torch_call(rank, p, root):
        _torch_wait(dist.broadcast(tensor.detach(), src, group=group, async_op=True), "broadcast", rank)

    return _rooted("broadcast", group, async_op, algorithm, src, "src",
                   lambda rank, p, root: layout.prepare_broadcast(tensor, rank, p, root),
                   torch_call, tensor=tensor, nbytes=_nbytes(tensor))


def reduce(tensor, dst=0, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm=None):
    """Reduce every rank's ``tensor`` into rank ``dst``'s (others are left unchanged)."""
    name = op_name(op)

    def torch_call(rank, p, root):
        data = tensor.detach() if rank == root else tensor.detach().clone()
        _torch_wait(dist.reduce(data, dst, _TORCH_OPS[name], group=group, async_op=True), "reduce", rank)
        if rank == root and name == "avg":
            data.div_(p)

    return _rooted("reduce", group, async_op, algorithm, dst, "dst",
                   lambda rank, p, root: layout.prepare_reduce(tensor, rank, p, root, name),
                   torch_call, tensor=tensor, nbytes=_nbytes(tensor), op=name)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, *, algorithm=None):
    """Gather every rank's ``tensor`` into ``gather_list`` on rank ``dst``."""

    def torch_call(rank, p, root):
        targets = [t.detach() for t in gather_list] if rank == root else None
        _torch_wait(dist.gather(tensor.detach(), targets, dst, group=group, async_op=True), "gather", rank)

    return _rooted("gather", group, async_op, algorithm, dst, "dst",
                   lambda rank, p, root: layout.prepare_gather(tensor, gather_list, rank, p, root),
                   torch_call, tensor=tensor, nbytes=_nbytes(tensor) * _world_size(group))


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, *, algorithm=None):
    """Rank ``src`` sends ``scatter_list[r]`` to rank r, which receives it in ``tensor``."""

    def torch_call(rank, p, root):
        sources = [t.detach() for t in scatter_list] if rank == root else None
        _torch_wait(dist.scatter(tensor.detach(), sources, src, group=group, async_op=True), "scatter", rank)

    return _rooted("scatter", group, async_op, algorithm, src, "src",
                   lambda rank, p, root: layout.prepare_scatter(tensor, scatter_list, rank, p, root),
                   torch_call, tensor=tensor, nbytes=_nbytes(tensor) * _world_size(group))


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False, *, algorithm=None):
    """Rank s's input chunk d goes to rank d's output chunk s (equal chunks; with
    split sizes, torch.distributed's own all-to-all runs)."""
    uneven = bool(output_split_sizes or input_split_sizes)
    if uneven:
        if algorithm not in DEFAULT_NAMES and algorithm != TORCH:
            raise ValueError(
                f"all_to_all_single: algorithm={algorithm!r} takes equal splits; drop the split sizes, "
                "or leave algorithm unset (or 'torch') to use torch.distributed's for uneven ones"
            )
        algorithm = TORCH

    def torch_call(rank, p):
        work = dist.all_to_all_single(output.detach(), input.detach(), output_split_sizes, input_split_sizes,
                                      group=group, async_op=True)
        _torch_wait(work, "all_to_all", rank)

    return _launch("all_to_all", group, async_op, algorithm,
                   lambda rank, p: layout.prepare_all_to_all(output, input, rank, p),
                   tensor=input, nbytes=_nbytes(input), torch_call=torch_call,
                   check_numel=-1 if uneven else None)


def barrier(group=None, async_op=False, *, algorithm=None, device=None):
    """Block until every rank of the group has reached the barrier."""
    resolved, _, _ = _resolve_group(group)
    if resolved is None:
        return None
    token = torch.zeros(1, dtype=torch.int32, device=device or default_device(resolved))
    return _launch("barrier", group, async_op, algorithm,
                   lambda rank, p: layout.prepare_barrier(token.device),
                   tensor=token, nbytes=0,
                   torch_call=lambda rank, p: _torch_wait(dist.barrier(group=group, async_op=True), "barrier", rank))


def synchronize() -> None:
    """Wait for every collective this process queued with async_op=True; re-raises
    the first failure among them."""
    engine().synchronize()


# ----- what an async call's Handle.get_future() holds ------------------------------------
def _future_output(function, output_of):
    """Wrap a collective so the Handle it returns (async_op=True) knows its output:
    ``output_of(arguments)`` -> the list torch's Work future would hold."""
    import functools
    import inspect

    signature = inspect.signature(function)

    @functools.wraps(function)
    def call(*args, **kwargs):
        handle = function(*args, **kwargs)
        if handle is not None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            handle.output = output_of(bound.arguments)
        return handle

    return call


all_reduce = _future_output(all_reduce, lambda a: [a["tensor"]])
broadcast = _future_output(broadcast, lambda a: [a["tensor"]])
reduce = _future_output(reduce, lambda a: [a["tensor"]])
reduce_scatter_single = reduce_scatter_tensor = _future_output(reduce_scatter_single, lambda a: [a["output"]])
all_gather_single = all_gather_into_tensor = _future_output(all_gather_single, lambda a: [a["output"]])
all_to_all_single = _future_output(all_to_all_single, lambda a: [a["output"]])
scatter = _future_output(scatter, lambda a: [a["tensor"]])
gather = _future_output(gather, lambda a: list(a["gather_list"] or []))
barrier = _future_output(barrier, lambda a: [])
