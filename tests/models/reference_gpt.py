"""An independent float64 GPT, built only from torch's own modules, to check
plait's GPT against (tests/models/test_reference_gpt.py).

Nothing here imports plait: the attention is ``F.scaled_dot_product_attention``
with ``is_causal=True`` (its own 1/sqrt(d) scale and mask), LayerNorms are
``nn.LayerNorm``, the MLP is two ``nn.Linear`` around ``F.gelu`` (exact, erf
form: plait calls ``F.gelu`` with no approximation), embeddings are
``nn.Embedding``. A wrong scale, LayerNorm placement, residual or GeLU in plait
therefore shows up as a logit difference instead of cancelling out.

Layout is the textbook (batch, sequence, hidden) one with separate q, k, v
projections; ``load_plait_state_dict`` maps plait's fused, head-major QKV
((heads, 3, head_dim) rows) onto them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ReferenceBlock(nn.Module):
    """Pre-LayerNorm: x + Attn(LN1 x), then x + MLP(LN2 x)."""

    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden, eps=eps, dtype=torch.float64)
        self.q = nn.Linear(hidden, hidden, dtype=torch.float64)
        self.k = nn.Linear(hidden, hidden, dtype=torch.float64)
        self.v = nn.Linear(hidden, hidden, dtype=torch.float64)
        self.out = nn.Linear(hidden, hidden, dtype=torch.float64)
        self.ln2 = nn.LayerNorm(hidden, eps=eps, dtype=torch.float64)
        self.fc1 = nn.Linear(hidden, ffn, dtype=torch.float64)
        self.fc2 = nn.Linear(ffn, hidden, dtype=torch.float64)

    def attention(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, s, h)
        b, s, h = x.shape

        def split(t):  # (b, s, h) -> (b, n, s, d)
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        context = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.out(context.transpose(1, 2).reshape(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="none"))


class ReferenceGPT(nn.Module):
    """tokens (b, s) -> logits (b, s, V), float64, tied or untied output head."""

    def __init__(self, *, layers: int, hidden: int, heads: int, seq_len: int, vocab: int, ffn: int,
                 tied: bool, eps: float = 1e-5):
        super().__init__()
        self.hidden, self.heads, self.tied = hidden, heads, tied
        self.token = nn.Embedding(vocab, hidden, dtype=torch.float64)
        self.position = nn.Embedding(seq_len, hidden, dtype=torch.float64)
        self.blocks = nn.ModuleList(ReferenceBlock(hidden, heads, ffn, eps) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=eps, dtype=torch.float64)
        self.head = None if tied else nn.Linear(hidden, vocab, bias=False, dtype=torch.float64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return x @ self.token.weight.t() if self.tied else self.head(x)

    @torch.no_grad()
    def load_plait_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an unsharded plait GPT state dict in (every tensor used exactly once)."""
        unused = set(state)

        def take(name):
            unused.discard(name)
            return state[name].to(torch.float64)

        self.token.weight.copy_(take("embedding.weight"))
        self.position.weight.copy_(take("position"))
        d = self.hidden // self.heads
        for i, block in enumerate(self.blocks):
            prefix = f"blocks.{i}."
            for ln in ("ln1", "ln2"):
                getattr(block, ln).weight.copy_(take(prefix + ln + ".weight"))
                getattr(block, ln).bias.copy_(take(prefix + ln + ".bias"))
            # plait's fused rows are (heads, 3, head_dim): head-major, then q/k/v
            qkv_w = take(prefix + "attention.qkv.weight").view(self.heads, 3, d, self.hidden)
            qkv_b = take(prefix + "attention.qkv.bias").view(self.heads, 3, d)
            for which, linear in enumerate((block.q, block.k, block.v)):
                linear.weight.copy_(qkv_w[:, which].reshape(self.hidden, self.hidden))
                linear.bias.copy_(qkv_b[:, which].reshape(self.hidden))
            for mine, theirs in (("out", "attention.proj"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
                getattr(block, mine).weight.copy_(take(prefix + theirs + ".weight"))
                getattr(block, mine).bias.copy_(take(prefix + theirs + ".bias"))
        self.ln_f.weight.copy_(take("ln_f.weight"))
        self.ln_f.bias.copy_(take("ln_f.bias"))
        if not self.tied:
            self.head.weight.copy_(take("head"))
        if unused:
            raise ValueError(f"plait state dict entries the reference does not use: {sorted(unused)}")
