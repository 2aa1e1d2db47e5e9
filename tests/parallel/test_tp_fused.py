"""The fused tensor-parallel linear maps (plait.parallel.tensor.linear_ops) on real
gloo processes: bit for bit what the composed mappings give (forward values and every
gradient, with and without sequence parallelism, float32 / float64 / bfloat16, a
non-contiguous upstream gradient), and the backward's input-gradient collective issued
asynchronously before the weight-gradient GEMM and waited for after it with
``async_grad_reduce=True`` (synchronously, on the CPU's default).

The order is read with sys.setprofile on the thread running the backward (the autograd
engine runs a CPU graph's Python backward on the caller's thread): the calls to
``mm`` and to plait.comm's collectives with their ``async_op``, and ``Handle.wait``.
"""

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F

from plait import comm
from plait.parallel.tensor import UNSHARDED, new_tensor_parallel, parallel_input, parallel_output
from plait.parallel.tensor.linear_ops import column_parallel_linear, reduce_partial, row_parallel_linear
from plait.testing import run_distributed

S, B, IN, OUT = 8, 3, 12, 10  # S divides by 2 (sequence parallelism); OUT and IN per rank


def _draw(seed, *shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _leaves(*tensors):
    return [tensor.clone().requires_grad_(True) for tensor in tensors]


def _run(function, tensors, grad):
    """function(*leaves) and its backward of ``grad``: (output, input/weight/bias grads)."""
    leaves = _leaves(*tensors)
    out = function(*leaves)
    out.backward(grad)
    return [out.detach(), *[leaf.grad for leaf in leaves]], type(out.grad_fn).__name__


def fused_against_composed(rank, world_size):
    """{case: (autograd node of the fused call, every result bitwise equal)} on this rank."""
    base = new_tensor_parallel(world_size)
    results = {}
    try:
        for sp in (False, True):
            tp = dataclasses.replace(base, sequence_parallel=sp)
            rows = S // world_size if sp else S
            first = rank * rows if sp else 0
            for dtype in (torch.float32, torch.float64, torch.bfloat16):
                x_full = _draw(1, S, B, IN, dtype=dtype)  # the same on every rank
                x = x_full[first:first + rows].contiguous()  # replicated, or this rank's sequence shard
                weight, bias = _draw(10 + rank, OUT, IN, dtype=dtype), _draw(20 + rank, OUT, dtype=dtype)
                # column-parallel: an upstream gradient laid out (b, s, out) and transposed, as the logits' is
                grad = _draw(30 + rank, B, S, OUT, dtype=dtype).transpose(0, 1)
                fused, node = _run(lambda x, w, b: column_parallel_linear(x, w, b, tp), (x, weight, bias), grad)
                composed, _ = _run(lambda x, w, b: F.linear(parallel_input(x, tp), w, b), (x, weight, bias), grad)
                results[f"column sp={sp} {dtype}"] = (node, all(map(torch.equal, fused, composed)))
                # row-parallel: X split by features (different on every rank), W (OUT, IN/p)
                x_row = _draw(40 + rank, S, B, IN, dtype=dtype)
                grad = _draw(50 + rank, rows, B, OUT, dtype=dtype)
                fused, node = _run(lambda x, w: row_parallel_linear(x, w, tp), (x_row, weight), grad)
                composed, _ = _run(lambda x, w: parallel_output(F.linear(x, w), tp), (x_row, weight), grad)
                results[f"row sp={sp} {dtype}"] = (node, all(map(torch.equal, fused, composed)))
                # a partial sum the caller owns (the embedding's), reduced in place
                grad = _draw(60 + rank, rows, B, IN, dtype=dtype)
                fused, node = _run(lambda x: reduce_partial(x * 3.0, tp), (x_row,), grad)
                composed, _ = _run(lambda x: parallel_output(x * 3.0, tp), (x_row,), grad)
                results[f"partial sp={sp} {dtype}"] = (node, all(map(torch.equal, fused, composed)))
        return results
    finally:
        torch.distributed.destroy_process_group(base.group)


def backward_order(rank, world_size, sequence_parallel, async_grad_reduce):
    """The calls the column-parallel backward makes, in order: ("mm",), (collective,
    async_op), ("wait",)."""
    base = new_tensor_parallel(world_size, sequence_parallel=sequence_parallel)
    tp = dataclasses.replace(base, async_grad_reduce=async_grad_reduce)
    try:
        rows = S // world_size if sequence_parallel else S
        x = _draw(1, rows, B, IN, dtype=torch.float32).requires_grad_(True)
        weight = _draw(2 + rank, OUT, IN, dtype=torch.float32).requires_grad_(True)
        out = column_parallel_linear(x, weight, None, tp)
        grad = torch.ones_like(out)
        events = []
        collectives = {comm.all_reduce.__code__: "all_reduce", comm.reduce_scatter_single.__code__: "reduce_scatter"}

        def trace(frame, event, arg):
            if event == "c_call" and getattr(arg, "__name__", "") == "mm":
                events.append(("mm",))
            elif event == "call" and frame.f_code in collectives:
                events.append((collectives[frame.f_code], frame.f_locals["async_op"]))
            elif event == "call" and frame.f_code is comm.Handle.wait.__code__:
                events.append(("wait",))

        sys.setprofile(trace)
        try:
            out.backward(grad)
        finally:
            sys.setprofile(None)
        return events
    finally:
        torch.distributed.destroy_process_group(base.group)


@pytest.mark.slow
def test_fused_linear_maps_are_bitwise_the_composed_mappings():
    for rank, results in enumerate(run_distributed(fused_against_composed, 2)):
        assert len(results) == 18
        fused_nodes = {"column": "ColumnParallelLinearFunctionBackward", "row": "RowParallelLinearFunctionBackward",
                       "partial": "ReduceOwnedBackward"}
        wrong = {case: result for case, result in results.items()
                 if not result[1] or ("sp=False" in case or not case.startswith("partial"))
                 and result[0] != fused_nodes[case.split()[0]]}
        assert not wrong, f"rank {rank}: (autograd node, bitwise equal) {wrong}"


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_input_gradient_collective_is_issued_before_the_weight_gradient_gemm(sequence_parallel):
    collective = "reduce_scatter" if sequence_parallel else "all_reduce"
    for rank, events in enumerate(run_distributed(backward_order, 2, sequence_parallel, True)):
        assert events == [("mm",), (collective, True), ("mm",), ("wait",)], f"rank {rank}: {events}"
    # the CPU default: synchronous, done before dW (plait's comm thread would compete for the cores)
    for rank, events in enumerate(run_distributed(backward_order, 2, sequence_parallel, None)):
        calls = [event for event in events if event != ("wait",)]  # a sync call may wait inside plait.comm
        assert calls == [("mm",), (collective, False), ("mm",)], f"rank {rank}: {events}"


def test_async_grad_reduce_is_a_bool_or_none():
    with pytest.raises(TypeError, match="async_grad_reduce must be True, False or None"):
        dataclasses.replace(UNSHARDED, async_grad_reduce="yes")
    assert UNSHARDED.overlaps_grad_reduce(torch.device("cuda")) and not UNSHARDED.overlaps_grad_reduce(
        torch.device("cpu"))
