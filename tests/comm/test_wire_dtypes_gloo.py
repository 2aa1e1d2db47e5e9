"""Dtypes beyond the twelve plait reduces (uint16, uint32, float8, ...) on 2 real gloo
ranks: broadcasts and all-gathers move their bits exactly under the in-band and the
deep check, reductions and dtypes plait cannot carry are refused by name before any
message (the group stays usable), and two ranks at different such dtypes are named.

(The in-band header once coded an unknown dtype with Python's per-process hash(), so
every uint16 or float8 broadcast failed with a false MismatchError.)"""

import pytest
import torch
import torch.distributed as dist

import plait.comm as comm
from plait.testing import run_distributed

pytestmark = pytest.mark.slow

DTYPES = ("uint16", "float8_e4m3fn", "float8_e5m2", "uint32", "uint64", "complex32", "float8_e8m0fnu")
SIZES = (5, 40_001)  # a small (packed, carried) call and one past the in-band inline size


def _bits(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` with seeded random bits."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _outcome(fn) -> str:
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - the test reads the type and message
        return f"{type(error).__name__}: {error}"


def broadcast_and_gather(rank, p, check):
    comm.init_communicator(None, comm.CommConfig(check=check, timeout_s=30.0))
    results = {}
    try:
        for name in DTYPES:
            dtype = getattr(torch, name)
            for numel in SIZES:
                expected = _bits(dtype, numel, seed=numel)
                for algorithm in ("auto", *comm.algorithms_for("broadcast")):
                    def broadcast():
                        x = expected.clone() if rank == 1 else torch.zeros_like(expected.view(torch.uint8)).view(dtype)
                        comm.broadcast(x, 1, algorithm=None if algorithm == "auto" else algorithm)
                        return "exact" if _same_bits(x, expected) else "wrong bits"
                    results[("broadcast", name, numel, algorithm)] = _outcome(broadcast)

                def torch_broadcast():  # gloo's own broadcast: fewer dtypes than its send/recv
                    x = expected.clone() if rank == 1 else torch.zeros_like(expected.view(torch.uint8)).view(dtype)
                    comm.broadcast(x, 1, algorithm="torch")
                    return "exact" if _same_bits(x, expected) else "wrong bits"
                results[("torch", name, numel, "torch")] = _outcome(torch_broadcast)

                def all_gather():
                    mine = _bits(dtype, numel, seed=100 * numel + rank)
                    out = torch.zeros(p * numel * dtype.itemsize, dtype=torch.uint8).view(dtype)
                    comm.all_gather_single(out, mine)
                    wanted = torch.cat([_bits(dtype, numel, seed=100 * numel + r).view(torch.uint8) for r in range(p)])
                    return "exact" if torch.equal(out.view(torch.uint8), wanted) else "wrong bits"
                results[("all_gather", name, numel, "auto")] = _outcome(all_gather)

                def all_reduce():
                    x = _bits(dtype, numel, seed=numel)
                    comm.all_reduce(x, dist.ReduceOp.SUM, algorithm="ring")
                    return "reduced"
                results[("all_reduce", name, numel, "ring")] = _outcome(all_reduce)
        # a dtype plait cannot carry: refused before any message, on every rank alike
        results[("broadcast", "uint4", 5, "tree")] = _outcome(
            lambda: comm.broadcast(torch.zeros(5, dtype=torch.uint8).view(torch.uint4), 0, algorithm="tree"))
        # the group is still usable after every refusal
        y = torch.full((3,), float(rank))
        comm.all_reduce(y, algorithm="ring")
        results["after"] = y.tolist()
    finally:
        comm.init_communicator(None)
    return results


def different_dtypes_named(rank, p):
    """Ranks at two one-byte dtypes the old checks all coded alike (99) under the deep check."""
    comm.init_communicator(None, comm.CommConfig(check="deep", timeout_s=30.0))
    try:
        dtype = torch.float8_e4m3fn if rank == 0 else torch.float8_e5m2
        return _outcome(lambda: comm.broadcast(_bits(dtype, 16, seed=1), 0, algorithm="tree"))
    finally:
        comm.init_communicator(None)


@pytest.mark.parametrize("check", ["inband", "deep"])
def test_uint16_and_float8_broadcast_exactly_or_are_refused_by_name(check):
    results = run_distributed(broadcast_and_gather, 2, check, timeout_s=300)
    for rank, answers in enumerate(results):
        assert answers.pop("after") == [1.0, 1.0, 1.0], rank
        refusal = answers.pop(("broadcast", "uint4", 5, "tree"))
        assert refusal.startswith("TypeError: broadcast cannot carry dtype uint4: ") and "uint8" in refusal
        wrong = {key: value for key, value in answers.items()
                 if key[0] in ("broadcast", "all_gather") and value != "exact"}
        assert not wrong, f"rank {rank}: {wrong}"
        for (collective, name, _, _), value in answers.items():
            if collective == "all_reduce":  # no reduce op is defined on these dtypes: named, not run
                assert value.startswith(f"TypeError: all_reduce cannot reduce torch.{name}; reducible dtypes: ")
            if collective == "torch" and name == "complex32":  # gloo's broadcast takes it
                assert value == "exact"
            elif collective == "torch":  # refused before gloo sees it (gloo: "Invalid scalar type", group broken)
                assert value.startswith(f"TypeError: broadcast(algorithm='torch') over gloo cannot carry dtype {name}: "
                                        "gloo's own collectives take float16, ") and "algorithm='auto'" in value
    assert ("broadcast", "uint16", 5, "auto") in results[0] and ("broadcast", "float8_e4m3fn", 40_001, "tree") \
        in results[0]


def test_ranks_at_different_float8_dtypes_are_named():
    messages = run_distributed(different_dtypes_named, 2, timeout_s=120)
    for message in messages:
        assert message.startswith("MismatchError: broadcast: ranks disagree (dtype differs between ranks [[0], [1]])")
