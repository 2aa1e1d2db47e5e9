"""The work one device does for one operator on its local shards: forward and backward
kernels, matmul shapes and memory traffic (``Work``, priced by
``DeviceSpec.time_s``), and the bytes the forward saves for the backward.

Matmul-like kinds are priced by their products (plait.plan.layers' convention: a
product (m, n, k) costs 2mnk FLOPs, its backward is its input gradient (m, k, n) and its
weight gradient (k, n, m): 2x the forward; their bytes are left to the FLOP term):

    linear     x (..., in), W (out, in): one gemm (m = prod(x[:-1]), n = out, k = in)
    matmul     a (..., m, k) @ b (..., k, n): count = prod(batch dims) products (m, n, k)
    attention  q (..., s, d), k (..., t, d), v (..., t, e): QK^T (s, t, d) and PV (s, e, t),
               count = prod(batch dims) each
    conv       x (N, C, *in), W (Cout, C/g, *kernel), y (N, Cout, *out): the implicit gemm
               m = N prod(out), n = Cout/g, k = C/g prod(kernel), g of them

Memory-bound kinds (norm, softmax, elementwise, reduce, loss, embedding) move the
bytes of their inputs, parameters and output in the forward (an embedding: the ids and
twice its output, the rows read and written) and twice that in the backward (read the
output gradient and a saved tensor, write the input gradient); one kernel each way.
view, permute, input, constant and output cost nothing (views; data already there).
Every elementwise op Alpa's simplify merged into a node (attrs merged_ops) adds a
kernel moving twice the output's bytes forward and four times backward.

Saved for backward (on this device): linear, conv: x; matmul: a and b; attention: q,
k, v, the output and the float32 log-sum-exp (batch dims x s) of a fused kernel;
softmax: its output; norm: its input; loss: its first input (the logits); embedding: the
ids; elementwise: its floating inputs, unless it is an add/sub (which saves nothing);
the rest: nothing; plus one output-sized tensor per merged op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.plan.layers import backward_matmuls, matmul_flops

__all__ = ["Work", "local_work", "saved_bytes", "is_floating", "merged_ops"]

# a fused attention kernel keeps one float32 log-sum-exp per query row
_LSE_ITEMSIZE = 4
_MATMUL_KINDS = ("linear", "matmul", "attention", "conv")
_MEMORY_KINDS = ("norm", "softmax", "elementwise", "reduce", "loss", "embedding")
_ADDITIVE = ("add", "sub", "rsub", "neg")


def is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


@dataclass(frozen=True)
class Work:
    """One direction (forward or backward) of an operator on one device."""

    flops: float = 0.0
    nbytes: float = 0.0
    kernels: float = 0.0
    matmuls: tuple = ()

    def time_s(self, device, dtype: str) -> float:
        if not (self.flops or self.nbytes or self.kernels):
            return 0.0
        return device.time_s(flops=self.flops, nbytes=self.nbytes, kernels=self.kernels, dtype=dtype,
                             matmuls=self.matmuls)


def _nbytes(shape, itemsize: int) -> int:
    return math.prod(shape) * itemsize


def _products(node, inputs, params, out) -> tuple:
    """The forward's (kind, count, m, n, k) products of a matmul-like node on local shapes."""
    if node.kind == "linear":
        x = inputs[0]
        weight = next(shape for shape in params if len(shape) >= 2)
        out_dim = int(node.attr("weight_out_dim", 0))
        return (("gemm", 1, math.prod(x[:-1]), weight[out_dim], weight[1 - out_dim]),)
    if node.kind == "matmul":
        a, b = inputs[0], inputs[1]
        if len(a) < 2 or len(b) < 2:  # a vector operand: one product with a unit side
            m = a[-2] if len(a) >= 2 else 1
            n = b[-1] if len(b) >= 2 else 1
            return (("gemm", math.prod(out) // max(m * n, 1), m, n, a[-1]),)
        count = math.prod(out[:-2])
        return (("bmm" if count > 1 else "gemm", count, a[-2], b[-1], a[-1]),)
    if node.kind == "attention":
        q, k, v = inputs[0], inputs[1], inputs[2]
        count = math.prod(out[:-2])
        return (("bmm", count, q[-2], k[-2], q[-1]), ("bmm", count, q[-2], v[-1], k[-2]))
    # conv: the implicit gemm; W (Cout, Cin/g, *kernel), or (Cin, Cout/g, *kernel) transposed
    x = inputs[0]
    weight = next(shape for shape in params if len(shape) >= 2)
    groups = int(node.attr("groups", 1))
    kernel = math.prod(weight[2:])
    if node.attr("transposed", False):
        return (("gemm", groups, x[0] * math.prod(x[2:]), weight[1] * kernel, weight[0] // groups),)
    return (("gemm", groups, x[0] * math.prod(out[2:]), weight[0] // groups, weight[1] * kernel),)


def merged_ops(node) -> int:
    """How many elementwise ops Alpa's simplify merged into ``node`` (A's attrs
    merged_ops; other members, folded parameter views and a linear's flattening views,
    move no data)."""
    return len(node.attr("merged_ops", ()) or ())


def _own_work(node, inputs, in_itemsizes, params, param_itemsizes, out) -> tuple[Work, Work]:
    if node.kind in _MATMUL_KINDS:
        forward = _products(node, inputs, params, out)
        backward = backward_matmuls(forward)
        return (Work(flops=matmul_flops(forward), kernels=1, matmuls=forward),
                Work(flops=matmul_flops(backward), kernels=2, matmuls=backward))
    if node.kind not in _MEMORY_KINDS:
        return Work(), Work()
    out_bytes = _nbytes(out, node.itemsize)
    if node.kind == "embedding":
        moved = sum(_nbytes(s, i) for s, i in zip(inputs, in_itemsizes)) + 2 * out_bytes
    else:
        moved = (sum(_nbytes(s, i) for s, i in zip(inputs, in_itemsizes))
                 + sum(_nbytes(s, i) for s, i in zip(params, param_itemsizes)) + out_bytes)
    return Work(nbytes=moved, kernels=1), Work(nbytes=2 * moved, kernels=1)


def local_work(node, inputs, in_itemsizes, params, param_itemsizes, out) -> tuple[Work, Work]:
    """(forward, backward) of ``node`` on local shapes: ``inputs`` (shapes, in order) with
    their itemsizes, ``params`` (shapes) with theirs, and the output shape ``out``; plus
    each merged elementwise op: a kernel reading and writing the output's bytes forward,
    twice that backward."""
    forward, backward = _own_work(node, inputs, in_itemsizes, params, param_itemsizes, out)
    chain = merged_ops(node)
    if not chain:
        return forward, backward
    moved = 2.0 * chain * _nbytes(out, node.itemsize)
    return (Work(forward.flops, forward.nbytes + moved, forward.kernels + chain, forward.matmuls),
            Work(backward.flops, backward.nbytes + 2 * moved, backward.kernels + chain, backward.matmuls))


def saved_bytes(node, inputs, in_itemsizes, in_dtypes, out) -> float:
    """Bytes ``node`` keeps for its backward on one device (local shapes; see the module
    docstring for what each kind keeps), plus one output-sized tensor per merged op."""
    return _own_saved(node, inputs, in_itemsizes, in_dtypes, out) + merged_ops(node) * _nbytes(out, node.itemsize)


def _own_saved(node, inputs, in_itemsizes, in_dtypes, out) -> float:
    kind = node.kind
    sizes = [_nbytes(s, i) for s, i in zip(inputs, in_itemsizes)]
    out_bytes = _nbytes(out, node.itemsize)
    if kind in ("linear", "conv", "norm", "loss", "embedding"):
        return float(sizes[0]) if sizes else 0.0
    if kind == "matmul":
        return float(sum(sizes[:2]))
    if kind == "attention":
        return float(sum(sizes[:3]) + out_bytes + math.prod(out[:-1]) * _LSE_ITEMSIZE)
    if kind == "softmax":
        return float(out_bytes)
    if kind == "elementwise":
        target = node.attr("op") or (node.target.split(".")[-2] if node.target.count(".") >= 2 else node.target)
        return float(0 if target in _ADDITIVE else sum(size for size, dtype in zip(sizes, in_dtypes)
                                                       if is_floating(dtype)))
    return 0.0
