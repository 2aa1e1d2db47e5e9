"""Tensor-parallel pieces that need no processes: sharding arithmetic, the
vocab-parallel cross-entropy's math at tp = 1, dropout mask slicing, error texts."""

import pytest
import torch
import torch.nn.functional as F

from plait.parallel.tensor import (
    ConsistentDropout,
    ShardSpec,
    check_tp_divides,
    valid_tp_sizes,
    vocab_parallel_cross_entropy,
)
from plait.parallel.tensor.sharding import shard_tensor


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_shards_concatenate_to_the_padded_tensor(size):
    full = torch.arange(67 * 3, dtype=torch.float64).view(67, 3)
    spec = ShardSpec(0, 67)
    shards = [shard_tensor(full, spec, rank, size) for rank in range(size)]
    assert all(shard.shape == (spec.shard_size(size), 3) for shard in shards)
    joined = torch.cat(shards)
    assert torch.equal(joined[:67], full) and not joined[67:].any()  # padding rows are zeros
    assert joined.shape[0] == spec.padded_size(size) == -(-67 // size) * size


def test_column_shards_along_dim_one():
    full = torch.arange(24.0).view(2, 12)
    shards = [shard_tensor(full, ShardSpec(1, 12), rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat(shards, dim=1), full)
    with pytest.raises(ValueError, match=r"expected size 10 along dim 1, got shape \(2, 12\)"):
        shard_tensor(full, ShardSpec(1, 10), 0, 4)


def test_cross_entropy_matches_torch_and_ignores_padding():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.randint(0, 6, (3, 5), generator=generator)
    loss = vocab_parallel_cross_entropy(logits, targets, vocab_size=6)  # columns 6, 7 are padding
    want = F.cross_entropy(logits[..., :6].reshape(-1, 6), targets.reshape(-1), reduction="none").view(3, 5)
    assert (loss - want).abs().max() < 1e-14  # same float64 log-sum-exp, different summation order
    loss.sum().backward()
    assert not logits.grad[..., 6:].any()  # padded columns take no probability, get no gradient
    check = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: vocab_parallel_cross_entropy(z, targets[0, :4], vocab_size=6), (check,))


def test_cross_entropy_errors():
    logits = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match=r"vocab_size=9 must be in \(0, 8\]"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), vocab_size=9)
    with pytest.raises(ValueError, match=r"logits \(2, 3, 8\) and targets \(2, 4\) disagree"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long))


def test_dropout_slices_are_the_full_mask():
    """Chunk r (along a dim) drawn by rank r equals chunk r of the full mask."""
    x = torch.ones(2, 4, 3, 3, dtype=torch.float64)
    full = ConsistentDropout(0.5)
    full.reseed(9)
    whole = full(x)
    for dim in (0, 1):
        parts = []
        for index in range(2):
            part = ConsistentDropout(0.5)
            part.reseed(9)
            parts.append(part(x.chunk(2, dim=dim)[index], x.shape, dim, index))
        assert torch.equal(torch.cat(parts, dim=dim), whole)
    assert set(whole.unique().tolist()) == {0.0, 2.0}  # inverted dropout: kept values scaled by 1/(1-p)
    full.eval()
    assert torch.equal(full(x), x)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        ConsistentDropout(1.0)


def test_tp_divisibility_errors_name_the_numbers():
    assert valid_tp_sizes(heads=12, ffn_hidden=48) == [1, 2, 3, 4, 6, 12]
    with pytest.raises(ValueError, match=r"^tp=5 does not divide heads=12 and ffn_hidden=48; valid tp values: "
                                         r"1, 2, 3, 4, 6, 12$"):
        check_tp_divides(5, heads=12, ffn_hidden=48)


def test_half_precision_logits_are_reduced_in_float32():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_(True)
    targets = torch.arange(4)
    loss = vocab_parallel_cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    want = F.cross_entropy(logits.detach().float(), targets, reduction="none")
    assert (loss - want).abs().max() < 1e-6  # the same float32 computation up to summation order
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
