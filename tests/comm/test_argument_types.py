"""A list, a string, a number or a NumPy array where a collective or a wrapper takes a
tensor, a module or a group is a TypeError naming the argument and what it must be
(it used to be an AttributeError from inside plait: ``'list' object has no attribute
'numel'``)."""

import numpy as np
import pytest
import torch
from torch import nn

import plait.comm as comm
from plait.parallel import DataParallel, ParameterServer, ShardedOptimizer, ZeRO
from plait.parallel.pipeline.engine import PipelineEngine
from plait.parallel.pipeline.schedules import one_f_one_b
from plait.parallel.tensor import (ColumnParallelLinear, ParallelAttention, ParallelMLP, RowParallelLinear,
                                   TensorParallel)
from plait.testing import run_distributed


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


CASES = {
    "all_reduce(list)": (lambda: comm.all_reduce([1, 2, 3]), "all_reduce: tensor must be a torch.Tensor, got list"),
    "all_reduce(str)": (lambda: comm.all_reduce("abc"), "all_reduce: tensor must be a torch.Tensor, got str"),
    "all_reduce(ndarray)": (lambda: comm.all_reduce(np.ones(3)), "all_reduce: tensor must be a torch.Tensor, got ndarray"),
    "all_reduce(float)": (lambda: comm.all_reduce(1.0), "tensor must be a torch.Tensor, got float"),
    "broadcast(list)": (lambda: comm.broadcast([1.0], src=0), "broadcast: tensor must be a torch.Tensor, got list"),
    "reduce(list)": (lambda: comm.reduce([1.0], dst=0), "reduce: tensor must be a torch.Tensor, got list"),
    "gather(list)": (lambda: comm.gather([1.0], None, dst=0), "gather: tensor must be a torch.Tensor, got list"),
    "scatter(list)": (lambda: comm.scatter([1.0], None, src=0), "scatter: tensor must be a torch.Tensor, got list"),
    "all_gather_single(output list)": (lambda: comm.all_gather_single([0.0], torch.ones(1)),
                                       "all_gather: output must be a torch.Tensor, got list"),
    "all_gather_single(input list)": (lambda: comm.all_gather_single(torch.ones(1), [0.0]),
                                      "all_gather: input must be a torch.Tensor, got list"),
    "all_to_all_single(list)": (lambda: comm.all_to_all_single([0.0], torch.ones(1)),
                                "all_to_all: output must be a torch.Tensor, got list"),
    "send(list)": (lambda: comm.send([1.0], dst=0), "send: tensor must be a torch.Tensor, got list"),
    "recv(str)": (lambda: comm.recv("x", src=0), "recv: tensor must be a torch.Tensor, got str"),
    "all_reduce(group=str)": (lambda: comm.all_reduce(torch.ones(2), group="world"),
                              "group='world' (str) is not a process group"),
    "barrier(group=list)": (lambda: comm.barrier(group=[0]), "torch.distributed.new_group([0])"),
    "DataParallel(str)": (lambda: DataParallel("net"), "DataParallel: module must be a torch.nn.Module, got str"),
    "DataParallel(class)": (lambda: DataParallel(nn.Linear), "module is the class Linear, not a module"),
    "DataParallel(group=str)": (lambda: DataParallel(nn.Linear(2, 2), group="dp"),
                                "DataParallel: group='dp' (str) is not a process group"),
    "ZeRO(str)": (lambda: ZeRO("net", _sgd), "ZeRO: module must be a torch.nn.Module, got str"),
    "ParameterServer(str)": (lambda: ParameterServer("net", _sgd),
                             "ParameterServer: module must be a torch.nn.Module, got str"),
    "ShardedOptimizer(list)": (lambda: ShardedOptimizer([1], None),
                               "ShardedOptimizer: optimizer must be a torch.optim.Optimizer"),
    "ddp_comm_hook(algorithm)": (lambda: comm.ddp_comm_hook("ringg"), "ddp_comm_hook: algorithm='ringg'"),
    "isend(tag=str)": (lambda: comm.isend(torch.ones(1), dst=0, tag="a"), "send: tag must be an int, got str"),
    "isend(tag=-1)": (lambda: comm.isend(torch.ones(1), dst=0, tag=-1), "send: tag=-1 must be in 0 .. 2**31 - 1"),
    # uneven all-to-all: torch passed a negative size to gloo unchecked (the heap was corrupted)
    "all_to_all_single(negative split)": (
        lambda: comm.all_to_all_single(torch.empty(4), torch.ones(4), [5, -1], [5, -1]),
        "output_split_sizes=[5, -1] holds -1: every size is a whole number of rows >= 0"),
    "all_to_all_single(split count)": (lambda: comm.all_to_all_single(torch.empty(4), torch.ones(4), [4], [4, 0]),
                                       "input_split_sizes has 2 sizes for a group of 1 ranks"),
    "all_to_all_single(split sum)": (lambda: comm.all_to_all_single(torch.empty(4), torch.ones(4), [3], [4]),
                                     "output_split_sizes=[3] adds up to 3 rows, but dim 0 of the tensor has 4"),
    "all_to_all_single(split str)": (lambda: comm.all_to_all_single(torch.empty(4), torch.ones(4), "22", "22"),
                                     "output_split_sizes must be a list of 1 whole numbers"),
    "all_to_all_single(split float)": (lambda: comm.all_to_all_single(torch.empty(4), torch.ones(4), [4.0], [4]),
                                       "holds 4.0: every size is a whole number of rows >= 0"),
    "TensorParallel(group=str)": (lambda: TensorParallel(group="x"), "TensorParallel: group='x' (str) is not a process group"),
    "TensorParallel(sequence_parallel='no')": (lambda: TensorParallel(sequence_parallel="no"),
                                               "sequence_parallel must be True or False, got 'no'"),
    "TensorParallel(algorithm)": (lambda: TensorParallel(algorithm="nope"), "algorithm='nope' is not one of plait's"),
    "ColumnParallelLinear(tp=str)": (lambda: ColumnParallelLinear(4, 8, tp="x"),
                                     "ColumnParallelLinear: tp must be a plait.parallel.tensor.TensorParallel"),
    "ColumnParallelLinear(str size)": (lambda: ColumnParallelLinear("4", 8), "in_features must be a whole number"),
    "ColumnParallelLinear(negative)": (lambda: ColumnParallelLinear(4, -8), "out_features=-8 must be >= 1"),
    "RowParallelLinear(float)": (lambda: RowParallelLinear(4.5, 8), "in_features must be a whole number, got float"),
    "ParallelAttention(str heads)": (lambda: ParallelAttention(8, "2"), "heads must be a whole number, got str"),
    "ParallelMLP(str ffn)": (lambda: ParallelMLP(8, "16"), "ffn_hidden must be a whole number, got str"),
    "PipelineEngine(schedule=str)": (lambda: PipelineEngine("1f1b", {0: nn.Linear(2, 2)}, _sgd),
                                     "PipelineEngine: schedule must be a PipelineSchedule"),
    "PipelineEngine(stage_modules=str)": (lambda: PipelineEngine(one_f_one_b(1, 2), "x", _sgd),
                                          "stage_modules must be a dict of stage index -> nn.Module"),
}


VALUE_ERRORS = {"TensorParallel(algorithm)", "ColumnParallelLinear(negative)", "ddp_comm_hook(algorithm)", "isend(tag=-1)", "all_to_all_single(negative split)",
                "all_to_all_single(split count)", "all_to_all_single(split sum)", "all_to_all_single(split float)"}


def raise_each(rank, p):
    found = {}
    for name, (call, _) in CASES.items():
        try:
            call()
        except Exception as error:  # noqa: BLE001 - the test compares the kind
            found[name] = (type(error).__name__, str(error))
        else:
            found[name] = (None, "no error")
    return found


@pytest.mark.slow
def test_wrong_argument_types_are_named():
    found = run_distributed(raise_each, 1)[0]
    for name, (_, fragment) in CASES.items():
        kind, message = found[name]
        expected = "ValueError" if name in VALUE_ERRORS else "TypeError"
        assert kind == expected, (name, kind, message)
        assert fragment in message, (name, message)
