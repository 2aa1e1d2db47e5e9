"""Reductions as torch.distributed over gloo has them: bool tensors, BAND/BOR/BXOR on
integers and bool, complex SUM/AVG, through every reducing algorithm on the virtual
executor against the reference; refused (op, dtype) pairs name what is allowed."""

import pytest
import torch
import torch.distributed as dist

from plait.comm.algorithms import REDUCING, algorithms_for
from plait.comm.ops import ALLOWED_DTYPES, check_reducible, op_name
from plait.comm.reference import count_wrong, rank_inputs, reference
from plait.comm.virtual import simulate

# (dtype, ops) the gloo backend reduces beyond the float/int SUM..PRODUCT of test_virtual
CASES = [
    (torch.bool, ("sum", "min", "max", "prod", "band", "bor", "bxor")),
    (torch.uint8, ("band", "bor", "bxor")),
    (torch.int8, ("band", "bor", "bxor")),
    (torch.int32, ("band", "bor", "bxor")),
    (torch.int64, ("band", "bor", "bxor")),
    (torch.complex64, ("sum", "avg")),
    (torch.complex128, ("sum", "avg")),
]
PAIRS = [(c, a) for c in REDUCING for a in algorithms_for(c)]


def _hierarchy(p):
    return "1+" + str(p - 1) if p > 2 else None


@pytest.mark.parametrize("collective,algorithm", PAIRS, ids=[f"{c}-{a}" for c, a in PAIRS])
def test_bool_bitwise_and_complex_through_every_reducing_algorithm(collective, algorithm):
    failures = []
    for p in (1, 2, 3, 5, 6):
        for size in (0, 1, p + 1, 97):
            numel = size * p if collective == "reduce_scatter" else size
            for dtype, ops in CASES:
                for op in ops:
                    inputs = rank_inputs(collective, p, numel, dtype, op, seed=5)
                    extra = {"hierarchy": _hierarchy(p)} if algorithm == "hierarchical" else {}
                    outputs = simulate(collective, algorithm, inputs, op, p - 1, segments=2, **extra)
                    expected, bounds = reference(collective, inputs, op, p - 1)
                    for rank in range(p):
                        assert outputs[rank].dtype == dtype
                        wrong = count_wrong(outputs[rank], expected[rank], bounds[rank])
                        if wrong:
                            failures.append((p, size, str(dtype), op, rank, wrong))
    assert not failures, f"{collective}/{algorithm}: (p, size, dtype, op, rank, #wrong): {failures[:10]}"


def test_bool_semantics_are_torchs():
    """SUM is OR, PRODUCT and MIN are AND, BXOR is parity (what gloo returns)."""
    inputs = [torch.tensor([True, False, True, False]), torch.tensor([True, True, False, False]),
              torch.tensor([True, False, False, False])]
    want = {"sum": [1, 1, 1, 0], "prod": [1, 0, 0, 0], "min": [1, 0, 0, 0], "max": [1, 1, 1, 0],
            "band": [1, 0, 0, 0], "bor": [1, 1, 1, 0], "bxor": [1, 1, 1, 0]}
    for op, values in want.items():
        for algorithm in ("ring", "star", "recursive_doubling"):
            out = simulate("all_reduce", algorithm, [x.clone() for x in inputs], op)
            assert all(o.tolist() == [bool(v) for v in values] for o in out), (op, algorithm)


def test_complex_avg_matches_the_mean():
    inputs = rank_inputs("all_reduce", 3, 10, torch.complex128, "avg")
    out = simulate("all_reduce", "ring", inputs, "avg")
    assert torch.allclose(out[0], torch.stack(inputs).mean(0), rtol=0, atol=1e-15)


def test_reference_bound_catches_a_wrong_imaginary_part():
    inputs = rank_inputs("all_reduce", 3, 5, torch.complex64, "sum")
    expected, bounds = reference("all_reduce", inputs, "sum")
    good = simulate("all_reduce", "ring", inputs, "sum")[0]
    assert count_wrong(good, expected[0], bounds[0]) == 0
    bad = good.clone()
    bad[2] += 1e-3j
    assert count_wrong(bad, expected[0], bounds[0]) == 1


def test_op_names_include_the_bitwise_ops():
    assert op_name(dist.ReduceOp.BAND) == "band"
    assert op_name(dist.ReduceOp.BOR) == "bor"
    assert op_name(dist.ReduceOp.BXOR) == "bxor"
    assert op_name("BXOR") == "bxor"


REFUSED = [
    (torch.float32, "band", "ReduceOp.BAND", "int8"),
    (torch.float64, "bxor", "ReduceOp.BXOR", "bool"),
    (torch.complex64, "min", "ReduceOp.MIN", "ReduceOp.SUM, ReduceOp.AVG"),
    (torch.complex128, "prod", "ReduceOp.PRODUCT", "complex128 takes ReduceOp.SUM"),
    (torch.complex64, "bor", "ReduceOp.BOR", "complex64 takes"),
    (torch.int32, "avg", "ReduceOp.AVG", "float32"),
    (torch.bool, "avg", "ReduceOp.AVG", "bool takes ReduceOp.SUM"),
]


@pytest.mark.parametrize("dtype,op,label,allowed", REFUSED, ids=[f"{d}-{o}" for d, o, _, _ in REFUSED])
def test_refused_pairs_name_the_op_the_dtype_and_what_is_allowed(dtype, op, label, allowed):
    with pytest.raises(TypeError) as caught:
        check_reducible(dtype, op, "all_reduce")
    message = str(caught.value)
    assert label in message and str(dtype) in message and allowed in message, message


def test_allowed_table_is_what_gloo_allows():
    # probed on gloo (torch 2.x): bitwise on integers and bool only, complex SUM/AVG only
    assert torch.float32 not in ALLOWED_DTYPES["band"]
    assert torch.bool in ALLOWED_DTYPES["bxor"]
    assert set(d for d in ALLOWED_DTYPES["min"] if d.is_complex) == set()
    assert torch.complex64 in ALLOWED_DTYPES["avg"] and torch.int64 not in ALLOWED_DTYPES["avg"]
