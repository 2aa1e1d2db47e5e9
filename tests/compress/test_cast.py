"""FP16 / BF16: the payload is the cast, 2 bytes per element."""

import pytest
import torch

from plait.compress import BF16, FP16, GradBucket


@pytest.mark.parametrize("compressor, wire", [(FP16(), torch.float16), (BF16(), torch.bfloat16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_round_trip_equals_the_casts(compressor, wire, dtype):
    x = torch.randn(101, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    payload = compressor.compress(x)
    assert torch.equal(payload.tensors["values"], x.to(wire))
    assert torch.equal(compressor.decompress(payload), x.to(wire).to(dtype))
    assert payload.nbytes == compressor.wire_nbytes(101, dtype) == 202
    assert compressor.ratio(101, torch.float32) == 0.5


def test_payload_never_aliases_the_gradient():
    x = torch.ones(4, dtype=torch.float16)
    payload = FP16().compress(x)
    x.zero_()
    assert payload.tensors["values"].tolist() == [1.0] * 4


def test_aggregate_is_the_mean_of_the_decoded_payloads():
    xs = [torch.tensor([1.0, 2.0, 1e5]), torch.tensor([3.0, -2.0, 1e5])]
    # decoded values are summed in float32, so 1e5 + 1e5 does not overflow float16's 65504
    assert BF16().aggregate([BF16().compress(x) for x in xs]).tolist() == [2.0, 0.0, 99840.0]
    assert FP16().aggregate([FP16().compress(x) for x in xs[:1]]).tolist()[:2] == [1.0, 2.0]


def test_reduce_without_a_group_is_a_no_op():
    bucket = GradBucket(0, torch.arange(5.0))
    assert FP16().reduce(bucket) == 0 and bucket.buffer.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_names():
    assert (FP16().describe(), BF16().describe()) == ("fp16", "bf16")
