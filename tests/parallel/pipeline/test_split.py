"""split(model, example_inputs, ...) in one process (issue 34, item 2): the stages run in
sequence reproduce the whole model bit for bit (the same modules run the same
operations on the same values), hold the user's modules under their original names,
find the tied weight, carry what the graph needs across each boundary, and refuse what
they cannot split by name."""

import pytest
import torch
from torch import nn

from plait.parallel.pipeline import split
from plait.parallel.pipeline.graph_split import causal_lm_loss
from plait.parallel.pipeline.graph_trace import TraceError
from tests.hf_models import tiny_gpt2, tiny_llama

VOCAB, SEQ = 64, 8
NO_CACHE = {"use_cache": False}


def _ids(batch=2, seed=0):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _run(pieces, *inputs):
    values = inputs
    for module in pieces.modules:
        values = module(*values)
        values = values if isinstance(values, tuple) else (values,)
    (logits,) = values
    return logits


@pytest.mark.parametrize("how", [dict(stages=2), dict(stages=4), dict(stages=3, balance="params"),
                                 dict(split_points=["transformer.h.2"]),
                                 dict(split_points=["transformer.h.1.mlp", "transformer.h.3"])])
def test_gpt2_stages_in_sequence_equal_the_model_bit_for_bit(how):
    model = tiny_gpt2(0, VOCAB, n_layer=4)
    ids = _ids()
    pieces = split(model, ids, kwargs=NO_CACHE, **how)
    assert torch.equal(_run(pieces, ids), model(ids, use_cache=False).logits)
    # the user's own modules, under their original names (a TP plan's wildcards apply to them)
    first, last = pieces.modules[0], pieces.modules[-1]
    assert first.get_submodule("transformer.h.0") is model.transformer.h[0]
    assert last.get_submodule("lm_head") is model.lm_head
    assert "transformer.wte.weight" in dict(first.named_parameters())
    assert dict(last.named_parameters())["lm_head.weight"] is model.transformer.wte.weight  # the tie, found
    assert pieces.shared == {"transformer.wte.weight": (0, len(pieces.modules) - 1)}
    assert pieces.tied == [[(0, "transformer.wte.weight"), (len(pieces.modules) - 1, "lm_head.weight")]]
    if len(how.get("split_points", ())) == 2:  # a point inside a block opens it: its children are the leaves
        assert pieces.leaves[1][:2] == ["transformer.h.1.mlp", "transformer.h.2"]
        assert pieces.leaves[0][-3:] == ["transformer.h.1.ln_1", "transformer.h.1.attn", "transformer.h.1.ln_2"]
        assert pieces.boundaries[0][1:] == [(torch.float64, (2, SEQ, 32))] * 2  # the residual and ln_2's output
        return
    leaves = [leaf for stage in pieces.leaves for leaf in stage]
    blocks = [f"transformer.h.{i}" for i in range(4)]
    assert leaves == ["transformer.wte", "transformer.wpe", "transformer.drop", *blocks, "transformer.ln_f", "lm_head"]
    if how.get("split_points") == ["transformer.h.2"]:
        assert pieces.leaves[1][0] == "transformer.h.2"
    if how.get("stages") == 2:  # balanced by FLOPs: two blocks a side, the head's matmul with the last two
        assert pieces.leaves[1] == ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]
    # position ids (int64, made once from an arange) travel with the hidden states
    assert pieces.boundaries[0] == [(torch.int64, (1, SEQ)), (torch.float64, (2, SEQ, 32))]


def test_llama_boundaries_carry_position_ids_and_rotary_cos_sin():
    model = tiny_llama(0, VOCAB, num_hidden_layers=3)
    ids = _ids()
    pieces = split(model, ids, stages=3, kwargs=NO_CACHE)
    assert torch.equal(_run(pieces, ids), model(ids, use_cache=False).logits)
    assert pieces.leaves[0][:2] == ["model.embed_tokens", "model.rotary_emb"]
    head_dim = 8
    assert pieces.boundaries[0] == [(torch.int64, (1, SEQ)), (torch.float64, (1, SEQ, head_dim)),
                                    (torch.float64, (1, SEQ, head_dim)), (torch.float64, (2, SEQ, 32))]
    assert pieces.shared == {}
    assert pieces.modules[1].get_submodule("model.layers.1") is model.model.layers[1]


def test_causal_lm_loss_is_hf_loss():
    """HF's loss (labels = the inputs, shifted inside) equals causal_lm_loss of the logits:
    bit for bit in float32; in float64 HF's ForCausalLMLoss upcasts with .float(), i.e.
    casts float64 logits DOWN to float32, so its loss is float32-accurate (~1e-7)."""
    model = tiny_gpt2(0, VOCAB).float()
    ids = _ids()
    output = model(ids, labels=ids, use_cache=False)
    assert torch.equal(causal_lm_loss(output.logits, ids), output.loss)
    double = tiny_gpt2(0, VOCAB)
    output = double(ids, labels=ids, use_cache=False)
    assert output.loss.dtype == torch.float32
    assert abs(causal_lm_loss(output.logits, ids).item() - output.loss.item()) < 1e-6


class _Branchy(nn.Module):
    """Data-dependent control flow in the glue: which layer runs depends on the values."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = _Branchy(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner(x))


def test_refusals_are_named():
    model, ids = tiny_gpt2(0, VOCAB), _ids()
    with pytest.raises(ValueError, match=r"split point 'transformer.h.9' names no module of GPT2LMHeadModel \(did "
                                         r"you mean 'transformer.h.1', 'transformer.h.0'"):
        split(model, ids, split_points=["transformer.h.9"], kwargs=NO_CACHE)
    with pytest.raises(ValueError, match=r"stages=8 is more than the 7 leaf module calls of GPT2LMHeadModel "
                                         r"\(transformer.wte, .*lm_head\): use at most 7 stages"):
        split(model, ids, stages=8, kwargs=NO_CACHE)
    with pytest.raises(ValueError, match=r"pass stages=N \(balanced\) or split_points"):
        split(model, ids)
    # HF's default use_cache=True builds a DynamicCache the blocks would share between calls
    with pytest.raises(TraceError, match=r"argument cache of transformer.h.0 \(GPT2Block\) is a "
                                         r"DynamicCache, an object a split stage cannot carry .* "
                                         r"kwargs=\{'use_cache': False\}"):
        split(model, ids, stages=2)
    with pytest.raises(TraceError, match=r"data-dependent control flow: the forward of inner reads a tensor's "
                                         r"values into Python \(__bool__\) at .*test_split.py:\d+ .*make 'inner' a "
                                         r"leaf \(split\(\.\.\., leaves=\['inner'\]\)\)"):
        split(_Outer(), torch.randn(3, 4), stages=2)
    # made a leaf, it runs whole (its branch decided per call) and the split is exact
    outer = _Outer()
    pieces = split(outer, torch.randn(3, 4), stages=2, leaves=["inner"])
    x = -torch.ones(3, 4)
    assert pieces.leaves == [["inner"], ["head"]] and torch.equal(_run(pieces, x), outer(x))
    pieces = split(model, ids, stages=2, kwargs=NO_CACHE)
    with pytest.raises(ValueError, match=r"stage 0 was traced with \(2, 8\) for this input and got \(4, 8\): split "
                                         r"fixes the shapes .* example inputs of the micro-batch shape"):
        pieces.modules[0](_ids(4))
    model.eval()
    with pytest.raises(RuntimeError, match=r"the model was traced in training mode and is now in the other"):
        pieces.modules[0](ids)


class _DynamicShape(nn.Module):
    """A shape read of a boolean-mask selection: the count depends on the values."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) * h[h[:, 0] > 0].shape[0]


class _Unregistered(nn.Module):
    """A layer kept in a plain list: torch does not see its parameters."""

    def __init__(self):
        super().__init__()
        self.a, self.hidden = nn.Linear(4, 4), [nn.Linear(4, 4)]

    def forward(self, x):
        return self.hidden[0](self.a(x))


def test_silent_fixings_are_refused():
    with pytest.raises(TraceError, match=r"the forward of the model reads a tensor's values into Python \(shape of a "
                                         r"tensor whose shape depends on values\)"):
        split(_DynamicShape(), torch.randn(3, 4), stages=2)
    with pytest.raises(TraceError, match=r"an argument of linear in the forward of the model is a parameter \(4, 4\) "
                                         r"that is not registered in _Unregistered .* a constant that never trains"):
        split(_Unregistered(), torch.randn(3, 4), stages=2)
