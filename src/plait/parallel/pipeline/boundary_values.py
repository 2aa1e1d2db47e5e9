"""What crosses a pipeline boundary: one tensor, or a tuple of tensors (an automatically
split model's hidden states with its position ids, masks, rotary cos/sin:
``plait.parallel.pipeline.graph_split``).

One tensor keeps the engine's rule: a floating stage input is a leaf collecting its
gradient, and the gradient sent upstream is that leaf's. In a tuple, a part carries a
gradient back exactly when the sending stage's tensor required one (a floating
activation made from parameters; not cos/sin made from a buffer, nor integer position
ids or a bool mask, which travel forward only): the message says which
(``messages.pack``), the receiver makes those parts leaves, and the gradient message is
the tuple of those parts' gradients, in order (zeros for a part the stage did not use).
"""

from __future__ import annotations

import torch


def parts(value) -> tuple:
    """The tensors of a boundary value (a tensor alone: a 1-tuple)."""
    return value if isinstance(value, tuple) else (value,)


def shape_of(value):
    """A boundary value's shape (a tuple of shapes for a tuple)."""
    return tuple(tuple(part.shape) for part in value) if isinstance(value, tuple) else tuple(value.shape)


def as_leaf(value):
    """A received stage input. One tensor: a leaf that collects its gradient when floating
    (integer inputs, e.g. token ids, carry none). A tuple arrives with its parts' flags set."""
    if isinstance(value, tuple):
        return value
    return value.requires_grad_(True) if value.is_floating_point() else value


def handed_over(value):
    """A stage output given to the next stage on this rank, detached as a message would be."""
    if isinstance(value, tuple):
        return tuple(part.detach().requires_grad_(part.requires_grad and part.is_floating_point()) for part in value)
    return as_leaf(value.detach())


def input_grad(stage_input):
    """The gradient a stage hands upstream: zeros where its input did not influence the
    loss (None would read as an abort); for a tuple, one per part that carries a gradient."""
    if isinstance(stage_input, tuple):
        return tuple(_grad(part) for part in stage_input if part.requires_grad)
    return _grad(stage_input)


def _grad(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)


def grad_pairs(output, grad) -> tuple[list, list | None]:
    """(outputs to differentiate, their gradients) of a stage output and the gradient
    received for it: for a tuple, the parts that require a gradient, paired in order
    with the received tuple. ([], None) when nothing does."""
    if not isinstance(output, tuple):
        return ([output], None if grad is None else [grad]) if output.requires_grad else ([], None)
    wanted = [part for part in output if part.requires_grad]
    if len(wanted) != len(grad):
        raise RuntimeError(f"a stage output has {len(wanted)} parts that carry gradients, the next stage sent "
                           f"{len(grad)} gradients back")
    return wanted, list(grad)


def gradient_inputs(stage_input) -> list:
    """The stage input's tensors that collect a gradient (the first stage's: none)."""
    if stage_input is None:
        return []
    return [part for part in parts(stage_input) if part.requires_grad]
