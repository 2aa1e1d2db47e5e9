"""What ``SequenceParallel`` does to a module under sequence parallelism, with hooks
(the module's own code and parameters stay as they are).

- Its own parameters (LayerNorm/RMSNorm scales and biases) see only this rank's
  slice of the sequence, so each rank's gradient is a partial sum: a hook on each
  sums it over the tensor-parallel group (one all-reduce of the parameter's size per
  backward), as Megatron-LM sums its sequence-parallel LayerNorm gradients. The hook
  runs on the gradient of one backward before it is accumulated into ``.grad``, so
  gradient accumulation stays exact.
- ``entry``: its first positional input, replicated, is split along the sequence
  before it runs (``scatter_to_sequence``; backward all-gathers the gradient).
- ``exit``: its output is all-gathered back to the replicated whole sequence
  (``gather_to_replicated``; backward keeps this rank's slice).
"""

from __future__ import annotations

import torch
from torch import nn

from plait.parallel.tensor.group import TensorParallel
from plait.parallel.tensor.layout import REPLICATED, SEQUENCE_SHARDED, LayoutCheck
from plait.parallel.tensor.mappings import all_reduced_copy, gather_to_replicated, scatter_to_sequence


class SumOverGroup:
    """A parameter's gradient hook: the sum of every rank's partial gradient."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return all_reduced_copy(grad, self.tp)


def _first_tensor(name: str, what: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: SequenceParallel({what}=True) splits a module's first positional input / gathers its "
                        f"output, which must be a tensor, got {type(value).__name__}: put the {what} on a module "
                        f"that takes / returns the hidden states")
    return value


class SplitSequence:
    """A forward pre-hook: the replicated first input -> this rank's sequence slice."""

    def __init__(self, name: str, tp: TensorParallel, seq_dim: int):
        self.name, self.tp, self.seq_dim = name, tp, seq_dim
        self.layout_check = LayoutCheck(f"{name} (sequence-parallel entry) input", REPLICATED)

    def __call__(self, module: nn.Module, args):
        if not args:
            raise TypeError(f"{self.name}: the sequence-parallel entry needs the hidden states as the first "
                            f"positional argument, got none")
        x = _first_tensor(self.name, "entry", args[0])
        self.layout_check(x, self.tp)
        return (scatter_to_sequence(x, self.tp, self.seq_dim).movedim(0, self.seq_dim), *args[1:])


class GatherSequence:
    """A forward hook: this rank's sequence slice of the output -> the replicated whole."""

    def __init__(self, name: str, tp: TensorParallel, seq_dim: int):
        self.name, self.tp, self.seq_dim = name, tp, seq_dim
        self.layout_check = LayoutCheck(f"{name} (sequence-parallel exit) output", SEQUENCE_SHARDED)

    def __call__(self, module: nn.Module, args, output):
        y = _first_tensor(self.name, "exit", output)
        self.layout_check(y, self.tp)
        # contiguous: the gathered (b, s, h) is a movedim view; every projection reading it
        # would copy it and save its own copy (q, k, v, gate, up: five per block, not one)
        return gather_to_replicated(y.movedim(self.seq_dim, 0), self.tp, self.seq_dim).contiguous()


def add_sequence_hooks(name: str, module: nn.Module, style, tp: TensorParallel, seq_dim: int) -> None:
    """Make ``module`` run on the sequence shard (see the module docstring)."""
    if tp.size > 1:
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                param.register_hook(SumOverGroup(tp))
    if style.entry:
        module.register_forward_pre_hook(SplitSequence(name, tp, seq_dim))
    if style.exit:
        module.register_forward_hook(GatherSequence(name, tp, seq_dim))
