"""A plait GPT as pipeline layers: tokens (b, s) -> [GPTEmbeddingLayer] -> (s, b, h) ->
[GPTBlockLayer] x l -> [GPTHeadLayer] -> logits (b, s, V'/tp), each a one-argument module
sharing the model's parameters (``GPT.pipeline_layers``, which
``plait.parallel.pipeline.partition.sequential_layers`` returns). They live with the model,
so the stage splitter below needs no model class."""

from __future__ import annotations

import torch
from torch import nn


def gpt_layers(model: nn.Module) -> list[nn.Module]:
    """The embedding, the l blocks and the head of GPT ``model`` as layers, in its
    training mode (the wrappers only; the shared modules keep their own modes)."""
    layers = [GPTEmbeddingLayer(model), *(GPTBlockLayer(block) for block in model.blocks), GPTHeadLayer(model)]
    for layer in layers:
        layer.training = model.training
    return layers


class GPTEmbeddingLayer(nn.Module):
    """tokens (b, s) -> x (s, b, h) = Drop(E[tokensᵀ] + P[:s]): ``GPT.embed``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        # registered: the parameters this layer trains; the model itself is kept unregistered
        self.embedding, self.position, self.embedding_dropout = model.embedding, model.position, model.embedding_dropout
        self._model = (model,)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (b, s) -> (s, b, h)
        return self._model[0].embed(tokens)

    def flops(self, tokens: torch.Tensor, output: torch.Tensor) -> int:
        """The position add, b·s·h (the lookup is free)."""
        return output.numel()


class GPTBlockLayer(nn.Module):
    """x (s, b, h) -> block(x, s): one TransformerBlock as a one-argument layer."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.block.tp
        return self.block(x, x.shape[0] * (tp.size if tp.sequence_parallel else 1))


class GPTHeadLayer(nn.Module):
    """x (s, b, h) -> logits (b, s, V'/tp) = (LN_f(x) Wᵀ)ᵀ with the GPT's untied,
    vocab-parallel head W: ``GPT.logits``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.ln_f, self.head = model.ln_f, model.head
        self._model = (model,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (s, b, h) -> (b, s, V'/tp)
        return self._model[0].logits(x)

    def flops(self, x: torch.Tensor, output: torch.Tensor) -> int:
        """LayerNorm 5·b·s·h plus the head matmul 2·b·s·h·V."""
        return 5 * x.numel() + 2 * (x.numel() // x.shape[-1]) * self.head.numel()
