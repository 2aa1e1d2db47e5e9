"""Cross-entropy over vocabulary-parallel logits, without gathering them.

Rank r holds logits z[..., j] for its vocabulary slice. The loss of target t is
log Σ_j exp(z_j - m) - (z_t - m) with m = max_j z_j. Each rank reduces its slice:
  1. all-reduce MAX of the local maxima             -> m        (b·s elements)
  2. all-reduce SUM of [Σ_local exp(z - m), z_t - m] -> both sums (2·b·s elements;
     z_t - m is nonzero only on the rank holding t)
Two all-reduces per call (Megatron-LM runs the two sums as separate calls: three).
The gradient is softmax(z) - onehot(t) on each rank's own slice: no
communication backward. Columns past the true vocabulary (the padding that makes
V a multiple of p) are masked to -inf, so they take no probability and get a zero
gradient.
"""

from __future__ import annotations

import torch

from plait.parallel.tensor.group import UNSHARDED, TensorParallel
from plait.parallel.tensor.mappings import all_reduce_owned, gather_from_region


def _vocab_start(local_vocab: int, tp: TensorParallel) -> int:
    return tp.rank * local_vocab


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, tp, vocab_size):
        local_vocab = logits.shape[-1]
        start = _vocab_start(local_vocab, tp)
        if start + local_vocab > vocab_size:  # this rank holds padded columns: masked (a copy)
            columns = torch.arange(start, start + local_vocab, device=logits.device)
            logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
        maximum = all_reduce_owned(logits.detach().amax(dim=-1), tp, op="max")  # (...); amax's own tensor
        shifted = logits - maximum.unsqueeze(-1)
        local_target = targets - start
        held = (local_target >= 0) & (local_target < local_vocab)
        index = local_target.masked_fill(~held, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(~held, 0.0)
        exp = shifted.exp()
        sums = all_reduce_owned(torch.stack([exp.sum(dim=-1), target_logit]), tp)  # (2, ...)
        sum_exp, target_logit = sums[0], sums[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), index, held)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, held = ctx.saved_tensors
        grad = softmax.clone()  # softmax stays saved (a second backward with retain_graph reads it)
        grad.scatter_add_(-1, index, -held.unsqueeze(-1).to(grad.dtype))
        if grad_loss.dtype == grad.dtype:
            return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None  # the clone is ours: in place
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel = UNSHARDED,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss (shape of ``targets``) from logits split by vocabulary
    (``(..., V'/p)``, rank r holding columns [r·V'/p, (r+1)·V'/p)); ``vocab_size`` is the
    true V when the vocabulary was padded. Take ``.mean()`` for the usual loss.
    Half-precision logits are reduced in float32 (the loss comes back float32)."""
    local_vocab = logits.shape[-1]
    padded = local_vocab * tp.size
    vocab_size = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {padded}] for logits of {local_vocab} "
                         f"columns per rank x tp={tp.size}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: logits "
                         "must be targets' shape plus the vocabulary slice")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(f"targets must lie in [0, {vocab_size}), got min {int(targets.min())} "
                         f"and max {int(targets.max())}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # exp and the sums in float32, as mixed-precision training does
    return _VocabParallelCrossEntropy.apply(logits, targets, tp, vocab_size)


def gather_logits(logits: torch.Tensor, tp: TensorParallel = UNSHARDED, vocab_size: int | None = None):
    """The full logits (..., V) on every rank (an all-gather, for evaluation and tests)."""
    full = gather_from_region(logits, tp)
    return full if vocab_size is None else full[..., :vocab_size]
