"""plait bench auto's models (plait.models.auto_zoo) and harness (plait.bench.auto):
the zoo's models return their scalar loss and split into the layers the knob search
prices; the harness runs end to end at toy size. No timing is asserted (speed lives in
the benchmark itself)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.models.auto_zoo import TINY, ZOO, build

# float64, the same products in the same order up to the loss: only the split into
# modules differs, so 1e-12 relative (a few ulps of ~2) is the bound
EXACT = 1e-12


def test_zoo_models_return_a_scalar_loss_that_their_pipeline_layers_rebuild():
    for name in ZOO:
        model, inputs = build(name, dtype=torch.float64, **TINY[name])
        loss = model(*inputs)
        assert loss.dim() == 0 and loss.dtype == torch.float64 and torch.isfinite(loss), name
        loss.backward()
        assert all(param.grad is not None for param in model.parameters()), name
        x = inputs[0]
        for layer in model.pipeline_layers():
            x = layer(x)
        rebuilt = F.mse_loss(x, inputs[1]) if name == "moe" else F.cross_entropy(x, inputs[1])
        assert torch.allclose(rebuilt, loss, rtol=EXACT, atol=0), (name, float(rebuilt), float(loss))
        again_model, again_inputs = build(name, dtype=torch.float64, **TINY[name])  # seeded: the same
        assert torch.equal(again_model(*again_inputs), loss.detach()), name


def test_moe_mixes_exactly_the_top_k_experts_of_each_token():
    model, (x, _) = build("moe", dtype=torch.float64, **TINY["moe"])
    top_k, experts = model.top_k, model.w_in.shape[0]
    with torch.no_grad():
        gate = torch.softmax(model.gate(x), dim=-1).reshape(-1, experts)
        tokens = x.reshape(-1, x.shape[-1])
        outputs = torch.stack([torch.relu(tokens @ model.w_in[e] + model.b_in[e]) @ model.w_out[e]
                               for e in range(experts)])  # (E, n, H): each expert alone
        expected = tokens.clone()
        for token in range(tokens.shape[0]):
            for expert in gate[token].topk(top_k).indices.tolist():
                expected[token] += gate[token, expert] * outputs[expert, token]
        got = model.mixture(x).reshape(tokens.shape)
    assert 1 <= top_k < experts
    assert torch.allclose(got, expected, rtol=EXACT, atol=EXACT)
