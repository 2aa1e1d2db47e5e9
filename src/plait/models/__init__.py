"""plait.models: small reference models used by the parallel modes, the tests and
the benchmarks (built from a seed, so every rank builds the same weights)."""

from plait.models.gpt import GPT, GPTConfig
from plait.models.mlp import MLP, SmallCNN, build_model

__all__ = ["GPT", "GPTConfig", "MLP", "SmallCNN", "build_model"]
