"""bool, bitwise and complex reductions on real gloo ranks (p = 2, 3, 5): every
reducing algorithm against the reference, the virtual executor (bit for bit) and
torch.distributed's own all_reduce of the same inputs."""

import pytest
import torch
import torch.distributed as dist

import plait.comm as comm
from plait.comm.algorithms import REDUCING
from plait.comm.reference import count_wrong, rank_inputs, reference
from plait.comm.virtual import simulate
from plait.testing import run_distributed
from tests.comm.test_reduce_ops import CASES

pytestmark = pytest.mark.slow

TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN,
             "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND,
             "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


def _call(collective, algorithm, x, rank, p, op, root):
    if collective == "all_reduce":
        out = x.clone()
        comm.all_reduce(out, TORCH_OPS[op], algorithm=algorithm)
    elif collective == "reduce_scatter":
        out = x.new_empty(x.numel() // p)
        comm.reduce_scatter_single(out, x, TORCH_OPS[op], algorithm=algorithm)
    else:
        out = x.clone()
        comm.reduce(out, root, TORCH_OPS[op], algorithm=algorithm)
    return out


def check_ops(rank, p, sizes):
    failures = []
    root = p - 1
    for collective in REDUCING:
        for size in sizes:
            numel = size * p if collective == "reduce_scatter" else size
            for dtype, ops in CASES:
                for op in ops:
                    inputs = rank_inputs(collective, p, numel, dtype, op, seed=23)
                    expected, bounds = reference(collective, inputs, op, root)
                    # torch.distributed's own answer: its all_reduce of the same input, sliced
                    theirs = inputs[rank].clone()
                    dist.all_reduce(theirs, TORCH_OPS[op])
                    if collective == "reduce_scatter":
                        theirs = theirs.chunk(p)[rank]
                    elif collective == "reduce" and rank != root:
                        theirs = inputs[rank]
                    for algorithm in comm.algorithms_for(collective):
                        where = (collective, algorithm, str(dtype), size, op, rank)
                        extra = "1+" + str(p - 1) if p > 2 else None
                        if algorithm == "hierarchical" and collective == "all_reduce":
                            out = inputs[rank].clone()
                            comm.all_reduce(out, TORCH_OPS[op], algorithm=algorithm, hierarchy=extra)
                        else:
                            out = _call(collective, algorithm, inputs[rank].clone(), rank, p, op, root)
                        if out.dtype != dtype:
                            failures.append((*where, f"dtype {out.dtype}"))
                        if count_wrong(out, expected[rank], bounds[rank]):
                            failures.append((*where, "wrong vs reference"))
                        virtual = simulate(collective, algorithm, [x.clone() for x in inputs], op, root,
                                           hierarchy=extra)[rank]
                        if not torch.equal(out, virtual):
                            failures.append((*where, "differs from the virtual executor"))
                        if count_wrong(out, torch.as_tensor(theirs).reshape(-1).to(expected[rank].dtype),
                                       2 * bounds[rank]):
                            failures.append((*where, "differs from torch.distributed"))
    return failures


def refused(rank, p):
    messages = []
    for dtype, op in ((torch.float32, dist.ReduceOp.BAND), (torch.complex64, dist.ReduceOp.MAX),
                      (torch.int64, dist.ReduceOp.AVG)):
        try:
            comm.all_reduce(torch.ones(3, dtype=dtype), op, algorithm="ring")
        except TypeError as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    # the group is still usable afterwards: refusals happen before any message
    x = torch.tensor([True, rank == 0])
    comm.all_reduce(x, dist.ReduceOp.BXOR, algorithm="ring")
    return messages, x.tolist()


@pytest.mark.parametrize("p", [2, 3, 5])
def test_bool_bitwise_and_complex_match_torch_distributed(p):
    failures = [f for rank_failures in run_distributed(check_ops, p, [1, 130]) for f in rank_failures]
    assert not failures, failures[:10]


def test_refused_pairs_raise_on_every_rank_before_sending():
    for messages, after in run_distributed(refused, 3):
        assert "ReduceOp.BAND" in messages[0] and "torch.float32" in messages[0] and "takes" in messages[0]
        assert "ReduceOp.MAX" in messages[1] and "torch.complex64" in messages[1] and "SUM" in messages[1]
        assert "ReduceOp.AVG" in messages[2] and "torch.int64" in messages[2]
        assert after == [True, True]  # 3 ranks: True^True^True, then only rank 0's True
