"""What spawning N local benchmark workers asks of the machine, checked before any starts.

Memory, per local rank (a lower bound: what a worker cannot run without):

    runtime   interpreter + torch + gloo + plait                 WORKER_BASE_BYTES
    buffers   the collective's input and output at the largest    make_buffers' layout (below)
              size (plait.bench.buffers.make_buffers)
    scratch   plait's receive staging: up to one more copy of     1 x the largest buffer
              the largest buffer (recursive doubling and trees
              receive whole buffers)
    check     --check: every rank rebuilds all p ranks' inputs    2 x p x input elements x 8
              and the float64 reference (plait.bench.buffers)

Measured here (gloo, 2 ranks, Python 3.11, torch 2.x), peak resident set of a worker:
267 MiB at a 1 KiB all-reduce; at 128 MiB +127 MiB for torch (the buffer), +199 MiB
for ring, +263 MiB for recursive doubling (buffer + a whole receive buffer). So
runtime + buffer + scratch covers each of them; WORKER_BASE_BYTES rounds 267 MiB up.

Local processes share one memory: nprocs x per-rank need <= available memory
(MemAvailable, or the cgroup's remaining limit; the caller reads it).

Cores: a collective's step waits for every rank, so with k ranks per core each step
waits for k time slices and the timings measure the scheduler, not the algorithm.
MAX_RANKS_PER_CORE = 4 is twice what the default world (4 ranks) asks of the 2-core
machine the suite targets (DESIGN.md section 4); beyond it the run is refused unless
the user asks for it (--allow-oversubscribe).
"""

from __future__ import annotations

from plait.bench.buffers import CHUNKED_COLLECTIVES

WORKER_BASE_BYTES = 288 << 20  # measured 267 MiB peak per gloo worker (module docstring), rounded up
MAX_RANKS_PER_CORE = 4
FLOAT64_BYTES = 8
GIB = float(1 << 30)


def human_bytes(nbytes: float) -> str:
    """'1.5 GiB', '300 MiB', '512 B' (binary units, 3 significant digits)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def collective_rank_bytes(collective: str, size_bytes: int, world_size: int, *, root_rank: bool = True,
                          check: bool = False, element_size: int = 4) -> int:
    """Bytes one rank allocates for one call of ``collective`` whose largest buffer is
    ``size_bytes`` (the size plait bench reports): buffers + receive scratch [+ --check].

    all_reduce, broadcast, reduce: n; reduce_scatter, all_gather: n + n/p;
    all_to_all: 2n; gather, scatter: n/p + n on the root (n/p elsewhere); barrier: 0.
    Scratch: one more n. --check: 2 p x (input elements) x 8 (float64 inputs of all ranks
    and the reference)."""
    if collective == "barrier" or size_bytes <= 0:
        return 0
    p = world_size
    chunk = size_bytes // p if collective in CHUNKED_COLLECTIVES else size_bytes
    if collective in ("all_reduce", "broadcast", "reduce"):
        buffers = size_bytes
    elif collective in ("reduce_scatter", "all_gather"):
        buffers = size_bytes + chunk
    elif collective == "all_to_all":
        buffers = 2 * size_bytes
    else:  # gather, scatter: the root holds all p chunks
        buffers = chunk + (size_bytes if root_rank else 0)
    need = buffers + size_bytes
    if check:
        input_elements = (size_bytes if collective in ("reduce_scatter", "all_to_all", "scatter") else chunk)
        need += 2 * p * (input_elements // max(1, element_size)) * FLOAT64_BYTES
    return need


def check_local_ranks(nprocs: int, *, available_bytes: int, cores: int, per_rank_bytes: int = 0,
                      allow_oversubscribe: bool = False, what: str = "", fix: str = "", flag: str = "--nprocs") -> None:
    """Raise ValueError, with the numbers, when ``nprocs`` local workers (each
    WORKER_BASE_BYTES + ``per_rank_bytes``) do not fit ``available_bytes``, or exceed
    MAX_RANKS_PER_CORE x ``cores`` without ``allow_oversubscribe``. ``what`` names the
    per-rank bytes (e.g. "a 64 MiB all_reduce buffer + scratch"), ``fix`` the remedy,
    ``flag`` the option that sets the number of processes."""
    if nprocs < 1:
        raise ValueError(f"{flag} {nprocs} must be >= 1")
    per_rank = WORKER_BASE_BYTES + per_rank_bytes
    total = nprocs * per_rank
    if total > available_bytes:
        detail = f" + {human_bytes(per_rank_bytes)} for {what}" if per_rank_bytes else ""
        fitting = available_bytes // per_rank
        fit = f" (at most {fitting} such processes fit)" if fitting >= 1 else ""
        raise ValueError(f"{nprocs} local processes need at least {human_bytes(total)} of memory, each "
                         f"{human_bytes(WORKER_BASE_BYTES)} of runtime{detail}, but {human_bytes(available_bytes)} "
                         f"is available (MemAvailable){fit}; " + (fix or f"use a smaller {flag}"))
    most = MAX_RANKS_PER_CORE * cores
    if nprocs > most and not allow_oversubscribe:
        raise ValueError(f"{flag} {nprocs} is more than {MAX_RANKS_PER_CORE} processes per core on the {cores} "
                         f"core(s) this process may use ({most}): timings would measure the scheduler; use "
                         f"{flag} {most} or fewer, or pass --allow-oversubscribe")
