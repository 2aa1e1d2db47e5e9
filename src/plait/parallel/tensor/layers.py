"""Megatron-LM's tensor-parallel layers on plait.comm.

An MLP is Y = GeLU(X A) B with A split by columns and B by rows: each rank
computes GeLU(X A_r) B_r with no communication and one all-reduce sums the
partial outputs. Attention splits by heads the same way. A transformer layer
thus costs two all-reduces of (s, b, h) forward (after attention and after the
MLP) and two backward (at their inputs): with a ring, 4 · 2(p-1)/p · s·b·h
elements sent per rank per layer per step. Under sequence parallelism each
all-reduce becomes a reduce-scatter (output) and an all-gather (next input).
The linear layers run the product and its collective as one autograd function
(``linear_ops``): the reductions work in place on tensors the function owns, and
a column-parallel backward's all-reduce of dX runs while dW is computed, with
results bit for bit those of the composed mappings.

Activations are (sequence, batch, features), sequence-first. Without sequence
parallelism a layer's input is replicated: the same (s, b, h) on every rank of
the group. With it, a column-parallel input (hence ParallelAttention's and
ParallelMLP's) is sharded along the sequence: rank r feeds rows [r·s/p, (r+1)·s/p),
its own (s/p, b, h). Each layer checks this on its first forward
(``TensorParallel.check_layout``; plait.parallel.tensor.layout) and refuses, by
name and with the shapes, a replicated input under sequence parallelism (which
would give every sharded weight p times its gradient) or an input that differs
between ranks without it; ``SequenceParallelEntry`` / ``SequenceParallelExit``
convert a caller's replicated (b, s, h) or (s, b, h) in and out. Token ids are
replicated (b, s) in both modes. Parameters are created as this
rank's shard (``sharding.ShardSpec`` on each) and initialised as slices of the
unsharded tensor drawn from ``seed``, so any tp gives the same model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from plait.memory.recompute import recompute
from plait.parallel.tensor.dropout import ConsistentDropout
from plait.parallel.tensor.group import UNSHARDED, TensorParallel
from plait.parallel.tensor.layout import REPLICATED, LayoutCheck, column_input_check
from plait.parallel.tensor.linear_ops import column_parallel_linear, reduce_partial, row_parallel_linear
from plait.parallel.tensor.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
    sum_grads_in_backward,
)
from plait.parallel.tensor.sharding import init_from_full, mark_sharded

INIT_STD = 0.02  # GPT-2's


def valid_tp_sizes(**sizes: int) -> list[int]:
    """The tensor-parallel degrees that divide every one of ``sizes``."""
    common = math.gcd(*sizes.values())
    return [d for d in range(1, common + 1) if common % d == 0]


def check_tp_divides(tp_size: int, **sizes: int) -> None:
    """Raise naming every size ``tp_size`` does not divide, and the valid degrees."""
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp_size]
    if bad:
        valid = ", ".join(map(str, valid_tp_sizes(**sizes)))
        raise ValueError(f"tp={tp_size} does not divide {' and '.join(bad)}; valid tp values: {valid}")


def default_draw(name: str, shape, generator: torch.Generator) -> torch.Tensor:
    """Weights N(0, 0.02²), biases zero, LayerNorm scales one."""
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=torch.float64)
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.float64)
    return torch.randn(shape, generator=generator, dtype=torch.float64) * INIT_STD


def _parameter(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype))


def parallel_input(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The input of a column-parallel layer: f, or the sequence all-gather under
    sequence parallelism ((s/p, b, h) -> (s, b, h))."""
    return gather_from_sequence(x, tp) if tp.sequence_parallel else copy_to_region(x, tp)


def parallel_output(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The output of a row-parallel layer: g, or the sequence reduce-scatter."""
    return reduce_scatter_to_sequence(x, tp) if tp.sequence_parallel else reduce_from_region(x, tp)


def _check_arguments(owner: str, tp, **sizes) -> None:
    """A layer's tp is a TensorParallel and its sizes whole numbers >= 1, or a TypeError /
    ValueError naming the argument (a string used to surface as an AttributeError or an
    unrelated torch error from deep inside the layer)."""
    if not isinstance(tp, TensorParallel):
        raise TypeError(f"{owner}: tp must be a plait.parallel.tensor.TensorParallel (e.g. new_tensor_parallel(group) "
                        f"or UNSHARDED), got {type(tp).__name__} ({tp!r:.40})")
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner}: {name} must be a whole number, got {type(value).__name__} ({value!r:.40})")
        if value < 1:
            raise ValueError(f"{owner}: {name}={value} must be >= 1")


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A (in, out) split by columns: rank r holds out/p output
    features (weight (out/p, in) as torch stores it, bias (out/p)). No communication
    forward; backward all-reduces dX (f). Input layout: X (s, b, in) replicated, the
    same on every rank; under sequence parallelism this rank's sequence-first slice
    (s/p, b, in), a different one on each rank: forward all-gathers it, backward
    reduce-scatters dX. Checked on the first forward (``tp.check_layout``).
    ``gather_output`` all-gathers Y to full width; otherwise Y stays split for a
    following row-parallel layer."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = UNSHARDED, *, bias: bool = True,
                 gather_output: bool = False, dtype: torch.dtype = torch.float32, seed: int | None = 0):
        super().__init__()
        _check_arguments("ColumnParallelLinear", tp, in_features=in_features, out_features=out_features)
        check_tp_divides(tp.size, out_features=out_features)
        self.tp, self.in_features, self.out_features = tp, in_features, out_features
        self.gather_output = gather_output
        local = out_features // tp.size
        self.weight = mark_sharded(_parameter((local, in_features), dtype), 0, out_features)
        self.bias = mark_sharded(_parameter((local,), dtype), 0, out_features) if bias else None
        self.layout_check = column_input_check(f"ColumnParallelLinear(in={in_features}, out={out_features})", tp)
        if seed is not None:
            init_from_full(self, tp, seed, default_draw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (s, b, in) or (s/p, b, in) under SP
        self.layout_check(x, self.tp)
        y = column_parallel_linear(x, self.weight, self.bias, self.tp)  # (s, b, out/p)
        return gather_from_region(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (this rank {self.weight.shape[0]}), {self.tp.describe()}"


class RowParallelLinear(nn.Module):
    """Y = X B + b with B (in, out) split by rows: rank r holds in/p input features
    (weight (out, in/p)) and takes X already split along its last dim
    (``input_is_parallel``, as a column-parallel layer leaves it: different on every
    rank; ``input_is_parallel=False`` takes the replicated (s, b, in), checked on the
    first forward, and keeps this rank's slice). Forward sums the
    partial products (g: all-reduce, or reduce-scatter under sequence parallelism),
    then adds the replicated bias. ``skip_bias_add`` returns (Y, b) for a fused add:
    the caller adds b and, under sequence parallelism (where b is added on a sequence
    shard, so each rank computes part of its gradient), passes it through
    ``sum_grads_in_backward`` first."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = UNSHARDED, *, bias: bool = True,
                 input_is_parallel: bool = True, skip_bias_add: bool = False, dtype: torch.dtype = torch.float32,
                 seed: int | None = 0):
        super().__init__()
        _check_arguments("RowParallelLinear", tp, in_features=in_features, out_features=out_features)
        check_tp_divides(tp.size, in_features=in_features)
        self.tp, self.in_features, self.out_features = tp, in_features, out_features
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.weight = mark_sharded(_parameter((out_features, in_features // tp.size), dtype), 1, in_features)
        # replicated; under sequence parallelism it is added on a sequence shard, so its
        # gradient is summed over the group (here, or by the caller when skip_bias_add)
        self.bias = _parameter((out_features,), dtype) if bias else None
        self.layout_check = LayoutCheck(f"RowParallelLinear(in={in_features}, out={out_features}, "
                                        "input_is_parallel=False)", REPLICATED)
        if seed is not None:
            init_from_full(self, tp, seed, default_draw)

    def forward(self, x: torch.Tensor):  # x: (s, b, in/p)
        if not self.input_is_parallel:
            self.layout_check(x, self.tp)
            x = scatter_to_region(x, self.tp)
        y = row_parallel_linear(x, self.weight, self.tp)  # (s, b, out) or (s/p, b, out)
        if self.skip_bias_add:
            return y, self.bias
        if self.bias is None:
            return y
        (bias,) = sum_grads_in_backward(self.tp, self.bias)
        return y + bias

    def extra_repr(self) -> str:
        return f"in={self.in_features} (this rank {self.weight.shape[1]}), out={self.out_features}, {self.tp.describe()}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split: rank r holds rows
    [r·V'/p, (r+1)·V'/p) of the table padded to V' = p·ceil(V/p) rows. Each rank
    looks up the tokens in its range (zeros elsewhere) and one all-reduce (or
    reduce-scatter along the sequence) sums the partial embeddings. The token ids
    (s, b) are replicated, the same on every rank, in both modes (checked on the
    first forward): under sequence parallelism the output is this rank's (s/p, b, h)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel = UNSHARDED, *,
                 dtype: torch.dtype = torch.float32, seed: int | None = 0):
        super().__init__()
        _check_arguments("VocabParallelEmbedding", tp, vocab_size=vocab_size, hidden=hidden)
        if vocab_size < 1 or hidden < 1:
            raise ValueError(f"vocab_size and hidden must be positive, got {vocab_size} and {hidden}")
        self.tp, self.vocab_size, self.hidden = tp, vocab_size, hidden
        local = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * local  # this rank's first row
        self.weight = mark_sharded(_parameter((local, hidden), dtype), 0, vocab_size)
        self.layout_check = LayoutCheck(f"VocabParallelEmbedding(vocab={vocab_size}, hidden={hidden}) tokens",
                                        REPLICATED)
        if seed is not None:
            init_from_full(self, tp, seed, default_draw)

    def partial(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's share of the embedding (zero rows for tokens it does not hold)."""
        if tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"tokens must be int32 or int64, got {tokens.dtype}")
        # skipped while torch.export / torch.compile trace (symbolic ids have no value to check)
        if tokens.numel() and not torch.compiler.is_compiling() and (
                int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got min {int(tokens.min())} "
                             f"and max {int(tokens.max())}")
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        return embedded.masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens (s, b) -> (s, b, h) or (s/p, b, h)
        self.layout_check(tokens, self.tp)
        return reduce_partial(self.partial(tokens), self.tp)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size} (rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0]}), " \
               f"hidden={self.hidden}, {self.tp.describe()}"


def parallel_logits(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel, bias=None) -> torch.Tensor:
    """Vocab-parallel logits X Eᵀ with E split by vocabulary rows (a tied embedding
    or an untied head): (s, b, h) -> (s, b, V'/p), never gathered."""
    return column_parallel_linear(x, weight, bias, tp)


class _BiasedOutput(nn.Module):
    """A block ending in a row-parallel projection whose bias ``forward`` adds (its
    gradient summed over the group under sequence parallelism) and
    ``forward_unbiased`` leaves to the caller: (output without bias, bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (s, b, h) or (s/p, b, h) -> same shape
        out, bias = self.forward_unbiased(x)
        return out + sum_grads_in_backward(self.tp, bias)[0]


class ParallelAttention(_BiasedOutput):
    """Causal multi-head self-attention with heads split over the group: a
    column-parallel QKV projection (rank r computes heads [r·n/p, (r+1)·n/p)), local
    attention, and a row-parallel output projection. The fused QKV weight is laid out
    head by head ((heads, 3, head_dim) rows), so a contiguous split hands each rank
    the q, k and v of its own heads. Input layout: sequence-first, dim 0 is the
    sequence the causal mask runs along (a batch-first (b, s, h) goes through
    ``SequenceParallelEntry(tp, seq_dim=1)``); replicated (s, b, h), or under
    sequence parallelism this rank's (s/p, b, h) slice, all-gathered to the whole
    sequence before attending (checked on the first forward by ``qkv``). The output
    has the input's layout. ``forward`` returns the full output;
    ``forward_unbiased`` returns (output without the projection bias, bias) for a
    caller that fuses the bias add and sums its gradient (sum_grads_in_backward)."""

    def __init__(self, hidden: int, heads: int, tp: TensorParallel = UNSHARDED, *, dropout: float = 0.0,
                 dtype: torch.dtype = torch.float32, seed: int | None = 0):
        super().__init__()
        _check_arguments("ParallelAttention", tp, hidden=hidden, heads=heads)
        if hidden % heads:
            raise ValueError(f"heads={heads} does not divide hidden={hidden}")
        check_tp_divides(tp.size, heads=heads)
        self.tp, self.hidden, self.heads = tp, hidden, heads
        self.local_heads, self.head_dim = heads // tp.size, hidden // heads
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, tp, dtype=dtype, seed=None)
        self.qkv.layout_check.owner = f"ParallelAttention(hidden={hidden}, heads={heads}) input"
        self.proj = RowParallelLinear(hidden, hidden, tp, skip_bias_add=True, dtype=dtype, seed=None)
        self.attention_dropout = ConsistentDropout(dropout)
        self.recompute_core = False  # selective recomputation (set by the model's set_recompute)
        self.on_recompute = None  # called with the region's name after each recompute (counting them)
        if seed is not None:
            init_from_full(self, tp, seed, default_draw)

    def forward_unbiased(self, x: torch.Tensor):  # -> ((s or s/p, b, h), bias (h))
        qkv = self.qkv(x)  # (s, b, 3h/p)
        if self.recompute_core:  # selective recomputation: keep qkv, not the (b, n/p, s, s) scores and probabilities
            context = recompute(self.core, qkv, name="the attention core", streams=[self.attention_dropout],
                                on_recompute=self.on_recompute)
        else:
            context = self.core(qkv)
        return self.proj(context)

    def core(self, qkv: torch.Tensor) -> torch.Tensor:  # (s, b, 3h/p) -> (s, b, h/p)
        """softmax(QKᵀ/√d + causal mask), dropout, ·V: the part whose activations grow
        with s² (what selective recomputation re-runs)."""
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, self.local_heads, 3, self.head_dim).permute(3, 1, 2, 0, 4)  # 3 x (b, n/p, s, d)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (b, n/p, s, s)
        causal = torch.ones(s, s, dtype=torch.bool, device=qkv.device).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        probs = self.attention_dropout(probs, (b, self.heads, s, s), 1, self.tp.rank)
        return (probs @ v).permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)


class ParallelMLP(_BiasedOutput):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel): no communication
    between the two matmuls, one sum at the end. ``forward_unbiased`` as in
    ParallelAttention. Input layout: replicated (s, b, h), or under sequence
    parallelism this rank's sequence-first (s/p, b, h) slice (checked on the first
    forward by ``fc1``); the output has the input's layout."""

    def __init__(self, hidden: int, ffn_hidden: int, tp: TensorParallel = UNSHARDED, *,
                 dtype: torch.dtype = torch.float32, seed: int | None = 0):
        super().__init__()
        _check_arguments("ParallelMLP", tp, hidden=hidden, ffn_hidden=ffn_hidden)
        check_tp_divides(tp.size, ffn_hidden=ffn_hidden)
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, tp, dtype=dtype, seed=None)
        self.fc1.layout_check.owner = f"ParallelMLP(hidden={hidden}, ffn_hidden={ffn_hidden}) input"
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, tp, skip_bias_add=True, dtype=dtype, seed=None)
        self.tp = tp
        if seed is not None:
            init_from_full(self, tp, seed, default_draw)

    def forward_unbiased(self, x: torch.Tensor):  # -> ((s or s/p, b, h), bias (h))
        return self.fc2(F.gelu(self.fc1(x)))
