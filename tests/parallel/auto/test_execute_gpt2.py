"""HF GPT-2 (tests/hf_models.py tiny_gpt2: 2 layers, hidden 32, 4 heads, vocabulary 64)
executed under auto-parallel plans on 2 gloo ranks against one process (float64):

- Megatron: the vocabulary-sharded embedding (P, all-reduced before the residual), per
  block c_attn column-parallel (its output gathered for the q/k/v slices, which a
  contiguous shard of 3h cannot feed: see hooks35), attention by heads, c_proj
  row-parallel (bias added once), c_fc column-parallel with its merged GELU, c_proj
  row-parallel; the tied head column-parallel over the vocabulary reading the
  embedding's shard, its logits gathered for the loss; and the same with the q/k/v
  slices keeping c_attn's shard (the planner's "fused" option: c_attn's weight stored
  blocked, Megatron's fused qkv, no gather);
- pure batch: every activation sharded on the batch, the attention mask sliced, the
  parameters replicated with data parallelism's all-reduce, all their gradients in ONE
  bucket (one all-reduce per step, besides the loss's two scalars);
- pure batch accumulating two batches' gradients (two backward passes) before each
  optimizer step, with 4 KiB buckets (several, launched while backward goes on): the
  tied embedding / head table (read by two nodes) and every other parameter exact.

The graph is the simplified one the planner sees. Tolerances as test_execute's: 1e-12
for the loss and every local gradient, 1e-12 for parameters after two SGD steps.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plait.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for hf_models
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_models import tiny_gpt2  # noqa: E402
from test_execute import COUNTS, LOSS_GRAD_ATOL, PARAMS_SGD_ATOL, parity  # noqa: E402

BATCH, SEQUENCE, VOCAB = 2, 8, 64


class GPT2Step(torch.nn.Module):
    """The training step: next-token cross-entropy of HF GPT-2 (no KV cache)."""

    def __init__(self):
        super().__init__()
        self.m = tiny_gpt2(vocab_size=VOCAB)

    def forward(self, ids):
        logits = self.m(ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _ids(step: int):
    return (torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(70 + step)),)


def _plan(graph, mode: str) -> dict:
    """Layouts for every node of the simplified graph: "batch", "megatron" (c_attn's
    output gathered for the q/k/v slices) or "megatron_fused" (the slices keep the shard:
    a blocked c_attn, Megatron's fused qkv) on a 1-D mesh."""
    from plait.parallel.auto.execute import NodeLayout

    out, wanted, params = {}, {}, {}

    def producer_out(name):
        return out[name]

    for node in graph.nodes:
        if node.kind == "output":
            continue
        inputs = [producer_out(p) for p in node.inputs]
        node_params = {name: "R" for name in node.params}
        if mode == "batch":
            if node.kind == "constant" or not node.shape or node.shape[0] not in (BATCH, BATCH * (SEQUENCE - 1)):
                output = "P" if node.kind == "loss" else "R"
            else:
                output = "S0"
            if node.kind == "attention":
                inputs[3] = "S0"  # the mask (batch, 1, s, s) sliced with the batch
        else:
            output = "R"
            inputs = ["R" for _ in node.inputs]
            weight = node.attr("weight") or ""
            if node.kind == "embedding" and "wte" in weight:
                node_params[weight], output = "S0", "P"
            elif node.kind == "linear" and ("c_attn" in weight or "c_fc" in weight):
                node_params[weight], node_params[node.attr("bias")], output = "S1", "S0", "S2"
            elif node.kind == "linear" and "c_proj" in weight:
                inputs, node_params[weight], output = ["S2"], "S0", "P"
            elif node.kind == "linear":  # the tied head, over the vocabulary
                node_params[weight], output = "S0", "S2"
            elif node.kind == "attention":
                inputs, output = ["S1", "S1", "S1", "R"], "S1"
            elif node.kind in ("view", "permute") and node.inputs and out[node.inputs[0]] in ("S1", "S2"):
                source = graph.node(node.inputs[0])
                if len(node.shape) == 2:  # the logits (b, s-1, V) -> (b(s-1), V): the vocabulary shard moves
                    inputs, output = ["S2"], "S1"
                elif source.kind == "linear" and "c_attn" in (source.attr("weight") or ""):
                    if mode == "megatron_fused":  # each of q/k/v keeps its 1/p of the heads: blocked
                        inputs, output = ["S2"], "S2"
                    # else: gathered (R)
                elif source.kind == "linear":  # the head's logits sliced along the sequence
                    inputs, output = ["S2"], "S2"
                else:  # the heads dim through reshape and transpose (views here keep its position)
                    inputs = [out[node.inputs[0]]]
                    dim = int(inputs[0][1:])
                    output = f"S{node.attr('perm').index(dim)}" if node.kind == "permute" else inputs[0]
        out[node.name] = output
        wanted[node.name] = inputs
        params[node.name] = node_params
    return {name: NodeLayout(tuple((p,) for p in wanted[name]), (out[name],),
                             tuple((n, (p,)) for n, p in params[name].items())) for name in out}


def _gpt2_worker(rank: int, world_size: int, modes) -> dict:
    from plait.parallel.auto.trace import simplify, trace_graph

    graph = simplify(trace_graph(GPT2Step(), _ids(0)).graph)
    plans = {mode: _plan(graph, mode.removesuffix("_accumulate")) for mode in modes}
    return parity(GPT2Step, _ids, plans, (world_size,), simplified=True, accumulate=("batch_accumulate",),
                  options={"batch_accumulate": {"bucket_cap_mb": 4 / 1024}})


@pytest.mark.slow
def test_gpt2_megatron_and_batch_plans_equal_one_process():
    results = run_distributed(_gpt2_worker, 2, ("megatron", "megatron_fused", "batch", "batch_accumulate"),
                              timeout_s=300)
    for rank, plans in enumerate(results):
        for plan, errors in plans.items():
            for key, value in errors.items():
                limit = PARAMS_SGD_ATOL if key.endswith("params") else LOSS_GRAD_ATOL
                assert key in COUNTS or value <= limit, f"rank {rank} {plan}: {key} = {value:.3e}"
        # all-reduces per backward pass: each bucket once, the loss's target count, the loss, and the
        # position embeddings' gradient (wpe's lookup is replicated; its R output is wrapped in the batch-split add)
        batch, accumulated = plans["batch"], plans["batch_accumulate"]
        assert (batch["buckets"], batch["all_reduce_calls"]) == (1, 4), batch
        assert accumulated["buckets"] > 2 and accumulated["all_reduce_calls"] == 2 * (accumulated["buckets"] + 3)


def test_mixed_fused_slices_are_refused_by_name():
    """A blocked c_attn shard whose q/k/v slices do not all keep it (one fused, the others
    gathered) is refused naming the slice and the way out."""
    from plait.parallel.auto.device_mesh import AutoMesh
    from plait.parallel.auto.execute import AutoParallelModule, NodeLayout
    from plait.parallel.auto.trace import simplify, trace_graph

    traced = trace_graph(GPT2Step(), _ids(0))
    graph = simplify(traced.graph)
    layouts = _plan(graph, "megatron")
    first_slice = next(node for node in graph.nodes if node.kind == "view" and node.attr("op") == "slice"
                       and "c_attn" in (graph.node(node.inputs[0]).attr("weight") or ""))
    layouts[first_slice.name] = NodeLayout((("S2",),), ("S2",), ())
    with pytest.raises(ValueError, match=f"fused slice '{first_slice.name}' .* every consumer of .* gather it"):
        AutoParallelModule(traced, layouts, AutoMesh((2,)), graph=graph)
