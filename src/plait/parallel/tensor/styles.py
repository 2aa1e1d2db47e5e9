"""The styles a tensor-parallel plan maps module names to (torch's names, Megatron's layouts).

A style says how one module is split over the p ranks of a tensor-parallel group:

- ``ColwiseParallel``: y = x A + b with A (in, out) split by output features: rank r
  holds out/p columns (its heads for an attention projection, its slice of the FFN).
  No communication forward; backward all-reduces dx (or, under sequence parallelism,
  the forward all-gathers the sequence shards and the backward reduce-scatters).
  ``gather_output=True`` all-gathers y to full width (an HF ``lm_head`` that must
  return the whole logits, so HF's own loss is exact); the default leaves y split
  along its last dim, as torch's ``ColwiseParallel`` does (``Shard(-1)``), for a
  following row-parallel layer or ``vocab_parallel_cross_entropy``.
  ``fused=3`` is a fused q|k|v projection of three equal parts, ``fused=(q, k, v)``
  one with grouped k/v heads (GQA): rank r keeps its 1/p of every part, so it holds
  whole heads of q, k and v; ``head_dim=d`` makes the check (each rank's share of
  every part a whole number of heads of width d) explicit for a model without an
  adapter that knows its heads. ``pad=True`` lets a vocabulary head whose width p does
  not divide be padded with zero columns (Megatron pads the vocabulary the same
  way): gathered logits are cut back to the true width, sharded ones carry zero
  columns that ``vocab_parallel_cross_entropy(..., vocab_size=V)`` masks.
- ``RowwiseParallel``: y = x B + b with B split by input features; its input is a
  column-parallel layer's split output (``input_is_parallel``), its partial products
  are summed by one all-reduce forward (a reduce-scatter along the sequence under
  sequence parallelism), then the replicated bias is added.
- ``VocabParallel``: an embedding table split by vocabulary rows (padded to a
  multiple of p); each rank looks up the tokens it holds and one all-reduce sums
  the partial embeddings.
- ``SequenceParallel``: a module that runs on this rank's slice of the sequence
  under sequence parallelism (LayerNorm, RMSNorm, dropout: Korthikanti et al. 2022);
  its replicated parameters see only that slice, so their gradients are summed over
  the group, as Megatron-LM does. ``entry=True``: its input arrives replicated and
  is split along the sequence first; ``exit=True``: its output is all-gathered back
  to replicated. Without sequence parallelism it changes nothing.
- ``Replicate``: the module stays whole on every rank (say so explicitly: under
  sequence parallelism every parameter must be claimed by the plan).

Each style has ``.kind``, one of ``KINDS``; a plan may give the kind's string instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.parallel.tensor.layout import REPLICATED, SEQUENCE_SHARDED

COLWISE, ROWWISE, VOCAB, SEQUENCE, REPLICATE = "colwise", "rowwise", "vocab", "sequence", "replicate"
KINDS = (COLWISE, ROWWISE, VOCAB, SEQUENCE, REPLICATE)
LAYOUTS = (REPLICATED, SEQUENCE_SHARDED)


def _check_layout_name(owner: str, name: str, value) -> None:
    if value is not None and value not in LAYOUTS:
        raise ValueError(f"{owner}: {name}={value!r} must be None (the plan's default), {REPLICATED!r} or "
                         f"{SEQUENCE_SHARDED!r}")


def _check_bool(owner: str, **flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class ColwiseParallel:
    """Split by output features (see the module docstring). ``input_layout``: None
    means sequence-sharded under a sequence-parallel plan, replicated otherwise;
    give ``"replicated"`` for a layer after the sequence-parallel exit."""

    gather_output: bool = False
    fused: int | tuple[int, ...] | None = None
    pad: bool = False
    input_layout: str | None = None
    head_dim: int | None = None
    kind = COLWISE

    def __post_init__(self):
        _check_bool("ColwiseParallel", gather_output=self.gather_output, pad=self.pad)
        _check_layout_name("ColwiseParallel", "input_layout", self.input_layout)
        if self.head_dim is not None and (isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int)
                                          or self.head_dim < 1):
            raise ValueError(f"ColwiseParallel: head_dim={self.head_dim!r} must be a positive int (or None)")
        fused = self.fused
        if fused is None:
            return
        if isinstance(fused, bool) or not isinstance(fused, (int, tuple)):
            raise TypeError(f"ColwiseParallel: fused must be a number of equal parts (3 for q|k|v) or a tuple of "
                            f"part sizes such as (q_size, k_size, v_size), got {fused!r}")
        if isinstance(fused, int) and fused < 2:
            raise ValueError(f"ColwiseParallel: fused={fused} must be >= 2 parts (3 for a fused q|k|v)")
        if isinstance(fused, tuple) and (len(fused) < 2 or any(isinstance(size, bool) or not isinstance(size, int)
                                                               or size < 1 for size in fused)):
            raise ValueError(f"ColwiseParallel: fused={fused} must hold two or more positive part sizes")
        if self.pad:
            raise ValueError("ColwiseParallel: pad=True pads a vocabulary head; a fused projection cannot be padded "
                             "(its parts must each divide by tp)")

    def parts(self, out_features: int) -> tuple[int, ...] | None:
        """The fused parts' sizes for a layer of ``out_features`` (None: not fused)."""
        if self.fused is None:
            return None
        if isinstance(self.fused, int):
            if out_features % self.fused:
                raise ValueError(f"ColwiseParallel(fused={self.fused}): out_features={out_features} does not split "
                                 f"into {self.fused} equal parts; give the part sizes, fused=(q, k, v)")
            return (out_features // self.fused,) * self.fused
        if sum(self.fused) != out_features:
            raise ValueError(f"ColwiseParallel(fused={self.fused}): the parts sum to {sum(self.fused)}, not the "
                             f"layer's out_features={out_features}")
        return self.fused


@dataclass(frozen=True)
class RowwiseParallel:
    """Split by input features (see the module docstring). ``output_layout``: None
    means sequence-sharded (reduce-scatter) under a sequence-parallel plan, replicated
    (all-reduce) otherwise. ``input_is_parallel=False`` takes a replicated input and
    keeps this rank's slice of its last dim."""

    input_is_parallel: bool = True
    output_layout: str | None = None
    kind = ROWWISE

    def __post_init__(self):
        _check_bool("RowwiseParallel", input_is_parallel=self.input_is_parallel)
        _check_layout_name("RowwiseParallel", "output_layout", self.output_layout)


@dataclass(frozen=True)
class VocabParallel:
    """An embedding split by vocabulary rows. ``output_layout``: replicated (one
    all-reduce, the default) or, under sequence parallelism, ``"sequence-sharded"``
    (a reduce-scatter: the embedding is the sequence-parallel entry, as in Megatron;
    only where nothing between the embedding and the blocks needs the whole sequence)."""

    output_layout: str = REPLICATED
    kind = VOCAB

    def __post_init__(self):
        _check_layout_name("VocabParallel", "output_layout", self.output_layout)


@dataclass(frozen=True)
class SequenceParallel:
    """Runs on the sequence shard under sequence parallelism (see the module docstring)."""

    entry: bool = False
    exit: bool = False
    kind = SEQUENCE

    def __post_init__(self):
        _check_bool("SequenceParallel", entry=self.entry, exit=self.exit)


@dataclass(frozen=True)
class Replicate:
    """The module stays whole on every rank."""

    kind = REPLICATE


BY_NAME = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel, VOCAB: VocabParallel, SEQUENCE: SequenceParallel,
           REPLICATE: Replicate}
STYLES = tuple(BY_NAME.values())


def as_style(value, pattern: str = "?"):
    """A style, or the default style of a kind's string ("colwise", ...)."""
    if isinstance(value, STYLES):
        return value
    if isinstance(value, str) and value in BY_NAME:
        return BY_NAME[value]()
    raise TypeError(f"plan entry {pattern!r}: {value!r} is not a style; use ColwiseParallel(), RowwiseParallel(), "
                    f"VocabParallel(), SequenceParallel(), Replicate() or one of the strings {', '.join(KINDS)}")
