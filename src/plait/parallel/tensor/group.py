"""The tensor-parallel group a sharded layer lives in, and how to make one.

``TensorParallel`` carries the process group, the collective algorithm its
mappings use, whether sequence parallelism is on and whether the comm layer
checks each call's arguments. ``group=None`` means the world, as everywhere in
plait and torch; tensor parallelism of degree 1 holds a real group of one
(``new_tensor_parallel(1)``, or the mesh's tp group), where every collective is a
no-op. ``UNSHARDED`` is the one exception: a model built with no process group at all
(``LOCAL``), for single-process use.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait import comm
from plait.comm.algorithms import ALGORITHMS, TORCH
from plait.comm.communicator import check_group, process_group
from plait.parallel.tensor.layout import FIRST, LAYOUT_CHECKS


class _Local:
    """No process group: the unsharded model in one process (``UNSHARDED``)."""

    def __repr__(self) -> str:
        return "LOCAL"

    def __reduce__(self) -> str:
        # the one LOCAL survives copy.deepcopy(model) and pickling (`group is LOCAL` checks identity)
        return "LOCAL"


LOCAL = _Local()


@dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """A tensor-parallel group: ``size`` ranks each holding 1/size of every sharded
    layer. ``algorithm`` picks the plait.comm algorithm of every mapping ("auto",
    "ring", "torch", ...). ``sequence_parallel`` shards the LayerNorm/dropout regions
    along the sequence (Korthikanti et al. 2022): the all-reduces become
    reduce-scatter + all-gather pairs. ``group``: the process group (None: the world;
    ``LOCAL``: none, one process) or a plait Communicator, which every mapping's
    collective then runs on (a process group means its communicator: plait.comm's
    rule; a 1-D torch DeviceMesh, e.g. ``mesh["tp"]``, means its process group's and
    stays in ``group`` as given). ``check_args=False``: ``new_tensor_parallel`` creates the group's
    communicator with ``CommConfig(check="off")`` (the default in-band check costs no
    extra message, so there is little to gain). ``check_layout``: when each layer
    checks that its input has the layout it expects (sharded along the sequence
    under sequence parallelism, else replicated; see plait.parallel.tensor.layout):
    "first" forward (default), "always" or "off". ``async_grad_reduce``: whether a
    column-parallel layer's backward issues its all-reduce (reduce-scatter under
    sequence parallelism) of dX asynchronously and computes dW while it runs
    (Megatron's async tensor-parallel all-reduce; plait.parallel.tensor.linear_ops);
    None (default): on for tensors on an accelerator, off on the CPU, where plait's
    collective would run on its comm thread, competing with the GEMM for the same
    cores (measured slower there). Either way the results are the same bits."""

    group: object = None
    algorithm: str = "auto"
    sequence_parallel: bool = False
    check_args: bool = True
    check_layout: str = FIRST
    async_grad_reduce: bool | None = None

    def __post_init__(self):
        if not isinstance(self.algorithm, str):
            raise TypeError(f"algorithm must be a string such as 'auto' or 'ring', got {self.algorithm!r}")
        if self.algorithm not in ALGORITHMS and self.algorithm not in ("auto", "default", TORCH):
            # refused now, not in the middle of the first forward
            raise ValueError(f"TensorParallel: algorithm={self.algorithm!r} is not one of plait's; valid: "
                             f"{', '.join(sorted(ALGORITHMS))}, '{TORCH}' or 'auto'")
        for name in ("sequence_parallel", "check_args"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # 'no' is truthy: sequence parallelism would be on
                raise TypeError(f"TensorParallel: {name} must be True or False, got {value!r}")
        if self.async_grad_reduce is not None and not isinstance(self.async_grad_reduce, bool):
            raise TypeError(f"TensorParallel: async_grad_reduce must be True, False or None (on for accelerator "
                            f"tensors only), got {self.async_grad_reduce!r}")
        if self.check_layout not in LAYOUT_CHECKS:
            raise ValueError(f"TensorParallel: check_layout={self.check_layout!r} must be one of "
                             f"{', '.join(map(repr, LAYOUT_CHECKS))}")
        if self.group is LOCAL:
            return
        try:
            check_group(self.group)
        except TypeError as error:
            raise TypeError(f"TensorParallel: {error} (or plait.parallel.tensor.LOCAL for one process)") from None
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TensorParallel(group=...) needs torch.distributed initialised first (group=None "
                               "means the world); use UNSHARDED for a model in one process")
        if dist.get_rank(self._process_group) < 0:
            raise ValueError("this rank is not a member of the tensor-parallel group it was given")

    @property
    def _process_group(self):
        return _process_group(self.group)

    @property
    def size(self) -> int:
        return 1 if self.group is LOCAL else dist.get_world_size(self._process_group)

    @property
    def rank(self) -> int:
        return 0 if self.group is LOCAL else dist.get_rank(self._process_group)

    def overlaps_grad_reduce(self, device: torch.device) -> bool:
        """Whether a column-parallel backward on ``device`` reduces dX asynchronously."""
        if self.async_grad_reduce is None:
            return device.type != "cpu"
        return self.async_grad_reduce

    def agreement_fields(self) -> dict[str, int]:
        """What every rank of the group must agree on, as ints (see check_agreement)."""
        return {"tp": self.size, "sequence_parallel": int(self.sequence_parallel),
                "algorithm": name_code(self.algorithm), "check_args": int(self.check_args),
                "check_layout": name_code(self.check_layout)}

    def describe(self) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        return f"tp={self.size} (rank {self.rank}, algorithm={self.algorithm}{sp})"


UNSHARDED = TensorParallel(group=LOCAL)


def name_code(text: str) -> int:
    return zlib.crc32(str(text).encode()) & 0x7FFFFFFF


def _process_group(group):
    """torch's process group of ``group=`` (None: the world; a Communicator or a 1-D
    torch DeviceMesh: its group)."""
    group = process_group(group)
    return dist.group.WORLD if group is None else group


def check_agreement(fields: dict[str, int], group, subject: str, detail: str = "") -> None:
    """All-gather ``fields`` (ints) over ``group`` (None: the world) with plait.comm,
    which has deadlines, and raise on every rank naming the ranks whose values
    differ from rank 0's: mismatched settings fail here, named, instead of hanging or
    corrupting a later collective."""
    names = list(fields)
    mine = torch.tensor([int(fields[name]) for name in names], dtype=torch.int64,
                        device=comm.default_device(group))
    size = dist.get_world_size(_process_group(group))
    everyone = torch.empty(size * len(names), dtype=torch.int64, device=mine.device)
    comm.all_gather_single(everyone, mine, group=group)
    rows = everyone.view(size, len(names)).cpu()
    differ = {name: [rank for rank in range(size) if rows[rank, column] != rows[0, column]]
              for column, name in enumerate(names)}
    problems = [f"ranks {ranks} have a different {name} from rank 0's" for name, ranks in differ.items() if ranks]
    if problems:
        raise ValueError(f"{subject}: " + "; ".join(problems) + (f" ({detail})" if detail else ""))


def new_tensor_parallel(tp: int, *, algorithm: str = "auto", sequence_parallel: bool = False,
                        check_args: bool = True, check_layout: str = FIRST) -> TensorParallel:
    """Split the world into world_size/tp groups of ``tp`` consecutive ranks (ranks
    0..tp-1, tp..2tp-1, ...) and return this rank's. Every rank must call it with the
    same arguments (it creates every group, as torch.distributed.new_group requires);
    one all-gather checks that first and names the ranks that differ."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("new_tensor_parallel needs torch.distributed initialised first (torchrun / plait.testing)")
    world_size = dist.get_world_size()
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise TypeError(f"tp must be an int, got {type(tp).__name__} {tp!r}")
    # agree first, so one rank's bad value is named on every rank rather than left to time out
    wanted = TensorParallel(algorithm=algorithm, sequence_parallel=sequence_parallel, check_args=check_args,
                            check_layout=check_layout)
    fields = {**wanted.agreement_fields(), "tp": tp}
    check_agreement(fields, None, "new_tensor_parallel: every rank must ask for the same tensor parallelism",
                    f"this rank {dist.get_rank()}: tp={tp}, algorithm={algorithm!r}, "
                    f"sequence_parallel={sequence_parallel}, check_args={check_args}, check_layout={check_layout!r}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if tp > world_size:
        raise ValueError(f"tp={tp} is larger than the world size {world_size}: use tp <= {world_size} "
                         "or launch more processes")
    if world_size % tp:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"tp={tp} does not divide the world size {world_size}; valid tp values: {valid}")
    rank = dist.get_rank()
    mine = None
    for start in range(0, world_size, tp):  # tp = 1: real groups of one, where every collective is a no-op
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    if not check_args and tp > 1:
        comm.init_communicator(mine, comm.CommConfig(check="off"))
    return TensorParallel(group=mine, algorithm=algorithm, sequence_parallel=sequence_parallel,
                          check_args=check_args, check_layout=check_layout)
