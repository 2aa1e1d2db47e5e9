"""PowerSGD on one process: validation, byte counts, no-op without peers. The
numerics (exactness at full rank, error falling with the rank) run on gloo in
test_gloo.py, since a power step needs the other ranks' averages."""

import pytest
import torch

from plait.compress import GradBucket, PowerSGD, matrix_shape


def _bucket(shapes, step=0, index=0):
    numel = sum(torch.Size(shape).numel() for _, shape in shapes)
    buffer = torch.arange(numel, dtype=torch.float32)
    views, offset = [], 0
    for name, shape in shapes:
        size = torch.Size(shape).numel()
        views.append((name, buffer[offset : offset + size].view(shape)))
        offset += size
    return GradBucket(index, buffer, views, step)


SHAPES = [("fc1.weight", (16, 32)), ("fc1.bias", (16,)), ("conv.weight", (8, 3, 3, 3)), ("gain", ())]


def test_matrix_shape_reads_trailing_dims_as_columns():
    assert matrix_shape((16, 32)) == (16, 32)
    assert matrix_shape((8, 3, 3, 3)) == (8, 27)
    assert matrix_shape((16,)) is None and matrix_shape(()) is None and matrix_shape((0, 5)) is None


def test_validate_names_the_parameter_its_shape_and_the_fix():
    PowerSGD(4).validate([("fc2.weight", (4, 64)), ("fc2.bias", (4,))])  # rank == min(n, m) is allowed
    with pytest.raises(ValueError) as error:
        PowerSGD(8).validate([("fc1.weight", (16, 32)), ("fc2.weight", (4, 64))])
    assert str(error.value) == ("PowerSGD rank 8 is larger than the 4x64 gradient of 'fc2.weight' "
                                "(its rank is at most 4); use rank <= 4")
    conv = r"the 2x3x3x3 gradient of 'conv.weight' \(read as a 2x27 matrix, its rank is at most 2\)"
    with pytest.raises(ValueError, match=conv):
        PowerSGD(3).validate([("conv.weight", (2, 3, 3, 3))])


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 0}, "PowerSGD rank must be an integer >= 1, got 0"),
    ({"rank": 1.5}, "PowerSGD rank must be an integer >= 1, got 1.5"),
    ({"start_iter": -1}, "PowerSGD start_iter must be an integer >= 0, got -1"),
    ({"warm_start": "yes"}, "PowerSGD warm_start must be True or False, got 'yes'"),
    ({"seed": None}, "PowerSGD seed must be an int, got None"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PowerSGD(**kwargs)


def test_bucket_wire_nbytes_counts_n_plus_m_times_rank_per_matrix():
    bucket = _bucket(SHAPES)
    # fc1: (16 + 32)·2, conv: (8 + 27)·2, vectors 16 + 1 uncompressed; float32
    assert PowerSGD(2).bucket_wire_nbytes(bucket) == ((16 + 32) * 2 + (8 + 27) * 2 + 16 + 1) * 4
    # before start_iter the whole bucket goes uncompressed
    assert PowerSGD(2, start_iter=5).bucket_wire_nbytes(bucket) == bucket.buffer.numel() * 4
    assert PowerSGD(2, start_iter=5).bucket_wire_nbytes(_bucket(SHAPES, step=5)) < bucket.buffer.numel() * 4


def test_wire_nbytes_of_a_flat_tensor_reads_it_as_a_near_square_matrix():
    # 1000 elements -> 32 x 32 (ceil(sqrt(1000)) = 32 rows, ceil(1000/32) = 32 columns)
    assert PowerSGD(2).wire_nbytes(1000, torch.float32) == (32 + 32) * 2 * 4
    assert PowerSGD(1).wire_nbytes(12, torch.float64) == (4 + 3) * 8
    assert PowerSGD(1).wire_nbytes(0, torch.float64) == 0
    with pytest.raises(TypeError, match="floating-point gradients, got torch.int64"):
        PowerSGD(1).wire_nbytes(10, torch.int64)


def test_reduce_without_peers_is_a_no_op():
    bucket = _bucket(SHAPES)
    before = bucket.buffer.clone()
    compressor = PowerSGD(2)
    assert compressor.reduce(bucket) == 0
    assert torch.equal(bucket.buffer, before) and compressor.errors == {} and compressor.q_factors == {}


def test_describe():
    assert PowerSGD(2).describe() == "powersgd(rank=2)"
    assert PowerSGD(1, warm_start=False, start_iter=10).describe() == "powersgd(rank=1,start_iter=10,warm_start=False)"
