"""TopK and RandomK: which elements they keep, their wire format and aggregation."""

import math

import pytest
import torch

from plait.compress import Payload, RandomK, TopK


def _x(numel=1000, dtype=torch.float64, seed=0):
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("ratio, numel, k", [(0.01, 1000, 10), (0.07, 100, 7), (0.001, 10, 1), (1, 5, 5),
                                             (0.3, 7, 3)])
def test_k_is_ceil_of_ratio_times_n_at_least_one(ratio, numel, k):
    # 0.07 * 100 = 7.000000000000001 in binary floating point, and still means 7
    assert TopK(ratio).kept(numel) == RandomK(ratio).kept(numel) == k


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    x = _x()
    payload = TopK(0.01).compress(x)
    k = 10
    indices = payload.tensors["indices"]
    assert indices.dtype == torch.int32 and indices.numel() == k
    assert set(indices.tolist()) == set(x.abs().topk(k).indices.tolist())
    assert torch.equal(payload.tensors["values"], x[indices.long()])
    decoded = TopK(0.01).decompress(payload)
    kept = torch.zeros_like(x, dtype=torch.bool)
    kept[indices.long()] = True
    assert torch.equal(decoded[kept], x[kept]) and not decoded[~kept].any()


def test_randomk_keeps_k_distinct_indices_reproducibly():
    x = _x()
    compressor = RandomK(0.05, seed=3)
    payload = compressor.compress(x, rank=1, step=4, key=2)
    indices = payload.tensors["indices"].tolist()
    assert len(indices) == len(set(indices)) == 50
    assert torch.equal(payload.tensors["values"], x[payload.tensors["indices"].long()])
    again = RandomK(0.05, seed=3).compress(x, rank=1, step=4, key=2)
    assert torch.equal(again.tensors["indices"], payload.tensors["indices"])
    # another rank, step or key draws another set (50 of 1000: identical sets would be a bug)
    for other in ({"rank": 0, "step": 4, "key": 2}, {"rank": 1, "step": 5, "key": 2}, {"rank": 1, "step": 4, "key": 3}):
        assert set(compressor.compress(x, **other).tensors["indices"].tolist()) != set(indices)
    assert torch.equal(compressor.decompress(payload)[payload.tensors["indices"].long()], payload.tensors["values"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000])
def test_wire_size_is_k_times_itemsize_plus_4(dtype, numel):
    for compressor in (TopK(0.05), RandomK(0.05)):
        payload = compressor.compress(_x(numel, dtype))
        itemsize = torch.empty((), dtype=dtype).element_size()
        k = max(1, math.ceil(0.05 * numel))
        assert payload.nbytes == compressor.wire_nbytes(numel, dtype) == k * (itemsize + 4)
        assert compressor.ratio(numel, dtype) == k * (itemsize + 4) / (numel * itemsize)
        assert payload.tensors["values"].dtype == dtype


def test_aggregate_scatter_adds_every_rank_then_divides_by_p():
    def payload(values, indices):
        return Payload({"values": torch.tensor(values, dtype=torch.float64),
                        "indices": torch.tensor(indices, dtype=torch.int32)}, 6, torch.float64)

    payloads = [payload([1.0, 2.0], [0, 3]), payload([4.0, -2.0], [3, 5]), payload([3.0, 6.0], [0, 1])]
    # by hand: index 0: 1 + 3, index 1: 6, index 3: 2 + 4, index 5: -2; divided by p = 3
    expected = torch.tensor([4.0, 6.0, 0.0, 6.0, 0.0, -2.0], dtype=torch.float64) / 3
    assert torch.equal(TopK(0.5).aggregate(payloads), expected)
    assert torch.equal(RandomK(0.5).aggregate(payloads), expected)


def test_empty_payload_matches_the_wire_format():
    empty = TopK(0.1).empty_payload(95, torch.float32)
    assert {name: (tuple(t.shape), t.dtype) for name, t in empty.tensors.items()} == {
        "values": ((10,), torch.float32), "indices": ((10,), torch.int32)}
    assert empty.nbytes == TopK(0.1).wire_nbytes(95, torch.float32)


@pytest.mark.parametrize("ratio, shown", [(0, "got 0"), (1.5, "got 1.5"), (-0.1, "got -0.1"),
                                          (float("nan"), "got nan"), ("0.1", "got '0.1' \\(str\\)"),
                                          (None, "got None"), (True, "got True")])
def test_bad_ratio_names_the_value(ratio, shown):
    with pytest.raises(ValueError, match=rf"TopK ratio must be (a number )?in \(0, 1\], {shown}"):
        TopK(ratio)
    with pytest.raises(ValueError, match=rf"RandomK ratio must be (a number )?in \(0, 1\], {shown}"):
        RandomK(ratio)


def test_non_floating_gradients_are_a_type_error():
    with pytest.raises(TypeError, match=r"topk\(ratio=0.1\) compresses floating-point gradients, got torch.int64"):
        TopK(0.1).compress(torch.arange(10))
    with pytest.raises(TypeError, match="floating-point gradients, got torch.int32"):
        RandomK(0.1).wire_nbytes(10, torch.int32)
    with pytest.raises(ValueError, match="RandomK seed must be an int, got 1.5"):
        RandomK(0.1, seed=1.5)
