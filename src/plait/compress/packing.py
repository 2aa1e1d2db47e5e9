"""Bit packing: n codes of ``bits`` bits each in ceil(n·bits/8) bytes, pure torch.

Byte j holds codes j·k .. j·k+k-1 with k = 8/bits codes per byte, code i at bit
offset (i mod k)·bits (little-endian within the byte). The last byte is padded with
zero codes. Both directions are vectorised: a loop over the k <= 8 slots of a byte,
each a whole-tensor shift and or, so packing n codes costs O(n) element operations.
"""

from __future__ import annotations

import torch

WIDTHS = (1, 2, 4, 8)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits pack into: ceil(numel·bits/8)."""
    _check_bits(bits)
    return -(-numel * bits // 8)


def _check_bits(bits) -> None:
    if isinstance(bits, bool) or bits not in WIDTHS:
        raise ValueError(f"bits must be one of {WIDTHS} (a whole number of codes per byte), got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (each < 2**bits, read as 1-D) into ceil(n·bits/8) uint8 bytes."""
    _check_bits(bits)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"pack_bits takes a uint8 tensor of codes, got {got}; convert with .to(torch.uint8)")
    codes = codes.reshape(-1)
    if bits == 8:
        return codes.clone()
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"pack_bits: a code is {int(codes.max())}, too large for {bits} bits (max {(1 << bits) - 1})")
    per_byte = 8 // bits
    nbytes = packed_nbytes(codes.numel(), bits)
    padded = torch.zeros(nbytes * per_byte, dtype=torch.uint8, device=codes.device)
    padded[: codes.numel()] = codes
    slots = padded.view(nbytes, per_byte)  # (bytes, codes per byte)
    packed = slots[:, 0].clone()
    for slot in range(1, per_byte):
        packed.bitwise_or_(slots[:, slot] << (slot * bits))
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as a uint8 tensor."""
    _check_bits(bits)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise TypeError(f"unpack_bits takes the uint8 tensor pack_bits returned, got {got}")
    packed = packed.reshape(-1)
    expected = packed_nbytes(numel, bits)
    if packed.numel() != expected:
        raise ValueError(
            f"unpack_bits: {numel} codes of {bits} bits pack into {expected} bytes, got {packed.numel()}; "
            f"pass the numel that was packed"
        )
    if bits == 8:
        return packed.clone()
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    slots = torch.stack([(packed >> (slot * bits)) & mask for slot in range(per_byte)], dim=1)  # (bytes, per_byte)
    return slots.reshape(-1)[:numel].clone()
