"""The wire table: one fixed code for every torch dtype and every reduce op.

A collective's argument checks send the call's dtype and op as int64 codes (the
in-band header, the deep check's agreement block, the DDP hook's bucket check), so
two processes must map a dtype to the same number: the codes below are literals,
fixed once and never reused (a new torch dtype gets the next free code; the test
that iterates every ``torch`` dtype fails until it has one). Dtypes are keyed by
their name as torch prints it without "torch." (``str(torch.float) == "torch.float32"``,
so aliases share one entry); this module is torch-free.

Each dtype also gives its bytes per element (what ``plan/`` prices a dtype at), says
which reduce ops may combine it (``family``: the ops of
``OP_FAMILIES`` take floating, integer, bool or complex dtypes, as torch.distributed
over gloo allows) and whether plait's collectives carry it at all (``refused``: None,
or why not and what to do). Carried dtypes move as whole elements through gloo's
send/recv, which takes any element type; gloo's own collectives (``algorithm="torch"``)
take fewer (``torch_gloo``).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.names.collectives import NO_OP, REDUCE_OPS

# reduce-op families: what each op may combine
FLOATING = "floating"
INTEGER = "integer"
BOOL = "bool"
COMPLEX = "complex"

_QUANTIZED = ("a quantized tensor's scale and zero point do not travel with its bytes: send "
              "tensor.int_repr() and its q_scale()/q_zero_point() instead")
_SUB_BYTE = ("torch cannot copy elements of a sub-byte dtype: pack the values into a uint8 tensor "
             "and send that")


@dataclass(frozen=True)
class WireDtype:
    """One dtype on the wire. ``itemsize``: bytes per element (torch's ``dtype.itemsize``;
    a sub-byte or packed dtype takes a byte). ``family``: the reduce ops' family (None: never reduced).
    ``refused``: None when plait's collectives carry it, else why not and the fix.
    ``torch_gloo``: gloo's own collectives take it (torch.distributed with gloo)."""

    name: str
    code: int
    itemsize: int
    family: str | None = None
    refused: str | None = None
    torch_gloo: bool = False


DTYPES: tuple[WireDtype, ...] = (
    # the first twelve keep the codes plait's checks have always sent
    WireDtype("float16", 0, 2, FLOATING, torch_gloo=True),
    WireDtype("bfloat16", 1, 2, FLOATING, torch_gloo=True),
    WireDtype("float32", 2, 4, FLOATING, torch_gloo=True),
    WireDtype("float64", 3, 8, FLOATING, torch_gloo=True),
    WireDtype("int8", 4, 1, INTEGER, torch_gloo=True),
    WireDtype("uint8", 5, 1, INTEGER, torch_gloo=True),
    WireDtype("int16", 6, 2, INTEGER),
    WireDtype("int32", 7, 4, INTEGER, torch_gloo=True),
    WireDtype("int64", 8, 8, INTEGER, torch_gloo=True),
    WireDtype("bool", 9, 1, BOOL, torch_gloo=True),
    WireDtype("complex64", 10, 8, COMPLEX, torch_gloo=True),
    WireDtype("complex128", 11, 16, COMPLEX, torch_gloo=True),
    WireDtype("complex32", 12, 4, torch_gloo=True),
    WireDtype("uint16", 13, 2),
    WireDtype("uint32", 14, 4),
    WireDtype("uint64", 15, 8),
    WireDtype("float8_e4m3fn", 16, 1),
    WireDtype("float8_e4m3fnuz", 17, 1),
    WireDtype("float8_e5m2", 18, 1),
    WireDtype("float8_e5m2fnuz", 19, 1),
    WireDtype("float8_e8m0fnu", 20, 1),
    WireDtype("float4_e2m1fn_x2", 21, 1),
    WireDtype("bits8", 22, 1),
    WireDtype("bits16", 23, 2),
    WireDtype("bits1x8", 24, 1),
    WireDtype("bits2x4", 25, 1),
    WireDtype("bits4x2", 26, 1),
    WireDtype("qint8", 27, 1, refused=_QUANTIZED),
    WireDtype("quint8", 28, 1, refused=_QUANTIZED),
    WireDtype("qint32", 29, 4, refused=_QUANTIZED),
    WireDtype("quint4x2", 30, 1, refused=_QUANTIZED),
    WireDtype("quint2x4", 31, 1, refused=_QUANTIZED),
    *(WireDtype(f"int{bits}", 31 + bits, 1, refused=_SUB_BYTE) for bits in range(1, 8)),   # 32..38
    *(WireDtype(f"uint{bits}", 38 + bits, 1, refused=_SUB_BYTE) for bits in range(1, 8)),  # 39..45
)
BY_NAME = {entry.name: entry for entry in DTYPES}
BY_CODE = {entry.code: entry for entry in DTYPES}

# what each op may reduce, as torch.distributed over gloo allows it: bool SUM is OR and
# PRODUCT is AND; bitwise ops take integers and bool; complex tensors take SUM and AVG
# only; AVG needs a floating (or complex) dtype
OP_FAMILIES = {
    "sum": (FLOATING, INTEGER, BOOL, COMPLEX),
    "avg": (FLOATING, COMPLEX),
    "min": (FLOATING, INTEGER, BOOL),
    "max": (FLOATING, INTEGER, BOOL),
    "prod": (FLOATING, INTEGER, BOOL),
    "band": (INTEGER, BOOL),
    "bor": (INTEGER, BOOL),
    "bxor": (INTEGER, BOOL),
}
OP_CODES = {name: code for code, name in enumerate((NO_OP, *REDUCE_OPS))}
OP_BY_CODE = {code: name for name, code in OP_CODES.items()}


def dtype_name(dtype) -> str:
    """``torch.float`` -> "float32" (torch's own printed name; works on the name too)."""
    return str(dtype).removeprefix("torch.")


def wire_dtype(dtype, collective: str = "this call") -> WireDtype:
    """The table's entry for ``dtype`` (a torch dtype or its name); a dtype the table
    lacks, or one plait's collectives refuse, raises TypeError naming it and the fix."""
    name = dtype_name(dtype)
    entry = BY_NAME.get(name)
    if entry is None:
        raise TypeError(f"{collective}: dtype {name} has no code in plait's wire table (plait.names.wire, "
                        f"written for an older torch): view the tensor as uint8 (tensor.view(torch.uint8)) "
                        f"and send that, or add {name} to the table")
    if entry.refused is not None:
        raise TypeError(f"{collective} cannot carry dtype {name}: {entry.refused}")
    return entry


def dtype_code(dtype, collective: str = "this call") -> int:
    """The fixed wire code of ``dtype`` (refused as :func:`wire_dtype` refuses)."""
    return wire_dtype(dtype, collective).code


def describe_dtype_code(code: int) -> str:
    """A received dtype code as the dtype's name ("code 77" for one no table has)."""
    entry = BY_CODE.get(code)
    return entry.name if entry is not None else f"code {code}"


def describe_op_code(code: int) -> str:
    """A received op code as the op's name ("code 77" for one no table has)."""
    return OP_BY_CODE.get(code, f"code {code}")


__all__ = ["BOOL", "BY_CODE", "BY_NAME", "COMPLEX", "DTYPES", "FLOATING", "INTEGER", "OP_BY_CODE", "OP_CODES",
           "OP_FAMILIES", "WireDtype", "describe_dtype_code", "describe_op_code", "dtype_code", "dtype_name",
           "wire_dtype"]
