"""plait.models: small reference models used by the parallel modes, the tests and
the benchmarks (built from a seed, so every rank builds the same weights)."""

from plait.models.mlp import MLP, SmallCNN, build_model

__all__ = ["MLP", "SmallCNN", "build_model"]
