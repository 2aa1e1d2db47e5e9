"""ErrorFeedback: the residual is exactly what the inner compressor dropped."""

import pytest
import torch

from plait.compress import QSGD, BF16, ErrorFeedback, GradBucket, PowerSGD, RandomK, Sign, TopK


def _x(seed, numel=300):
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("inner", [TopK(0.05), RandomK(0.05), Sign(scaled=True), QSGD(4), BF16()],
                         ids=lambda c: c.describe())
def test_residual_is_exactly_the_dropped_part_and_accumulates(inner):
    compressor = ErrorFeedback(inner)
    x0, x1 = _x(0), _x(1)
    payload0 = compressor.compress(x0, step=0, key=4)
    e0 = compressor.residual(4)
    assert torch.equal(e0, x0 - inner.decompress(payload0))  # e_0 = 0, so (x + e) = x
    payload1 = compressor.compress(x1, step=1, key=4)
    # step 1 compresses x1 + e0 and keeps what it drops: exactly, no tolerance
    assert torch.equal(payload1.tensors[next(iter(payload1.tensors))],
                       inner.compress(x1 + e0, step=1, key=4).tensors[next(iter(payload1.tensors))])
    assert torch.equal(compressor.residual(4), (x1 + e0) - inner.decompress(payload1))
    # nothing is lost, only delayed: D(m0) + D(m1) + e1 = x0 + x1 (to rounding of the additions)
    sent = inner.decompress(payload0) + inner.decompress(payload1) + compressor.residual(4)
    assert torch.allclose(sent, x0 + x1, rtol=0, atol=1e-12)


def test_residuals_are_kept_per_key_and_by_numel_without_one():
    compressor = ErrorFeedback(TopK(0.1))
    compressor.compress(_x(0), key=0)
    compressor.compress(_x(1), key=1)
    compressor.compress(_x(2, numel=50))
    assert set(compressor.residuals) == {0, 1, ("numel", 50)}
    with pytest.raises(ValueError, match=r"residual under key 0 holds 300 elements .* this tensor has 50"):
        compressor.compress(_x(3, numel=50), key=0)
    compressor.reset()
    assert compressor.residuals == {}


def test_reduce_keys_the_residual_on_the_bucket_index_and_delegates_the_rest():
    compressor = ErrorFeedback(TopK(0.01))
    assert compressor.describe() == "topk(ratio=0.01)+ef" and compressor.name == "topk+ef"
    assert compressor.wire_nbytes(1000, torch.float32) == TopK(0.01).wire_nbytes(1000, torch.float32)
    assert compressor.reduce(GradBucket(3, _x(0))) == 0  # no process group: one rank, a no-op
    assert compressor.residuals == {}


def test_wrapping_what_already_has_error_feedback_is_refused():
    with pytest.raises(ValueError, match=r"powersgd\(rank=2\) keeps its own error feedback .*without ErrorFeedback"):
        ErrorFeedback(PowerSGD(2))
    with pytest.raises(ValueError, match=r"already has error feedback; wrapping it twice"):
        ErrorFeedback(ErrorFeedback(TopK(0.1)))
    with pytest.raises(ValueError, match="ErrorFeedback wraps a PayloadCompressor"):
        ErrorFeedback("topk")


def test_unscaled_sign_is_refused():
    from plait.compress import Sign

    with pytest.raises(ValueError, match=r"use ErrorFeedback\(Sign\(scaled=True\)\)"):
        ErrorFeedback(Sign())
    ErrorFeedback(Sign(scaled=True))  # EF-signSGD
