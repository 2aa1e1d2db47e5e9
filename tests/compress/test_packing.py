"""pack_bits / unpack_bits: exact round trips, byte counts and the bit layout."""

import pytest
import torch

from plait.compress import pack_bits, packed_nbytes, unpack_bits


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 8, 9, 1001])
def test_round_trip_every_width_and_odd_sizes(bits, numel):
    generator = torch.Generator().manual_seed(numel * 10 + bits)
    codes = torch.randint(0, 1 << bits, (numel,), generator=generator, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(numel, bits) == -(-numel * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, numel), codes)


def test_layout_is_little_endian_within_a_byte():
    # codes 1, 2, 3 at 2 bits: 1 | 2 << 2 | 3 << 4 = 0b00111001 = 57
    assert pack_bits(torch.tensor([1, 2, 3], dtype=torch.uint8), 2).tolist() == [57]
    # 9 one-bit codes: 8 in the first byte, the ninth in bit 0 of the second
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [129, 1]


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 4, 8\).*got 3"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(TypeError, match="uint8 tensor of codes, got torch.int64"):
        pack_bits(torch.zeros(4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="a code is 4, too large for 2 bits"):
        pack_bits(torch.tensor([4], dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="10 codes of 4 bits pack into 5 bytes, got 4"):
        unpack_bits(torch.zeros(4, dtype=torch.uint8), 4, 10)
    with pytest.raises(TypeError, match="uint8 tensor pack_bits returned"):
        unpack_bits(torch.zeros(4, dtype=torch.float32), 4, 8)
