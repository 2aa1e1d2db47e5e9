"""Pure functions of `plait bench`: sizes, busbw factors, iteration rule, oracle,
summary arithmetic and row formatting. No processes."""

import argparse
import math
import re

import pytest
import torch

from plait.bench import report
from plait.bench.buffers import (COLLECTIVES, canonical_dtype_name, count_wrong, expected_output,
                                 fill_inputs, make_buffers)
from plait.bench.collectives import (BenchConfig, BenchRow, available_algorithms, buffer_plan,
                                     busbw_factor, choose_iteration_counts, message_sizes)
from plait.cli.bench import parse_collective, parse_nbytes, resolve_algorithms


@pytest.mark.parametrize("text, nbytes", [
    ("1", 1), ("512", 512), ("1K", 1024), ("1k", 1024), ("64M", 64 << 20), ("1G", 1 << 30),
    ("2KB", 2048), ("4KiB", 4096), ("1.5K", 1536), (" 8M ", 8 << 20), ("1T", 1 << 40),
])
def test_parse_nbytes(text, nbytes):
    assert parse_nbytes(text) == nbytes


@pytest.mark.parametrize("text", ["", "K", "1X", "-1K", "0", "1.3", "0.1K", "1KK", "one"])
def test_parse_nbytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        parse_nbytes(text)


def test_parse_collective_aliases_and_error():
    assert parse_collective("all-reduce") == "all_reduce"
    assert parse_collective("allgather") == "all_gather"
    assert parse_collective("All_To_All") == "all_to_all"
    with pytest.raises(argparse.ArgumentTypeError, match="valid: all_reduce, reduce_scatter"):
        parse_collective("allreduse")


@pytest.mark.parametrize("collective, p, factor", [
    ("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_reduce", 1, 0.0),
    ("all_gather", 4, 0.75), ("reduce_scatter", 3, 2 / 3), ("all_to_all", 8, 7 / 8),
    ("gather", 4, 0.75), ("scatter", 5, 0.8), ("broadcast", 4, 1.0), ("reduce", 7, 1.0),
    ("barrier", 4, 0.0),
])
def test_busbw_factor(collective, p, factor):
    assert busbw_factor(collective, p) == pytest.approx(factor)


def test_busbw_factor_unknown_collective_lists_valid():
    with pytest.raises(ValueError, match="valid: all_reduce"):
        busbw_factor("allreduce", 4)


def test_message_sizes_like_nccl_tests():
    assert message_sizes(1024, 8192, 2) == [1024, 2048, 4096, 8192]
    assert message_sizes(1024, 10000, 4) == [1024, 4096]
    assert len(message_sizes(1 << 10, 64 << 20, 2)) == 17
    with pytest.raises(ValueError):
        message_sizes(4096, 1024, 2)


def test_buffer_plan_rounds_to_whole_chunks():
    # all_reduce: the whole buffer; count = elements.
    assert buffer_plan("all_reduce", 1024, 3, 4) == (256, 1024)
    assert buffer_plan("all_reduce", 1022, 3, 4) == (255, 1020)
    # chunked: size = p * chunk, count = per-rank chunk (nccl-tests' paramcount).
    assert buffer_plan("all_gather", 1024, 3, 4) == (85, 1020)
    assert buffer_plan("reduce_scatter", 1024, 4, 4) == (64, 1024)
    assert buffer_plan("all_to_all", 8, 4, 4) == (0, 0)
    assert buffer_plan("barrier", 1024, 4, 4) == (0, 0)


def test_choose_iteration_counts():
    # Fast calls: all iters and all remaining warm-up.
    assert choose_iteration_counts(1e-4, 20, 3, 0.5) == (20, 3)
    # 0.1 s per call, 0.5 s budget: 5 timed calls, warm-up capped at 5.
    assert choose_iteration_counts(0.1, 20, 8, 0.5) == (5, 5)
    # Slower than the budget: at least one timed call, warm-up capped at 1.
    assert choose_iteration_counts(2.0, 20, 3, 0.5) == (1, 1)
    # Budget 0 disables scaling.
    assert choose_iteration_counts(2.0, 20, 3, 0.0) == (20, 3)
    assert choose_iteration_counts(0.0, 7, 2, 0.5) == (7, 2)


def test_geometric_mean():
    assert report.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert report.geometric_mean([0.5, 2.0, 1.0]) == pytest.approx(1.0)
    assert math.isnan(report.geometric_mean([]))
    with pytest.raises(ValueError):
        report.geometric_mean([1.0, 0.0])


def _row(algorithm, size_bytes, time_us, error=None):
    row = BenchRow(collective="all_reduce", algorithm=algorithm, nprocs=4, size_bytes=size_bytes,
                   count=size_bytes // 4, dtype="float32", op="sum", root=-1, iters=3, error=error)
    if error is None:
        row.time_us = time_us
        row.algbw_gbps = size_bytes / time_us / 1e3
        row.busbw_gbps = 1.5 * row.algbw_gbps
    return row


def _rows():
    return [
        _row("torch", 1024, 100.0), _row("torch", 2048, 100.0), _row("torch", 4096, 400.0),
        _row("ring", 1024, 200.0), _row("ring", 2048, 50.0), _row("ring", 4096, 100.0),
        _row("tree", 1024, 50.0), _row("tree", 2048, 100.0), _row("tree", 4096, None, error="boom"),
    ]


def test_ratios_and_best_per_size():
    ratios = report.ratios_vs_baseline(_rows())
    assert ratios["ring"] == {1024: 0.5, 2048: 2.0, 4096: 4.0}
    assert ratios["tree"] == {1024: 2.0, 2048: 1.0}  # the failed size is left out
    best = report.best_per_size(_rows())
    assert best == {1024: ("tree", 2.0), 2048: ("ring", 2.0), 4096: ("ring", 4.0)}


def test_summary_lines():
    text = "\n".join(report.summary_lines(_rows()))
    assert all(line.startswith("#") for line in text.splitlines())
    assert re.search(r"#\s+ring\s+1\.587x\s+faster at 2/3 sizes", text)  # (0.5*2*4)^(1/3)
    assert re.search(r"#\s+tree\s+1\.414x\s+faster at 1/2 sizes", text)
    assert "Best plait vs torch, all sizes: 2.520x (geomean over 3 sizes)" in text  # 16^(1/3)
    assert report.summary_lines([_row("torch", 1024, 1.0)])[0].startswith("# Summary: only torch")


def test_summary_by_size_range():
    rows = [_row(algorithm, size, time_us) for algorithm, size, time_us in [
        ("torch", 1024, 10.0), ("torch", 1 << 20, 100.0), ("torch", 8 << 20, 800.0),
        ("ring", 1024, 20.0), ("ring", 1 << 20, 25.0), ("ring", 8 << 20, 200.0),
    ]]
    text = "\n".join(report.summary_lines(rows))
    assert "sizes < 64K: 0.500x (geomean over 1 sizes)" in text
    assert "sizes 64K-4M: 4.000x (geomean over 1 sizes)" in text
    assert "sizes >= 4M: 4.000x (geomean over 1 sizes)" in text
    assert "all sizes: 2.000x (geomean over 3 sizes)" in text


def test_format_row_matches_nccl_tests_columns():
    line = report.format_row(_row("ring", 1024, 123.456))
    fields = line.split()
    assert fields == ["1024", "256", "float", "sum", "-1", "123.5", "0.008", "0.012", "N/A"]
    assert report.format_row(_row("ring", 1024, 50.0, error="ValueError: no")).startswith("# error")
    header = report.COLUMN_HEADER.splitlines()[0].lstrip("#").split()
    assert header == ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"]


def test_config_validation_names_every_problem():
    with pytest.raises(ValueError) as error:
        BenchConfig(collective="all_reduce", iters=0, factor=1, op="xor", dtype="float8")
    message = str(error.value)
    for fragment in ("iters(0)", "factor(1)", "op 'xor'", "dtype 'float8'"):
        assert fragment in message
    with pytest.raises(ValueError, match="avg needs a floating dtype"):
        BenchConfig(collective="all_reduce", op="avg", dtype="int32")
    assert BenchConfig(collective="all_reduce", dtype="float").dtype == "float32"
    assert canonical_dtype_name("half") == "float16"


def test_resolve_algorithms():
    valid = available_algorithms("all_reduce")
    assert valid[0] == "torch"
    assert resolve_algorithms(None, "all_reduce") == tuple(valid)
    assert resolve_algorithms("torch,torch", "all_reduce") == ("torch",)
    # plait's default choice per size runs by default, last
    assert resolve_algorithms("auto,torch", "all_reduce") == ("auto", "torch")
    assert valid[-1] == "auto" and "ring" in valid
    with pytest.raises(ValueError, match=r"unknown algorithm\(s\) 'rign' for all_reduce; valid: torch"):
        resolve_algorithms("torch,rign", "all_reduce")


def _simulate(collective, op, p, count, root, dtype, seed=7):
    """Each rank's buffers after a perfect collective, built from the oracle itself."""
    outputs = []
    for rank in range(p):
        buffers = make_buffers(collective, count, dtype, torch.device("cpu"), rank, p, root)
        fill_inputs(buffers, collective, rank, p, count, seed)
        oracle = expected_output(collective, op, rank, p, root, count, dtype, seed)
        if oracle is not None:
            expected = oracle[0].to(dtype)
            if collective in ("reduce_scatter", "all_gather", "all_to_all"):
                buffers.output.copy_(expected)
            elif collective == "gather":
                for index, chunk in enumerate(buffers.chunks):
                    chunk.copy_(expected[index * count:(index + 1) * count])
            else:
                buffers.tensor.copy_(expected)
        outputs.append(buffers)
    return outputs


@pytest.mark.parametrize("collective", [name for name in COLLECTIVES if name != "barrier"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_oracle_accepts_right_and_counts_wrong(collective, dtype):
    p, count, root, seed = 3, 5, 1, 7
    for rank, buffers in enumerate(_simulate(collective, "sum", p, count, root, dtype, seed)):
        assert count_wrong(buffers, collective, "sum", rank, p, root, count, seed) == 0
        checked = expected_output(collective, "sum", rank, p, root, count, dtype, seed) is not None
        if not checked:
            continue
        target = {"reduce_scatter": buffers.output, "all_gather": buffers.output,
                  "all_to_all": buffers.output}.get(collective, buffers.tensor)
        target = buffers.chunks[0] if collective == "gather" else target
        target[:2] += 3  # far outside any rounding tolerance
        assert count_wrong(buffers, collective, "sum", rank, p, root, count, seed) == 2


def test_oracle_float_tolerance_is_rounding_sized():
    p, count, seed = 4, 1000, 3
    dtype = torch.float16
    buffers = _simulate("all_reduce", "sum", p, count, 0, dtype, seed)[0]
    # Summing in float16 in another order stays within p * eps * sum|x|.
    inputs = [make_buffers("all_reduce", count, dtype, torch.device("cpu"), rank, p, 0)
              for rank in range(p)]
    for rank, other in enumerate(inputs):
        fill_inputs(other, "all_reduce", rank, p, count, seed)
    reversed_sum = inputs[3].tensor.clone()
    for other in reversed(inputs[:3]):
        reversed_sum += other.tensor
    buffers.tensor.copy_(reversed_sum)
    assert count_wrong(buffers, "all_reduce", "sum", 0, p, 0, count, seed) == 0
