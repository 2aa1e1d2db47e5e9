"""How long the intra-operator ILP (plait.plan.auto.ilp.solve) takes on 48-layer models,
on a 1-D and a 2-D mesh of the dgx-a100 preset's 8 GPUs, unlimited and with memory
limits of 1/2 and 1/4 of the unlimited plan's memory.

    .venv/bin/python bench/auto_ilp_scale.py [LAYERS]        (default 48; ~2 minutes on 2 cores)

Two graphs:
- gpt2: HF GPT-2 (n_embd 32, 4 heads, vocab 128, batch 8 x 32 tokens, float32, its
  cross-entropy loss inside), traced by plait.parallel.auto.trace and simplified, with
  plait.plan.auto.strategies' strategies;
- synthetic: a transformer-like chain of 16 operators per layer (two residual adds per
  layer) whose 6-10 strategies per operator have random layouts and costs (seeded; the
  same per operator family in every layer, as a real model's are), none pass-through,
  so nothing is eliminated before HiGHS.
Prints per case: variables, constraints, operators eliminated, HiGHS's solve time, the
whole call's time (model building included), the gap and status, the step time found.
"""

from __future__ import annotations

import random
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.opgraph import OpGraph, OpNode, ParamMeta
from plait.parallel.auto.trace import simplify, trace_graph
from plait.plan import cluster_preset
from plait.plan.auto import ilp
from plait.plan.auto.strategies import graph_strategies
from plait.plan.auto.strategy import Strategy

FAMILIES = ("ln1", "qkv", "view1", "perm1", "score", "soft", "ctx", "perm2", "view2", "proj", "add1", "ln2", "fc",
            "gelu", "fc2", "add2")
WEIGHTED = ("qkv", "proj", "fc", "fc2", "ln1", "ln2")


class _Gpt2Loss(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=128, n_positions=64,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def forward(self, ids, labels):
        logits = self.model(input_ids=ids, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt2_graph(layers: int) -> OpGraph:
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, 32))
    return simplify(trace_graph(_Gpt2Loss(layers), (ids, ids)).graph)


def synthetic(layers: int, mesh: AutoMesh, seed: int = 0, shape=(8, 1024, 1024)):
    """(graph, strategies) of the synthetic chain described above (float16 activations)."""
    rng = random.Random(seed)
    rep = ("R",) * mesh.ndim

    def layout(partial: bool) -> tuple[str, ...]:
        return tuple(rng.choice(["R", "S0", "S1", "S2"] + (["P"] if partial else [])) for _ in range(mesh.ndim))

    def node(name, inputs, params=()):
        return OpNode(name=name, kind="elementwise", target="synthetic", inputs=tuple(inputs), params=tuple(params),
                      shape=shape, dtype="float16", itemsize=2)

    nodes, params, previous = [node("x", ())], [], "x"
    for layer in range(layers):
        names = {family: f"l{layer}.{family}" for family in FAMILIES}
        for j, family in enumerate(FAMILIES):
            inputs = {"add1": (previous, names["proj"]), "add2": (names["add1"], names["fc2"])}.get(
                family, (names[FAMILIES[j - 1]] if j else previous,))
            weights = (f"{names[family]}.w",) if family in WEIGHTED else ()
            params += [ParamMeta(w, shape[-1:] * 2, "float16", 2) for w in weights]
            nodes.append(node(names[family], inputs, weights))
        previous = names["add2"]
    nodes.append(OpNode(name="out", kind="output", target="output", inputs=(previous,), params=(), shape=shape,
                        dtype="float16", itemsize=2))
    families: dict[str, list] = {}
    strategies = {}
    for op in nodes:
        family = op.name.split(".")[-1]
        if family not in families:
            outs, ins = [layout(True) for _ in range(6)], [[layout(False) for _ in range(6)] for _ in op.inputs]
            families[family] = [("replicated", rep, (rep,) * len(op.inputs), (rep,) * len(op.params),
                                 rng.uniform(2e-3, 4e-3), 0.0, rng.uniform(20, 40) * 2 ** 20)] + [
                (f"s{k}", rng.choice(outs), tuple(rng.choice(choices) for choices in ins),
                 tuple(rng.choice([rep, ("S0",) + rep[1:], rep[:-1] + ("S1",)]) for _ in op.params),
                 rng.uniform(2e-4, 1e-3), rng.uniform(0, 3e-4), rng.uniform(3, 15) * 2 ** 20)
                for k in range(rng.randint(5, 9))]
        strategies[op.name] = [Strategy(name, out, ins, tuple(zip(op.params, ps)), compute_s, comm_s, memory)
                               for name, out, ins, ps, compute_s, comm_s, memory in families[family]]
    return OpGraph(nodes=tuple(nodes), params=tuple(params), inputs=("x",), output="out"), strategies


def report(label: str, graph, strategies, mesh, cluster) -> None:
    unlimited = None
    for fraction in (None, 0.5, 0.25):
        limit = None if fraction is None else fraction * unlimited.memory_bytes
        started = time.perf_counter()
        try:
            result = ilp.solve(graph, strategies, mesh, cluster, memory_limit_bytes=limit)
        except ValueError as error:  # no plan fits that limit: say so, go on
            print(f"{label:9s} {mesh.text():4s} limit {fraction}: {error}", flush=True)
            continue
        total_s = time.perf_counter() - started
        unlimited = unlimited or result
        print(f"{label:9s} {mesh.text():4s} {len(graph.nodes):5d} ops {sum(map(len, strategies.values())):6d} strat "
              f"limit {'none' if fraction is None else fraction:>4}: {result.variables:7d} vars "
              f"{result.constraints:6d} rows {result.eliminated:4d} elim  HiGHS {result.solve_s:6.2f} s  "
              f"call {total_s:6.2f} s  gap {result.gap:.1e} {result.status:10s} step {result.objective_s * 1e3:8.3f} ms",
              flush=True)


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 48
    cluster = cluster_preset("dgx-a100", gpus=8)
    started = time.perf_counter()
    graph = gpt2_graph(layers)
    print(f"tiny GPT-2, {layers} layers: traced and simplified to {len(graph.nodes)} operators in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    for shape in ((8,), (2, 4)):
        mesh = AutoMesh(shape)
        report("gpt2", graph, graph_strategies(graph, mesh, cluster), mesh, cluster)
        report("synthetic", *synthetic(layers, mesh), mesh, cluster)


if __name__ == "__main__":
    main()
