"""The contract: Payload bytes, GradBucket checks, the payload byte format, seeds."""

import pytest
import torch

from plait.compress import (
    QSGD,
    GradBucket,
    Payload,
    Sign,
    TopK,
    derive_seed,
    payload_from_bytes,
    payload_to_bytes,
)


def test_payload_nbytes_sums_its_tensors():
    payload = Payload({"values": torch.zeros(3, dtype=torch.float64), "indices": torch.zeros(3, dtype=torch.int32),
                       "bits": torch.zeros(5, dtype=torch.uint8)}, 100, torch.float64)
    assert payload.nbytes == 3 * 8 + 3 * 4 + 5


@pytest.mark.parametrize("compressor", [TopK(0.1), Sign(scaled=True), QSGD(2)], ids=lambda c: c.describe())
def test_payload_bytes_round_trip_at_odd_offsets(compressor):
    # Sign's 13 bytes of bits come before its float32 scale: the scale sits at an odd offset
    x = torch.randn(97, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    payload = compressor.compress(x)
    data = payload_to_bytes(payload)
    assert data.dtype == torch.uint8 and data.numel() == payload.nbytes
    back = payload_from_bytes(data, compressor.empty_payload(97, torch.float64))
    assert back.numel == 97 and back.dtype == torch.float64
    for name, tensor in payload.tensors.items():
        assert torch.equal(back.tensors[name], tensor) and back.tensors[name].dtype == tensor.dtype
    with pytest.raises(ValueError, match="got 3 bytes, the template holds"):
        payload_from_bytes(data[:3], payload)


def test_grad_bucket_wants_a_flat_buffer():
    GradBucket(0, torch.zeros(6), [("w", torch.zeros(6)[:6].view(2, 3))], step=3)
    with pytest.raises(ValueError, match=r"GradBucket 1: buffer must be a flat contiguous 1-D tensor, got \(2, 3\)"):
        GradBucket(1, torch.zeros(2, 3))


def test_seeds_are_stable_and_spread():
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    seeds = {derive_seed(seed, rank, step) for seed in range(3) for rank in range(8) for step in range(50)}
    assert len(seeds) == 3 * 8 * 50 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(0, 1, 0) != derive_seed(0, 0, 1)


def test_ratio_of_an_empty_tensor():
    with pytest.raises(ValueError, match="ratio of an empty tensor is undefined"):
        TopK(0.1).ratio(0, torch.float32)
