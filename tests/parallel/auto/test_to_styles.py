"""The parallelize plan compiled from the ILP's choice on HF GPT-2 trains exactly like
one process (float64, 2 gloo ranks).

The plan: the ILP's choice for GPT-2 in tests/plan/auto/test_megatron.py's Megatron
set-up (2 blocks of width 512, 4 x 16 tokens, 2 A100s: weights outweigh activations),
compiled by compile_styles. Module names and styles do not depend on the width, so the
plan is applied to the same architecture at width 32 (4 heads, vocabulary 64, tied head,
float64), which two CPU ranks train in a second.
Each rank rebuilds the model from the same seed, parallelizes it with that plan and
trains it two AdamW steps beside an unsharded copy: the loss, every gathered gradient
and the gathered parameters after the steps are compared. Tolerances as in
tests/parallel/tensor/test_plan_parity.py: the sharded matmuls add the same products
in another association (~1e-14 in float64 for values of order 1): losses and gradients
within 1e-12, parameters after two AdamW steps of lr 1e-2 within 1e-10.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.trace import simplify, trace_graph
from plait.parallel.tensor import ParallelPlan, TensorParallel, gather_grads, gather_state_dict, gpt2_plan, parallelize
from plait.plan.auto.ilp import solve
from plait.plan.auto.strategies import graph_strategies
from plait.plan.auto.to_styles import adapter_for, compile_styles, effective_styles
from plait.plan.cluster import cluster_preset
from plait.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for hf_models
from hf_models import tiny_gpt2  # noqa: E402

VOCAB, BATCH, SEQUENCE, TP = 64, 2, 8, 2
PLANNED = dict(n_embd=512, n_head=8, n_positions=16)  # the ILP's model: test_megatron's
LOSS_ATOL, PARAMS_ATOL = 1e-12, 1e-10


class GPT2Loss(torch.nn.Module):
    """tiny GPT-2 with a float64 cross-entropy on its logits: the training step."""

    def __init__(self, **config):
        super().__init__()
        self.gpt2 = tiny_gpt2(vocab_size=VOCAB, **config)

    def forward(self, tokens, targets):
        logits = self.gpt2(tokens, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _batch(step: int, batch: int = BATCH, sequence: int = SEQUENCE):
    generator = torch.Generator().manual_seed(100 + step)
    return tuple(torch.randint(0, VOCAB, (batch, sequence), generator=generator) for _ in range(2))


def _compiled_plan():
    torch.manual_seed(0)
    model = GPT2Loss(**PLANNED).float()
    graph = simplify(trace_graph(model, _batch(0, 4, 16)).graph)
    mesh, cluster = AutoMesh((TP,)), cluster_preset("dgx-a100", gpus=TP)
    result = solve(graph, graph_strategies(graph, mesh, cluster), mesh, cluster)
    return model, compile_styles(graph, result.choice, mesh, model=model)


def _train(rank: int, world_size: int, styles: dict) -> dict:
    torch.manual_seed(0)
    model, reference = GPT2Loss(), GPT2Loss()
    parallelize(model, TensorParallel(), ParallelPlan(styles=styles, adapter=adapter_for(model)))
    tp = next(module.tp for module in model.modules() if isinstance(getattr(module, "tp", None), TensorParallel))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, reference)]
    errors = {}
    for step in range(2):
        losses = [m(*_batch(step)) for m in (model, reference)]
        errors[f"loss_{step}"] = abs(float(losses[0].detach() - losses[1].detach()))
        for optimizer, loss in zip(optimizers, losses):
            optimizer.zero_grad()
            loss.backward()
        grads = gather_grads(model, tp)
        errors[f"grads_{step}"] = max(float((grads[name] - param.grad).abs().max())
                                      for name, param in reference.named_parameters())
        for optimizer in optimizers:
            optimizer.step()
    full = gather_state_dict(model, tp)
    errors["params"] = max(float((full[name] - value).abs().max()) for name, value in reference.state_dict().items())
    local = sum(param.numel() for param in model.parameters())
    errors["local_fraction"] = local / sum(param.numel() for param in reference.parameters())
    dist.barrier()
    return errors


@pytest.mark.slow
def test_compiled_plan_trains_like_one_process():
    model, compiled = _compiled_plan()
    assert compiled.ok, compiled.reason
    inner = {name.removeprefix("gpt2."): style for name, style in compiled.plan.styles.items()}
    want = effective_styles(model.gpt2, gpt2_plan(model.gpt2), TP)
    assert effective_styles(model.gpt2, inner, TP) == {key: style for key, style in want.items() if ".h." in key}
    for errors in run_distributed(_train, TP, compiled.plan.styles, timeout_s=240):
        assert errors.pop("local_fraction") < 0.7, "the plan shards the blocks' weights"
        params = errors.pop("params")
        assert max(errors.values()) < LOSS_ATOL, errors
        assert params < PARAMS_ATOL, params
