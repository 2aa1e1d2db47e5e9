"""plait.compress: gradient compression for data parallelism.

A :class:`Compressor` averages a :class:`GradBucket`'s flat gradient buffer across
a process group in place, lossily, and reports the bytes it sent:

- sparsification: :class:`TopK`, :class:`RandomK` (values + int32 indices);
- quantisation: :class:`Sign` (1 bit, majority vote or scaled), :class:`QSGD`
  (stochastic, 2/4/8 bits), :class:`FP16` / :class:`BF16` (casts);
- low rank: :class:`PowerSGD` (two all-reduces, error feedback built in);
- :class:`ErrorFeedback` wraps any :class:`PayloadCompressor`;
- :func:`from_spec` parses CLI strings such as ``"topk:0.01+ef"``;
- :func:`pack_bits` / :func:`unpack_bits` pack 1/2/4/8-bit codes into bytes.

Payload compressors all-gather every rank's payload once and decode the average
locally; see :mod:`plait.compress.base` for the contract and its cost.
"""

from plait.compress.base import (
    Compressor,
    GradBucket,
    Payload,
    PayloadCompressor,
    derive_seed,
    payload_from_bytes,
    payload_to_bytes,
)
from plait.compress.cast import BF16, FP16, Cast
from plait.compress.feedback import ErrorFeedback
from plait.compress.packing import pack_bits, packed_nbytes, unpack_bits
from plait.compress.powersgd import PowerSGD, matrix_shape
from plait.compress.qsgd import QSGD
from plait.compress.sign import Sign
from plait.compress.sparse import RandomK, SparseCompressor, TopK, index_dtype
from plait.compress.spec import FORMS, from_spec

__all__ = [
    "BF16", "FORMS", "FP16", "QSGD", "Cast", "Compressor", "ErrorFeedback", "GradBucket", "Payload",
    "PayloadCompressor", "PowerSGD", "RandomK", "Sign", "SparseCompressor", "TopK", "derive_seed",
    "from_spec", "index_dtype", "matrix_shape", "pack_bits", "packed_nbytes", "payload_from_bytes",
    "payload_to_bytes", "unpack_bits",
]
