"""A GPT: decoder-only transformer whose one module code runs unsharded and at
any tensor-parallel degree.

tokens (b, s) -> token embedding (vocab-parallel) + position embedding -> dropout
-> layers x [x + Drop(Attn(LN(x))), x + Drop(MLP(LN(x)))] -> LN -> logits (b, s, V'/p)
against the token embedding (tied) or its own vocab-parallel head.

Parameters: V·h + s·h (+ V·h untied) + l·(12h² + 13h) + 2h with FFN = 4h; the
training step costs about 72·b·s·l·h²·(1 + s/(6h) + V/(12·l·h)) FLOPs (DESIGN §6).
With ``GPT(config, tp)`` each rank holds 1/p of every matrix; built with the same
``seed`` it holds exactly the slices of ``GPT(config)`` (see
plait.parallel.tensor.sharding), and ``shard_state_dict`` / ``gather_state_dict``
move unsharded checkpoints in and out.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plait.memory.recompute import check_mode, random_streams, recompute, set_block_recompute
from plait.models.gpt_layers import gpt_layers
from plait.parallel.pipeline.partition import LayeredModel
from plait.names.recompute import FULL, SELECTIVE
from plait.parallel.tensor import (
    UNSHARDED,
    ConsistentDropout,
    ParallelAttention,
    ParallelMLP,
    TensorParallel,
    VocabParallelEmbedding,
    check_tp_divides,
    gather_logits,
    init_from_full,
    parallel_logits,
    sum_grads_in_backward,
    vocab_parallel_cross_entropy,
)
from plait.parallel.tensor.group import check_agreement
from plait.parallel.tensor.sharding import mark_sharded, seed_for

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT. ``ffn_hidden`` 0 means 4·hidden; ``dtype`` names a float type."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq_len: int = 32
    vocab: int = 96
    ffn_hidden: int = 0
    dropout: float = 0.0
    tied_head: bool = True
    dtype: str = "float32"

    def __post_init__(self):
        problems = [f"{name}={getattr(self, name)} must be a positive int"
                    for name in ("layers", "hidden", "heads", "seq_len", "vocab")
                    if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int)
                    or getattr(self, name) < 1]
        if isinstance(self.ffn_hidden, bool) or not isinstance(self.ffn_hidden, int) or self.ffn_hidden < 0:
            problems.append(f"ffn_hidden={self.ffn_hidden} must be a positive int (or 0 for 4*hidden)")
        if not problems and self.hidden % self.heads:
            divisors = [d for d in range(1, self.hidden + 1) if self.hidden % d == 0 and d <= 64]
            problems.append(f"heads={self.heads} does not divide hidden={self.hidden}; choose heads in {divisors}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        if self.dtype not in DTYPES:
            problems.append(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise unless ``tp_size`` divides heads (hence hidden) and the FFN width.
        The vocabulary need not divide: it is padded."""
        check_tp_divides(tp_size, heads=self.heads, hidden=self.hidden, ffn_hidden=self.ffn)

    def num_parameters(self) -> int:
        h, v = self.hidden, self.vocab
        per_layer = 4 * h * h + 4 * h + 2 * h * self.ffn + self.ffn + h + 4 * h  # attn, mlp, 2 LayerNorms
        return v * h + self.seq_len * h + (0 if self.tied_head else v * h) + self.layers * per_layer + 2 * h

    def checksum(self) -> int:
        return zlib.crc32(repr(sorted(asdict(self).items())).encode()) & 0x7FFFFFFF


def _draw(name: str, shape, generator: torch.Generator, layers: int) -> torch.Tensor:
    """GPT-2 initialisation: N(0, 0.02²) weights, N(0, (0.02/sqrt(2l))²) for the
    projections into the residual stream, zero biases, unit LayerNorm scales."""
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=torch.float64)
    if ".ln" in name or name.startswith("ln_f"):
        return torch.ones(shape, dtype=torch.float64)
    std = 0.02 / (2 * layers) ** 0.5 if name.endswith(("proj.weight", "fc2.weight")) else 0.02
    return torch.randn(shape, generator=generator, dtype=torch.float64) * std


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + Drop(Attn(LN1 x)), then + Drop(MLP(LN2 x)).
    Tensor parallel: 2 all-reduces forward, 2 backward. Sequence parallel: x is this
    rank's (s/p, b, h) shard; 2 all-gathers + 2 reduce-scatters each way, plus one
    all-reduce backward summing the LayerNorm and bias gradients of the shard."""

    def __init__(self, config: GPTConfig, tp: TensorParallel):
        super().__init__()
        dtype = config.torch_dtype
        self.tp = tp
        self.ln1 = nn.LayerNorm(config.hidden, eps=LAYER_NORM_EPS, dtype=dtype)
        self.attention = ParallelAttention(config.hidden, config.heads, tp, dropout=config.dropout, dtype=dtype,
                                           seed=None)
        self.ln2 = nn.LayerNorm(config.hidden, eps=LAYER_NORM_EPS, dtype=dtype)
        self.mlp = ParallelMLP(config.hidden, config.ffn, tp, dtype=dtype, seed=None)
        self.attention_out_dropout = ConsistentDropout(config.dropout)
        self.mlp_out_dropout = ConsistentDropout(config.dropout)
        self.recompute = "none"  # set_recompute: none | selective | full
        self.on_recompute = None  # called with the region's name after each recompute (counting them)

    def set_recompute(self, mode: str, on_recompute=None) -> None:
        """none: autograd keeps every activation; selective: the attention core
        (QKᵀ, softmax, dropout, ·V) is recomputed in the backward, its input qkv kept;
        full: only the block's input is kept and the whole block (its tensor-parallel
        collectives included) re-runs in the backward."""
        self.recompute = check_mode(mode)
        self.on_recompute = on_recompute
        self.attention.recompute_core = mode == SELECTIVE
        self.attention.on_recompute = on_recompute

    def _dropout(self, module, x, sequence):
        full = (sequence, *x.shape[1:])
        return module(x, full, 0, self.tp.rank if self.tp.sequence_parallel else 0)

    def flops(self, x: torch.Tensor, output: torch.Tensor) -> int:
        """Forward FLOPs on x (s or s/p, b, h), Megatron's count (the matmuls and the
        attention core; norms and element-wise work left out): 2·b·s·(weights) + 4·b·s²·h/p,
        = 24·b·s·h² + 4·b·s²·h at ffn = 4h and p = 1 (``partition.layer_costs``)."""
        sequence = x.shape[0] * (self.tp.size if self.tp.sequence_parallel else 1)  # what GPT passes as s
        weights = sum(linear.weight.numel() for linear in (self.attention.qkv, self.attention.proj,
                                                           self.mlp.fc1, self.mlp.fc2))
        width = self.attention.local_heads * self.attention.head_dim
        return 2 * sequence * x.shape[1] * weights + 4 * x.shape[1] * sequence ** 2 * width

    def forward(self, x: torch.Tensor, sequence: int) -> torch.Tensor:  # x: (s or s/p, b, h)
        if self.recompute == FULL:
            return recompute(self._forward, x, sequence, name="a transformer block", streams=random_streams(self),
                             on_recompute=self.on_recompute)
        return self._forward(x, sequence)

    def _forward(self, x: torch.Tensor, sequence: int) -> torch.Tensor:
        ln1_w, ln1_b, ln2_w, ln2_b, attn_b, mlp_b = sum_grads_in_backward(
            self.tp, self.ln1.weight, self.ln1.bias, self.ln2.weight, self.ln2.bias,
            self.attention.proj.bias, self.mlp.fc2.bias)
        attended, _ = self.attention.forward_unbiased(F.layer_norm(x, x.shape[-1:], ln1_w, ln1_b, LAYER_NORM_EPS))
        x = x + self._dropout(self.attention_out_dropout, attended + attn_b, sequence)
        transformed, _ = self.mlp.forward_unbiased(F.layer_norm(x, x.shape[-1:], ln2_w, ln2_b, LAYER_NORM_EPS))
        return x + self._dropout(self.mlp_out_dropout, transformed + mlp_b, sequence)


class GPT(nn.Module, LayeredModel):
    """Decoder-only transformer (see the module docstring). ``forward(tokens)`` takes
    (b, s) int tokens, s <= seq_len, and returns this rank's vocabulary slice of the
    logits, (b, s, V'/p); ``loss(tokens, targets)`` the mean cross-entropy, computed
    without gathering the logits; ``full_logits`` gathers them."""

    def __init__(self, config: GPTConfig, tp: TensorParallel | None = None, *, seed: int = 0):
        super().__init__()
        tp = UNSHARDED if tp is None else tp
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        _check_same_config(config, tp, seed)  # first, so a mismatch is named rather than left to hang
        config.check_tensor_parallel(tp.size)
        self.config, self.tp, self.seed = config, tp, seed
        dtype = config.torch_dtype
        self.embedding = VocabParallelEmbedding(config.vocab, config.hidden, tp, dtype=dtype, seed=None)
        self.position = nn.Parameter(torch.empty(config.seq_len, config.hidden, dtype=dtype))
        self.embedding_dropout = ConsistentDropout(config.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(config, tp) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden, eps=LAYER_NORM_EPS, dtype=dtype)
        self.head = None
        if not config.tied_head:
            local = self.embedding.weight.shape[0]
            self.head = mark_sharded(nn.Parameter(torch.empty(local, config.hidden, dtype=dtype)), 0, config.vocab)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Weights drawn as slices of the unsharded model's (GPT-2 scheme), and fresh
        dropout streams: the same ``seed`` gives the same model at every tp."""
        init_from_full(self, self.tp, seed, lambda name, shape, gen: _draw(name, shape, gen, self.config.layers))
        for name, module in self.named_modules():
            if isinstance(module, ConsistentDropout):
                module.reseed(seed_for(seed, "dropout:" + name))

    def set_recompute(self, mode: str, layers: int | None = None, on_recompute=None) -> None:
        """Recompute ``mode`` (none | selective | full, see TransformerBlock.set_recompute)
        for the first ``layers`` blocks (None: all); the others keep their activations."""
        set_block_recompute(list(self.blocks), mode, layers, on_recompute)

    def pipeline_layers(self) -> list[nn.Module]:
        """The embedding, the blocks and the head as one-argument layers for pipeline
        stages (``plait.models.gpt_layers``); refused with a tied head."""
        if self.config.tied_head:
            raise ValueError("a GPT with tied_head=True shares one weight between its embedding and its head, "
                             "which pipeline stages would hold twice: build GPTConfig(tied_head=False) for "
                             "pipeline parallelism")
        return gpt_layers(self)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embedding.weight if self.head is None else self.head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (b, s) -> (b, s, V'/p)
        # under sequence parallelism one all-reduce sums the three replicated gradients
        position, ln_w, ln_b = sum_grads_in_backward(self.tp, self.position, self.ln_f.weight, self.ln_f.bias)
        x = self._embed(tokens, position)
        for block in self.blocks:
            x = block(x, tokens.shape[1])
        return self._logits(x, ln_w, ln_b)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:  # (b, s) -> (s, b, h), or this rank's (s/p, b, h)
        """The first part of forward: Drop(E[tokensᵀ] + P[:s]) (what a first pipeline
        stage runs before its blocks)."""
        return self._embed(tokens, *sum_grads_in_backward(self.tp, self.position))

    def _embed(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, sequence), got shape {tuple(tokens.shape)}")
        sequence = tokens.shape[1]
        if not 0 < sequence <= self.config.seq_len:
            raise ValueError(f"sequence length {sequence} must be in [1, seq_len={self.config.seq_len}]")
        tp = self.tp
        if tp.sequence_parallel and sequence % tp.size:
            raise ValueError(f"sequence parallelism splits the sequence over tp={tp.size} ranks: sequence length "
                             f"{sequence} must be a multiple of {tp.size}")
        x = self.embedding(tokens.t())  # (s, b, h), or this rank's (s/p, b, h)
        rows = x.shape[0]
        first = tp.rank * rows if tp.sequence_parallel else 0
        x = x + position[first:first + rows].unsqueeze(1)
        return self.embedding_dropout(x, (sequence, *x.shape[1:]), 0, tp.rank if tp.sequence_parallel else 0)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # (s, b, h) -> (b, s, V'/p)
        """The last part of forward: LN_f then the vocab-parallel head (what a last
        pipeline stage runs after its blocks)."""
        return self._logits(x, *sum_grads_in_backward(self.tp, self.ln_f.weight, self.ln_f.bias))

    def _logits(self, x: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x, x.shape[-1:], ln_w, ln_b, LAYER_NORM_EPS)
        return parallel_logits(x, self.output_weight, self.tp).transpose(0, 1)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the batch (never gathers the logits)."""
        return vocab_parallel_cross_entropy(self(tokens), targets, self.tp, self.config.vocab).mean()

    def full_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(b, s, V) on every rank: an all-gather over the vocabulary."""
        return gather_logits(self(tokens), self.tp, self.config.vocab)


def _check_same_config(config: GPTConfig, tp: TensorParallel, seed: int) -> None:
    """All ranks of the group must build the same model with the same settings: one
    all-gather of their checksums (on the group's device)."""
    if tp.size == 1:
        return
    fields = {"GPTConfig": config.checksum(), "seed": seed & 0x7FFFFFFFFFFFFFFF, **tp.agreement_fields()}
    check_agreement(fields, tp.group, "every rank of a tensor-parallel group must build the same GPT",
                    f"this rank {tp.rank}: {config}, seed={seed}, {tp.describe()}, check_args={tp.check_args}")

