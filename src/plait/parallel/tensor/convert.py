"""Modules that replace a user's Linear / HF Conv1D / Embedding when a plan shards them.

Each keeps the original's parameter names and orientation (``weight`` and ``bias``;
an ``nn.Linear``'s weight (out, in), HF's ``Conv1D``'s (in, out) with y = x W + b),
so the model's state-dict keys do not change and ``sharding.gather_state_dict``
returns the original model's state dict. The weight it keeps is this rank's slice of
the original (``sharding.shard_tensor``), marked with its ``ShardSpec``. Activations
keep the model's own layout: any leading dims, features last, the sequence (under
sequence parallelism) at ``seq_dim`` (1 for Hugging Face's batch-first (b, s, h)).

Communication per forward, for an activation of n elements and p ranks:
  ColwiseLinear   f (backward all-reduce of dx), or under sequence parallelism an
                  all-gather of the sequence (backward reduce-scatter); + an
                  all-gather of y with ``gather_output``
  RowwiseLinear   all-reduce of y, or a reduce-scatter along the sequence
  VocabEmbedding  all-reduce of the embeddings (or a reduce-scatter, sequence-sharded)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.parallel.tensor.group import TensorParallel
from plait.parallel.tensor.layout import REPLICATED, SEQUENCE_SHARDED, LayoutCheck
from plait.parallel.tensor.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
    sum_grads_in_backward,
)
from plait.parallel.tensor.sharding import ShardSpec, fused_gather_index, shard_tensor


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (weight (nx, nf), y = x W + b),
    recognised by name and shape so that plait never imports transformers (an optional extra)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def linear_sizes(module: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, transposed) of an nn.Linear or HF Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    return module.nx, module.nf, True


def sharded_parameter(original: torch.Tensor, spec: ShardSpec, tp: TensorParallel) -> nn.Parameter:
    """A new Parameter holding this rank's slice of ``original``, marked with ``spec``."""
    with torch.no_grad():
        local = shard_tensor(original.detach(), spec, tp.rank, tp.size).clone().contiguous()
    param = nn.Parameter(local, requires_grad=original.requires_grad)
    param.tp_shard = spec
    return param


def _seq_gather(x: torch.Tensor, tp: TensorParallel, seq_dim: int) -> torch.Tensor:
    """This rank's sequence slice -> the whole sequence, for a column-parallel input
    (backward reduce-scatters: every rank's output depends on every position)."""
    return gather_from_sequence(x.movedim(seq_dim, 0), tp).movedim(0, seq_dim)


def _seq_reduce_scatter(y: torch.Tensor, tp: TensorParallel, seq_dim: int) -> torch.Tensor:
    return reduce_scatter_to_sequence(y.movedim(seq_dim, 0), tp).movedim(0, seq_dim)


def _matmul(x: torch.Tensor, weight: torch.Tensor, transposed: bool, bias=None) -> torch.Tensor:
    """x W + b in the original module's arithmetic (F.linear, or Conv1D's addmm)."""
    if not transposed:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = rows @ weight if bias is None else torch.addmm(bias, rows, weight)
    return out.view(*x.shape[:-1], weight.shape[1])


class ColwiseLinear(nn.Module):
    """A Linear / Conv1D split by output features (styles.ColwiseParallel): weight
    (out/p, in) or (in, out/p), bias (out/p). Input (..., in): replicated, or this
    rank's slice of the sequence at ``seq_dim``; output (..., out/p), or (..., out)
    with ``gather_output`` (fused parts back in the original order, padding cut)."""

    def __init__(self, original: nn.Module, tp: TensorParallel, *, gather_output: bool, parts,
                 input_layout: str, seq_dim: int, name: str, shared: dict):
        super().__init__()
        self.in_features, self.out_features, self.transposed = linear_sizes(original)
        self.tp, self.seq_dim, self.gather_output, self.input_layout = tp, seq_dim, gather_output, input_layout
        self.parts = parts
        dim = 1 if self.transposed else 0
        self.weight = shared_or_new(shared, original.weight, ShardSpec(dim, self.out_features, parts), tp, name)
        bias = getattr(original, "bias", None)
        self.bias = None if bias is None else shared_or_new(shared, bias, ShardSpec(0, self.out_features, parts),
                                                            tp, name)
        if parts is not None:
            self.register_buffer("unpermute", fused_gather_index(parts, tp.size), persistent=False)
        self.layout_check = LayoutCheck(f"{name} (ColwiseLinear in={self.in_features}, out={self.out_features}) "
                                        "input", input_layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.layout_check(x, self.tp)
        if self.input_layout == SEQUENCE_SHARDED:
            x = _seq_gather(x, self.tp, self.seq_dim)
        else:
            x = copy_to_region(x, self.tp)
        y = _matmul(x, self.weight, self.transposed, self.bias)  # (..., out/p)
        if not self.gather_output:
            return y
        y = gather_from_region(y, self.tp)  # (..., p·ceil(out/p))
        if self.parts is not None:
            return y.index_select(-1, self.unpermute)
        return y[..., :self.out_features] if y.shape[-1] != self.out_features else y

    def extra_repr(self) -> str:
        fused = f", fused {self.parts}" if self.parts else ""
        local = self.weight.shape[1 if self.transposed else 0]
        return (f"in={self.in_features}, out={self.out_features} (this rank {local}){fused}, "
                f"gather_output={self.gather_output}, input {self.input_layout}, {self.tp.describe()}")


class RowwiseLinear(nn.Module):
    """A Linear / Conv1D split by input features (styles.RowwiseParallel): weight
    (out, in/p) or (in/p, out), bias (out) replicated and added after the sum (under
    sequence parallelism on the sequence shard, so its gradient is summed over tp)."""

    def __init__(self, original: nn.Module, tp: TensorParallel, *, input_is_parallel: bool, output_layout: str,
                 seq_dim: int, name: str, shared: dict):
        super().__init__()
        self.in_features, self.out_features, self.transposed = linear_sizes(original)
        self.tp, self.seq_dim, self.input_is_parallel, self.output_layout = tp, seq_dim, input_is_parallel, \
            output_layout
        dim = 0 if self.transposed else 1
        self.weight = shared_or_new(shared, original.weight, ShardSpec(dim, self.in_features), tp, name)
        self.bias = getattr(original, "bias", None)  # replicated: the same Parameter object
        self.layout_check = LayoutCheck(f"{name} (RowwiseLinear in={self.in_features}, out={self.out_features}, "
                                        "input_is_parallel=False) input", REPLICATED)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in/p) -> (..., out), or its sequence shard
        if not self.input_is_parallel:
            self.layout_check(x, self.tp)
            x = scatter_to_region(x, self.tp)
        y = _matmul(x, self.weight, self.transposed)
        if self.output_layout == SEQUENCE_SHARDED:
            y = _seq_reduce_scatter(y, self.tp, self.seq_dim)
        else:
            y = reduce_from_region(y, self.tp)
        if self.bias is None:
            return y
        if self.output_layout == SEQUENCE_SHARDED:
            return y + sum_grads_in_backward(self.tp, self.bias)[0]
        return y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (this rank {self.weight.shape[0 if self.transposed else 1]}), "
                f"out={self.out_features}, output {self.output_layout}, {self.tp.describe()}")


class VocabEmbedding(nn.Module):
    """An nn.Embedding split by vocabulary rows (styles.VocabParallel): rank r holds
    rows [r·V'/p, (r+1)·V'/p) of the table padded to V' = p·ceil(V/p); token ids
    (any shape) are replicated; each rank embeds the ones it holds (zeros elsewhere)
    and one all-reduce, or a reduce-scatter along ``seq_dim``, sums them."""

    def __init__(self, original: nn.Embedding, tp: TensorParallel, *, output_layout: str, seq_dim: int, name: str,
                 shared: dict):
        super().__init__()
        self.num_embeddings, self.embedding_dim = original.num_embeddings, original.embedding_dim
        self.tp, self.seq_dim, self.output_layout = tp, seq_dim, output_layout
        self.weight = shared_or_new(shared, original.weight, ShardSpec(0, self.num_embeddings), tp, name)
        rows = self.weight.shape[0]
        self.vocab_start = tp.rank * rows
        padding = original.padding_idx
        local = None if padding is None else padding - self.vocab_start
        self.padding_idx = original.padding_idx  # the model's own (HF reads it)
        self.local_padding_idx = local if local is not None and 0 <= local < rows else None
        self.layout_check = LayoutCheck(f"{name} (VocabEmbedding vocab={self.num_embeddings}) token ids", REPLICATED)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (...) -> (..., h), replicated or sequence-sharded
        self.layout_check(tokens, self.tp)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.num_embeddings):
            # nn.Embedding raises on these; the split table would embed them as zeros
            raise IndexError(f"token ids must lie in [0, {self.num_embeddings}), got min {int(tokens.min())} and max "
                             f"{int(tokens.max())}")
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight, self.local_padding_idx)
        partial = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.output_layout == SEQUENCE_SHARDED:
            return _seq_reduce_scatter(partial, self.tp, self.seq_dim)
        return reduce_from_region(partial, self.tp)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0]}), "
                f"dim={self.embedding_dim}, output {self.output_layout}, {self.tp.describe()}")


def shared_or_new(shared: dict, original: torch.Tensor, spec: ShardSpec, tp: TensorParallel,
                  name: str) -> nn.Parameter:
    """This rank's slice of ``original``, made once per original Parameter: two
    modules that shared it (a tied embedding and head) share the slice. ``shared``
    maps id(original) -> (slice, spec, first module's name); a second use with
    another split is refused."""
    key = id(original)
    if key in shared:
        param, first_spec, first = shared[key]
        if first_spec != spec:
            raise ValueError(f"{name} shares a weight with {first} but the plan splits it differently ({spec} vs "
                             f"{first_spec}): give both the same split (a tied head: VocabParallel embedding and "
                             f"ColwiseParallel(pad=True) nn.Linear head)")
        return param
    param = sharded_parameter(original, spec, tp)
    shared[key] = (param, spec, name)
    return param
