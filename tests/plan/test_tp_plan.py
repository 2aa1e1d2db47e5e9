"""plait plan prices tensor parallelism of a user's model from the plan parallelize
applies (plait.plan.tp_trace, plait.plan.tp_plan).

Single process: HF GPT-2 under plan_for(model), as plait plan --model hf: traces it
(from its config under FakeTensorMode, at b = 1 and 2): per rank the parameters are
the replicated ones plus the sharded ones / tp, counted here from the model's own
modules; the matmul FLOPs of the unsharded model equal torch's FlopCounterMode's, and
every one of them is in a sharded module or between a colwise and a rowwise one (the
attention core on local heads), so tp halves them; a plan naming no module, a
non-style and tp not dividing the heads are refused by name.

Two ranks (gloo, float32, one forward and backward of b=4, s=8 after a first one that
checks the layouts; dp: ZeRO stage 1, b=4 per rank): HF GPT-2 at tp=2 with and
without sequence parallelism and with it under bf16-mixed (torch.autocast over float32
weights, as plait train runs it; the plan traced under autocast too), the Llama-style
model at tp=2, GPT-2 at dp=2: the
planner's memory per rank against a measured run, and its collectives against
plait.comm's counts at the transport.
- Memory: parameters, gradients and AdamW's two moments are counted from the live
  storages on each rank (params, .grad and optimizer.state after a step, each storage
  once); activations as the peak of plait.memory's SavedTensorMeter (live saved
  storages, released as autograd frees them). The issue asks for 10%; the plan is
  traced under FakeTensorMode with the CPU's kernels, at b = 1 and 2 (what does not
  grow with b, such as the rotary tables and positions, stays put), so what remains is
  what the plan leaves out: AdamW's step counter, one 4-byte scalar per parameter
  tensor (0.1% of the optimizer state here), and the few 0-d tensors the loss saves
  (48 bytes, 0.03% of the activations). MEMORY_RTOL = 1% bounds both with room, where
  10% would let a wrong split of a whole tensor class pass (the attention's saved q,
  k, v are about a tenth of a block's activations).
- Bytes: for p = 2 every plait algorithm sends n bytes per all-reduce of n bytes and
  n/2 per all-gather or reduce-scatter (ring: 2(p-1)/p·n and (p-1)/p·n; recursive
  doubling lg p·n), so the calls and the bytes each rank sent per collective equal the
  plan's exactly: tp=2 all-reduces (2 forward + 2 backward per block, the embedding's
  forward, the head input's backward) and the head's all-gather of the logits; under
  sequence parallelism all-gathers and reduce-scatters, plus the all-reduce of each
  sequence-parallel parameter's gradient.
"""

import contextlib
import functools
import sys
from pathlib import Path

import pytest
import torch

from plait.plan import PlanRequest, cluster_preset, search
from plait.plan.precision import precision_for
from plait.plan.tp_plan import PlannedModel, plan_model, step_collectives
from plait.plan.tp_trace import trace_plan
from plait.plan.trace import flop_formulas
from plait.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for hf_models
from hf_models import tiny_gpt2, tiny_llama  # noqa: E402

BATCH, SEQUENCE, VOCAB = 4, 8, 64
MEMORY_RTOL = 0.01  # the module docstring: why 1% (the issue asks 10%)
PARTS = ("parameters", "gradients", "optimizer", "activations")


def _meta(build, **config):
    """The model ``build`` makes, on the meta device (no memory), float32."""
    with torch.device("meta"):
        return build(vocab_size=VOCAB, **config).float()


@functools.cache
def _planned(build, plans, autocast: str | None = None) -> PlannedModel:
    """``build``'s model under its plan, as plait plan --model hf: prices it: built from its
    config under FakeTensorMode (no memory, the CPU's kernels), traced at b = 1 and 2
    (under torch.autocast to ``autocast``'s dtype for a mixed precision)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    config = build(vocab_size=VOCAB).config
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config)
        ids = torch.zeros(1, SEQUENCE, dtype=torch.long)
        return plan_model(model, {"input_ids": ids, "labels": ids, "use_cache": True}, plans(model),
                          autocast=autocast)


def test_plan_shards_parameters_and_flops_as_the_model_counts_them():
    from torch.utils.flop_counter import FlopCounterMode

    from plait.parallel.tensor import plan_for

    model = tiny_gpt2(vocab_size=VOCAB).float()
    planned = _planned(tiny_gpt2, plan_for)
    precision = precision_for("fp32", "plait")
    # what each rank holds, from the modules: c_attn/c_fc weight+bias, c_proj weights and wte split
    sharded = sum(p.numel() for name, p in model.named_parameters()
                  if name.endswith(("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias", "c_proj.weight",
                                    "wte.weight")))
    whole = sum(p.numel() for p in model.parameters())
    for tp in (1, 2, 4):
        params = sum(unit.cost.params for group in planned.groups(1, tp, False, precision, "plait") for unit in group)
        assert params == whole - sharded + sharded / tp
    ids = torch.zeros(1, SEQUENCE, dtype=torch.long)
    # torch's counter, given the CPU flash-attention kernels it lacks (torch's own sdpa formulas; plait.plan.trace)
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad()
    assert planned.training_flops(1, "none") == counter.get_total_flops()
    flops = [sum(unit.cost.forward_flops + unit.cost.backward_flops
                 for group in planned.groups(1, tp, False, precision, "plait") for unit in group) for tp in (1, 2)]
    assert flops[1] == flops[0] / 2  # every matmul runs on local heads / columns / rows
    assert planned.tensor_parallel_problem(8) == \
        "tp=8 does not divide config.num_attention_heads=4 (valid tp: 1, 2, 4)"


def _replicate_only(model):
    return {"transformer.wpe": "replicate"}


def test_plan_errors_name_the_entry():
    model = _meta(tiny_gpt2)
    with pytest.raises(ValueError, match=r"plan entry 'transformer\.h\.\*\.mlp\.fc' matches no module"):
        trace_plan(model, torch.zeros(1, 4, dtype=torch.long, device="meta"), {"transformer.h.*.mlp.fc": "colwise"})
    with pytest.raises(TypeError, match="plan style 'column' is not one of colwise"):
        trace_plan(model, torch.zeros(1, 4, dtype=torch.long, device="meta"), {"lm_head": "column"})
    with pytest.raises(ValueError, match="plan gives colwise to 'transformer.h.0.ln_1', a LayerNorm"):
        trace_plan(model, torch.zeros(1, 4, dtype=torch.long, device="meta"), {"transformer.h.0.ln_1": "colwise"})
    nothing = _planned(tiny_gpt2, _replicate_only)
    assert nothing.tensor_parallel_problem(2) == "tp=2: the plan shards no module (no colwise, rowwise or vocab " \
                                                 "entry); use tp=1"


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def _measure(rank, world_size, cases):
    """Each case once on this rank: memory from live storages and bytes at the transport."""
    import torch.distributed as dist

    from plait import comm
    from plait.memory.saved_memory import SavedTensorMeter
    from plait.parallel.tensor import gpt2_plan, parallelize
    from plait.parallel.tensor.llama import llama_plan
    from plait.parallel.zero.module import ZeRO

    torch.set_num_threads(1)
    results = {}
    for case in cases:
        build, plans = {"gpt2": (tiny_gpt2, gpt2_plan), "llama": (tiny_llama, llama_plan)}[case["model"]]
        model = build(vocab_size=VOCAB).float()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(7))
        if case["tp"] > 1:
            parallelize(model, dist.group.WORLD, plans(model, sequence_parallel=case["sp"]))
            optimizer, run = torch.optim.AdamW(model.parameters(), lr=1e-3), model
        else:  # dp over the world, ZeRO stage 1: each rank keeps half of AdamW's state
            run = ZeRO(model, lambda params: torch.optim.AdamW(params, lr=1e-3), stage=1)
            optimizer = run.optimizer
            tokens = tokens.chunk(world_size)[rank].repeat(world_size, 1)  # this rank's micro-batch of BATCH
        # plait train's --precision bf16-mixed: autocast over float32 weights
        mixed = torch.autocast("cpu", dtype=torch.bfloat16) if case.get("bf16") else contextlib.nullcontext()
        # a first forward and backward checks the layouts once (small all-gathers): measure the next
        with mixed:
            loss = run(input_ids=tokens, labels=tokens).loss
        loss.backward()
        model.zero_grad(set_to_none=True) if case["tp"] > 1 else run.zero_grad()
        meter = SavedTensorMeter()
        meter.reset(exclude=[*model.parameters(), *model.buffers()])
        comm.reset_stats()
        with meter.hooks(), mixed:
            loss = run(input_ids=tokens, labels=tokens).loss
        loss.backward()
        sent = {name: (entry["calls"], entry["bytes_sent"]) for name, entry in comm.stats().items()}
        # ZeRO keeps the gradients in its buffers (p.grad is a view it makes on demand)
        grads = _storage_bytes([p.grad if case["tp"] > 1 else run.grads.local_grad(p) for p in model.parameters()])
        (run if case["tp"] == 1 else optimizer).step()
        state = [value for per_param in optimizer.state.values() for value in per_param.values()
                 if isinstance(value, torch.Tensor)]
        results[case["name"]] = {"parameters": _storage_bytes(list(model.parameters())), "gradients": grads,
                                 "optimizer": _storage_bytes(state), "activations": meter.peak_bytes, "sent": sent}
    return results


CASES = [dict(name="gpt2 tp2", model="gpt2", tp=2, sp=False), dict(name="gpt2 tp2 sp", model="gpt2", tp=2, sp=True),
         dict(name="gpt2 tp2 sp bf16", model="gpt2", tp=2, sp=True, bf16=True),
         dict(name="llama tp2", model="llama", tp=2, sp=False), dict(name="llama tp2 sp", model="llama", tp=2, sp=True),
         dict(name="gpt2 dp2 zero1", model="gpt2", tp=1, sp=False)]


def _prediction(case):
    from plait.parallel.tensor import gpt2_plan
    from plait.parallel.tensor.llama import llama_plan

    build, plans = {"gpt2": (tiny_gpt2, gpt2_plan), "llama": (tiny_llama, llama_plan)}[case["model"]]
    planned = _planned(build, plans, "bfloat16" if case.get("bf16") else None)
    precision = "bf16-mixed" if case.get("bf16") else "fp32"
    dp = 2 // case["tp"]
    request = PlanRequest(global_batch=BATCH * dp, tp=case["tp"], pp=1, dp=dp, micro_batch=BATCH, recompute="none",
                          zero_stage=1 if dp > 1 else 0, sequence_parallel=case["sp"], precision=precision,
                          accounting="plait", top=1)
    best = search(planned, cluster_preset("dgx-a100", gpus=2), request).best
    return best, step_collectives(planned, best.layout, precision_for(precision, "plait"))


@pytest.mark.slow
def test_planned_memory_and_bytes_match_a_measured_tp_and_dp_run():
    measured = run_distributed(_measure, 2, CASES)
    for case in CASES:
        best, collectives = _prediction(case)
        for rank, results in enumerate(measured):
            got = results[case["name"]]
            for part in PARTS:
                assert best.memory_bytes[part] == pytest.approx(got[part], rel=MEMORY_RTOL), (case["name"], part)
            if case["tp"] == 1:
                continue
            # p = 2: n bytes sent per all-reduce of n, n/2 per all-gather or reduce-scatter
            share = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}
            want = {name: (calls, nbytes * share[name]) for name, (calls, nbytes) in collectives.items()}
            assert got["sent"] == want, (case["name"], rank)
