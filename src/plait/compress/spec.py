"""Compressor specs for the command line: ``"topk:0.01+ef"`` -> ErrorFeedback(TopK(0.01)).

Grammar: ``NAME[:ARG][+ef]``, case-insensitive, spaces ignored. ``"none"`` means no
compression (None). ``"sign+ef"`` is EF-signSGD, ErrorFeedback(Sign(scaled=True)):
error feedback needs the scale to bring the residual back to the gradient's size.
"""

from __future__ import annotations

from plait.compress.base import Compressor
from plait.compress.cast import BF16, FP16
from plait.compress.feedback import ErrorFeedback
from plait.compress.powersgd import PowerSGD
from plait.compress.qsgd import QSGD
from plait.compress.sign import Sign
from plait.compress.sparse import RandomK, TopK

FORMS = (
    "none",
    "topk:RATIO[+ef]   e.g. topk:0.01+ef",
    "randomk:RATIO[+ef]   e.g. randomk:0.01+ef",
    "sign   (majority vote)",
    "sign+ef   (EF-signSGD, scaled)",
    "qsgd[:BITS][+ef]   BITS in 2, 4, 8 (default 4)",
    "powersgd[:RANK]   (default 2; error feedback built in)",
    "fp16",
    "bf16",
)


def _fail(text: str, why: str) -> ValueError:
    return ValueError(f"bad compressor {text!r}: {why}. Valid forms: " + "; ".join(FORMS))


def _number(text: str, arg: str, kind):
    try:
        return kind(arg)
    except ValueError:
        raise _fail(text, f"{arg!r} is not {'an integer' if kind is int else 'a number'}") from None


def from_spec(text: str) -> Compressor | None:
    """Parse a CLI compressor spec (see :data:`FORMS`); ``"none"`` gives None."""
    if not isinstance(text, str):
        raise _fail(repr(text), f"expected a string, got {type(text).__name__}")
    spec = "".join(text.split()).lower()
    feedback = spec.endswith("+ef")
    if feedback:
        spec = spec[: -len("+ef")]
    name, _, arg = spec.partition(":")
    if ":" in spec and not arg:
        raise _fail(text, f"nothing after '{name}:'")
    try:
        if name == "none":
            if arg or feedback:
                raise _fail(text, "'none' takes no argument and no '+ef'")
            return None
        if name in ("topk", "randomk"):
            if not arg:
                raise _fail(text, f"{name} needs a ratio, e.g. {name}:0.01")
            ratio = _number(text, arg, float)
            compressor = TopK(ratio) if name == "topk" else RandomK(ratio)
        elif name == "sign" and not arg:
            compressor = Sign(scaled=feedback)
        elif name == "qsgd":
            compressor = QSGD(bits=_number(text, arg, int) if arg else 4)
        elif name == "powersgd":
            if feedback:
                raise _fail(text, "PowerSGD keeps its own error feedback; drop '+ef'")
            return PowerSGD(rank=_number(text, arg, int) if arg else 2)
        elif name in ("fp16", "bf16") and not arg:
            compressor = FP16() if name == "fp16" else BF16()
        else:
            raise _fail(text, f"unknown compressor {name!r}" + (f" with argument {arg!r}" if arg else ""))
    except ValueError as error:
        if str(error).startswith("bad compressor"):
            raise
        raise _fail(text, str(error)) from None
    return ErrorFeedback(compressor) if feedback else compressor
