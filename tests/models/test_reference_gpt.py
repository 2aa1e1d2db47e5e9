"""plait's GPT against an independent float64 GPT built from torch's own modules
(tests/models/reference_gpt.py): same weights, same logits within 1e-12, tied and
untied heads. Every other GPT parity test uses plait's GPT as its own reference,
so only this one catches a wrong attention scale, mask, LayerNorm placement or GeLU."""

import pytest
import torch

from plait.models import GPT, GPTConfig
from plait.models.gpt import LAYER_NORM_EPS

from tests.models.reference_gpt import ReferenceGPT

SHAPE = dict(layers=3, hidden=48, heads=6, seq_len=20, vocab=71, ffn_hidden=80)


def _pair(tied: bool, seed: int):
    config = GPTConfig(**SHAPE, tied_head=tied, dtype="float64")
    model = GPT(config, seed=seed).eval()
    with torch.no_grad():  # GPT-2 init has zero biases and unit LayerNorms: make every parameter matter
        generator = torch.Generator().manual_seed(seed + 100)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.1)
    reference = ReferenceGPT(layers=config.layers, hidden=config.hidden, heads=config.heads, seq_len=config.seq_len,
                             vocab=config.vocab, ffn=config.ffn, tied=tied, eps=LAYER_NORM_EPS).eval()
    reference.load_plait_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("sequence", [20, 7])
def test_plait_gpt_matches_the_independent_reference(tied, sequence):
    model, reference = _pair(tied, seed=5)
    tokens = torch.randint(0, SHAPE["vocab"], (3, sequence), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got, want = model(tokens), reference(tokens)
    assert got.shape == want.shape == (3, sequence, SHAPE["vocab"])
    assert want.abs().max() > 1.0  # logits of a real size, not near zero
    assert (got - want).abs().max().item() <= 1e-12


def test_the_untied_head_is_really_separate():
    model, reference = _pair(False, seed=2)
    tokens = torch.randint(0, SHAPE["vocab"], (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference.head.weight.copy_(reference.token.weight)  # tie it by hand: the logits must change
        assert (model(tokens) - reference(tokens)).abs().max() > 1e-3
