"""Sign: 1 bit per element (0 encodes as +1), majority vote or scaled decoding."""

import pytest
import torch

from plait.compress import Payload, Sign, pack_bits


def _x(numel=1000, seed=0):
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_unscaled_decodes_to_plus_minus_one_and_zero_to_plus_one():
    x = torch.tensor([3.0, -0.5, 0.0, -0.0, 2e-30, -7.0], dtype=torch.float64)
    assert Sign().decompress(Sign().compress(x)).tolist() == [1.0, -1.0, 1.0, 1.0, 1.0, -1.0]


def test_scaled_decodes_to_mean_magnitude_times_sign():
    x = _x()
    payload = Sign(scaled=True).compress(x)
    scale = payload.tensors["scale"]
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    # mean |x| = ||x||_1 / n, stored as float32 (relative rounding <= 2^-24)
    assert abs(float(scale) - float(x.abs().mean())) <= 2**-24 * float(x.abs().mean())
    signs = torch.where(x < 0, -1.0, 1.0).to(torch.float64)
    assert torch.equal(Sign(scaled=True).decompress(payload), signs * float(scale))


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000])
@pytest.mark.parametrize("scaled", [False, True])
def test_wire_size_is_one_bit_per_element(numel, scaled):
    compressor = Sign(scaled=scaled)
    payload = compressor.compress(_x(numel))
    expected = -(-numel // 8) + (4 if scaled else 0)  # ceil(n/8) bytes (+ the float32 scale)
    assert payload.nbytes == compressor.wire_nbytes(numel, torch.float32) == expected
    assert compressor.empty_payload(numel, torch.float64).nbytes == expected


def _signs_payload(signs):
    bits = pack_bits(torch.tensor([1 if s < 0 else 0 for s in signs], dtype=torch.uint8), 1)
    return Payload({"bits": bits}, len(signs), torch.float32)


def test_majority_vote_with_ties_to_zero():
    payloads = [_signs_payload(s) for s in ([1, 1, -1, -1, 1], [1, -1, -1, 1, 1], [-1, -1, -1, 1, 1],
                                            [1, -1, 1, -1, 1])]
    # column sums of the 4 votes: 2, -2, -2, 0, 4 -> signs 1, -1, -1, 0 (tie), 1
    assert Sign().aggregate(payloads).tolist() == [1.0, -1.0, -1.0, 0.0, 1.0]
    assert Sign().aggregate(payloads).dtype == torch.float32


def test_scaled_aggregate_is_the_mean_of_the_decoded_payloads():
    payloads = [_signs_payload(s) for s in ([1, -1, 1], [-1, -1, 1])]
    for payload, scale in zip(payloads, (2.0, 0.5)):
        payload.tensors["scale"] = torch.tensor([scale], dtype=torch.float32)
    # (2·[1, -1, 1] + 0.5·[-1, -1, 1]) / 2
    assert Sign(scaled=True).aggregate(payloads).tolist() == [0.75, -1.25, 1.25]


def test_bad_inputs():
    with pytest.raises(ValueError, match="Sign scaled must be True or False, got 1"):
        Sign(scaled=1)
    with pytest.raises(TypeError, match="sign compresses floating-point gradients, got torch.int64"):
        Sign().compress(torch.arange(3))
    with pytest.raises(ValueError, match="payloads encode different tensors"):
        Sign().aggregate([_signs_payload([1, 1]), _signs_payload([1, 1, 1])])
    with pytest.raises(ValueError, match="aggregate needs at least one payload"):
        Sign().aggregate([])
