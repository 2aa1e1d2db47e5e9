"""QSGD: unbiased stochastic quantisation onto the grid ±norm·l/s."""

import math

import pytest
import torch

from plait.compress import QSGD


def _x(numel=200, seed=0, dtype=torch.float64):
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("bits, levels", [(2, 1), (4, 7), (8, 127)])
def test_default_levels_fill_the_level_bits(bits, levels):
    assert QSGD(bits).levels == levels


@pytest.mark.parametrize("bits, levels", [(2, None), (4, None), (4, 3), (8, None)])
def test_every_value_is_on_the_grid_and_the_norm_is_rounded_up(bits, levels):
    x = _x()
    compressor = QSGD(bits, levels)
    payload = compressor.compress(x, rank=2, step=1)
    norm = float(payload.tensors["norm"])
    assert norm >= float(x.norm()) and norm - float(x.norm()) <= 2**-23 * float(x.norm())
    s = compressor.levels
    q = compressor.decompress(payload)
    step_size = norm / s
    grid_index = (q / step_size).round()  # the integer l in -s..s of each q_i = l·norm/s
    assert int(grid_index.abs().max()) <= s
    assert torch.equal(q, grid_index * step_size)  # exactly on the grid, not just close to it
    # q_i is zero or has x_i's sign, and rounds |x_i| to a neighbouring level
    assert bool(((q == 0) | (q.sign() == x.sign())).all())
    assert bool(((q.abs() - x.abs()).abs() < step_size * (1 + 1e-12)).all())


def test_unbiased_mean_over_seeds_converges_to_x():
    # Var(q_i) = (norm/s)^2 · f(1-f) <= (norm/s)^2 / 4, so the mean of N independent draws has
    # standard error <= norm/(2 s sqrt(N)). Every element must lie within 5 of those (for a
    # Gaussian, P(|z| > 5) = 6e-7 per element; 200 elements); and the mean must be closer to
    # x than any single draw is (tests that the errors cancel, not just that they are bounded).
    x = _x(200)
    compressor = QSGD(2)  # s = 1: the coarsest grid, the largest variance
    draws = 2000
    total = torch.zeros_like(x)
    for seed in range(draws):
        total += compressor.decompress(compressor.compress(x, rank=0, step=seed))
    mean = total / draws
    standard_error = float(x.norm()) / (2 * compressor.levels * math.sqrt(draws))
    assert float((mean - x).abs().max()) <= 5 * standard_error
    single = compressor.decompress(compressor.compress(x, rank=0, step=0))
    assert float((mean - x).norm()) < 0.1 * float((single - x).norm())


def test_reproducible_from_seed_rank_step_key():
    x = _x()
    first = QSGD(4, seed=9).compress(x, rank=1, step=3, key=0)
    assert torch.equal(QSGD(4, seed=9).compress(x, rank=1, step=3, key=0).tensors["codes"], first.tensors["codes"])
    assert not torch.equal(QSGD(4, seed=9).compress(x, rank=2, step=3, key=0).tensors["codes"], first.tensors["codes"])


def test_zero_gradient_encodes_to_zero():
    compressor = QSGD(4)
    payload = compressor.compress(torch.zeros(13))
    assert float(payload.tensors["norm"]) == 0.0
    assert torch.equal(compressor.decompress(payload), torch.zeros(13))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000])
def test_wire_size_is_packed_codes_plus_the_norm(bits, numel):
    compressor = QSGD(bits)
    payload = compressor.compress(_x(numel, dtype=torch.float32))
    # one float32 norm per chunk of 512 elements (1000 elements: 2 chunks)
    assert payload.nbytes == compressor.wire_nbytes(numel, torch.float32) == -(-numel * bits // 8) + 4 * -(-numel // 512)
    assert compressor.decompress(payload).dtype == torch.float32


def test_aggregate_is_the_mean_of_the_decoded_payloads():
    compressor = QSGD(8)
    payloads = [compressor.compress(_x(50, seed=r), rank=r) for r in range(3)]
    expected = sum(compressor.decompress(p) for p in payloads) / 3
    assert torch.allclose(compressor.aggregate(payloads), expected, rtol=1e-15, atol=0)


def test_bad_bits_and_levels():
    with pytest.raises(ValueError, match="QSGD bits must be 2, 4 or 8 .*got 3"):
        QSGD(3)
    with pytest.raises(ValueError, match=r"QSGD levels for bits=4 must be an integer in 1..7, got 8; use more bits"):
        QSGD(4, levels=8)
    with pytest.raises(ValueError, match=r"QSGD levels for bits=2 must be an integer in 1..1, got 0"):
        QSGD(2, levels=0)
    not_float = r"qsgd\(bits=4,levels=7,chunk=512\) compresses floating-point gradients, got torch.int32"
    with pytest.raises(TypeError, match=not_float):
        QSGD().compress(torch.arange(4, dtype=torch.int32))


def test_each_chunk_has_its_own_norm():
    compressor = QSGD(8, chunk_size=4)
    x = torch.tensor([3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 1e-3, 0.0, 5.0], dtype=torch.float64)
    payload = compressor.compress(x)
    norms = payload.tensors["norm"].to(torch.float64)
    assert norms.shape == (3,)
    # each norm is its chunk's L2 norm rounded up to float32 (relative step 2^-23)
    for got, want in zip(norms.tolist(), [5.0, 1e-3, 5.0]):
        assert want <= got <= want * (1 + 2**-23)
    decoded = compressor.decompress(payload)
    # the small chunk is quantised on its own grid (steps of 1e-3/127), not 5/127
    assert abs(float(decoded[6]) - 1e-3) <= 1e-3 / 127 * (1 + 2**-22)
    assert decoded[8] == float(norms[2])  # x = its chunk's norm quantises exactly to level s


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size"):
        QSGD(4, chunk_size=0)


def test_a_chunk_longer_than_the_tensor_is_one_norm():
    # "one norm per tensor": a huge chunk_size must not allocate chunk_size elements
    compressor = QSGD(8, chunk_size=2**40)
    x = torch.tensor([3.0, -4.0], dtype=torch.float64)
    payload = compressor.compress(x)
    assert payload.tensors["norm"].shape == (1,) and float(payload.tensors["norm"]) == 5.0
    assert compressor.decompress(payload).abs().max() <= 5.0
