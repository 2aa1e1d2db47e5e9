"""What a PyTorch practitioner tries first on plait's wrappers, measured (issue 33).

    python bench/torch_idioms.py [--only WORD,...] [--list] [--json FILE] [--timeout-s 90]
    PYTHONPATH=/path/to/old/src python bench/torch_idioms.py     # the same probes on another checkout

Each probe writes code the torch way (DDP, FSDP2, DeepSpeed, Hugging Face habits) against
plait's DataParallel, ZeRO (stages 1-3), PipelineEngine or tensor layers, on 2 gloo ranks
(``plait.testing.run_distributed``; ``run_fresh_world`` where a probe may leave the group
unusable), and judges the outcome from outside, against one process (or torch's own
implementation: DDP for BatchNorm), in float64 unless said otherwise:

- ``exact``: the wrapped run equals the reference within the float64 bound (1e-10
  absolute after a few steps: a reordered sum differs by ~1e-15 per step);
- ``refused by name``: a ValueError/TypeError/RuntimeError/NotImplementedError whose
  one-line message names the idiom or the fix (the words each probe lists);
- ``SILENTLY WRONG``: it ran and the result differs from the reference (the detail
  gives the largest difference);
- ``crashed unrelated``: another exception, or one that names neither (the detail
  quotes it), or a hang (the ranks' stacks are dropped; the detail says where).

Models: Hugging Face GPT-2 built from a config (2 layers, hidden 32, vocabulary 64,
dropout 0; never downloaded), a small ResNet-like CNN with BatchNorm built here
(torchvision is not installed), and a two-layer MLP. Probes are independent: ``--only``
runs those whose name contains one of the words.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

TOL = 1e-10  # float64, <= 3 steps: reordered sums differ by ~1e-15 relative per step
VOCAB, SEQ, BATCH = 64, 8, 4
USER_ERRORS = ("ValueError", "TypeError", "RuntimeError", "NotImplementedError")
# messages of torch internals reached by accident, never a refusal by name
UNRELATED = ("storage of size 0", "setStorage", "numpy() is not supported", "is not registered",
             "has no attribute", "object is not callable", "data is not allocated", "NoneType", "KeyError",
             "unexpected keyword argument")


# ----------------------------------------------------------------------------- models and data
def gpt2(seed: int = 0, **overrides) -> nn.Module:
    """Hugging Face GPT-2 from a config (tied wte/lm_head, as HF's default), float64."""
    import transformers  # a test dependency; imported where used so the script lists probes without it

    transformers.logging.set_verbosity_error()
    sizes = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config = transformers.GPT2Config(**{**sizes, **overrides})
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).double()


def gpt_ids(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def rows(rank: int, world_size: int, total: int = BATCH) -> slice:
    return slice(rank * total // world_size, (rank + 1) * total // world_size)


def gpt_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


class Block(nn.Module):
    """conv-BN-ReLU-conv-BN plus the identity, then ReLU (ResNet's basic block)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def cnn(seed: int = 0) -> nn.Module:
    """A ResNet-like CNN: stem conv-BN-ReLU, one basic block, global pool, linear (10 classes)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), Block(8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).double()


def images(step: int, total: int = 8):
    generator = torch.Generator().manual_seed(2000 + step)
    return (torch.randn(total, 3, 8, 8, generator=generator, dtype=torch.float64),
            torch.randint(0, 10, (total,), generator=generator))


def mlp(seed: int = 0, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def mlp_batch(step: int, total: int = 8, dtype=torch.float64):
    generator = torch.Generator().manual_seed(3000 + step)
    return torch.randn(total, 6, generator=generator, dtype=dtype), torch.randint(0, 3, (total,), generator=generator)


def adamw(params, lr: float = 1e-2):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def sgd(params, lr: float = 0.1):
    return torch.optim.SGD(params, lr=lr)


def state_of(module: nn.Module) -> dict:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def difference(got: dict, want: dict) -> float:
    """Largest absolute difference over the reference's keys (inf when a key is missing)."""
    worst = 0.0
    for name, value in want.items():
        if name not in got or tuple(got[name].shape) != tuple(value.shape):
            return float("inf")
        if value.is_floating_point():
            worst = max(worst, (got[name].double() - value.double()).abs().max().item() if value.numel() else 0.0)
    return worst


def measured(diff: float, detail: str = "", tol: float = TOL) -> dict:
    return {"diff": diff, "tol": tol, "detail": detail}


def zero(model, optimizer=adamw, **kwargs):
    from plait.parallel import ZeRO

    return ZeRO(model, optimizer, **kwargs)


def data_parallel(model, *args, **kwargs):
    from plait.parallel import DataParallel

    return DataParallel(model, *args, **kwargs)


def gpt_reference(steps: int, *, optimizer=adamw, clip: float | None = None, model=None, scheduler=None,
                  accumulate: int = 1) -> nn.Module:
    """One process on the whole batch."""
    model = model or gpt2()
    opt = optimizer(model.parameters())
    sched = scheduler(opt) if scheduler else None
    for step in range(steps):
        ids = gpt_ids(step)
        for part in range(accumulate):
            (gpt_loss(model, ids[rows(part, accumulate)]) / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return model


def zero_train(rank, world_size, wrapped, steps: int, *, clip=None, torch_clip: bool = False, accumulate: int = 1,
               no_sync: bool = True, scheduler=None, zero_grad=None, step=None) -> None:
    """Each rank trains on its rows of the batch: forward through ``wrapped``."""
    sched = scheduler(wrapped.optimizer) if scheduler else None
    for index in range(steps):
        ids = gpt_ids(index)[rows(rank, world_size)]
        for part in range(accumulate):
            last = part == accumulate - 1
            context = wrapped.no_sync() if (no_sync and not last) else torch.enable_grad()
            with context:
                (gpt_loss(wrapped, ids[rows(part, accumulate, len(ids))]) / accumulate).backward()
        if clip is not None:
            if torch_clip:
                torch.nn.utils.clip_grad_norm_(wrapped.parameters(), clip)
            else:
                wrapped.clip_grad_norm_(clip)
        (step or wrapped.step)()
        (zero_grad or wrapped.zero_grad)()
        if sched:
            sched.step()


# ----------------------------------------------------------------------------- the idioms
def p_clip_torch_zero(rank, world_size, stage):
    """torch.nn.utils.clip_grad_norm_(zero.parameters(), max_norm) then zero.step()."""
    wrapped = zero(gpt2(), stage=stage)
    zero_train(rank, world_size, wrapped, 3, clip=0.5, torch_clip=True)
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(3, clip=0.5))))


def p_clip_plait_zero(rank, world_size, stage):
    wrapped = zero(gpt2(), stage=stage)
    zero_train(rank, world_size, wrapped, 3, clip=0.5)
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(3, clip=0.5))))


def p_clip_torch_dp(rank, world_size):
    model = gpt2()
    wrapped = data_parallel(model)
    opt = adamw(wrapped.parameters())
    for step in range(3):
        gpt_loss(wrapped, gpt_ids(step)[rows(rank, world_size)]).backward()
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return measured(difference(state_of(model), state_of(gpt_reference(3, clip=0.5))))


def _hf_mlp_parallel(rank, sequence_parallel: bool):
    """HF GPT-2's MLP (c_fc, gelu, c_proj) as plait's ParallelMLP over tp = 2, and the same
    full weights in one process."""
    from plait.parallel.tensor import new_tensor_parallel
    from plait.parallel.tensor.layers import ParallelMLP
    from plait.parallel.tensor.sharding import gather_grads

    tp = new_tensor_parallel(2, sequence_parallel=sequence_parallel)
    layer = ParallelMLP(16, 32, tp, dtype=torch.float64, seed=3)
    full = ParallelMLP(16, 32, dtype=torch.float64, seed=3)  # UNSHARDED: the same parameters, whole
    return tp, layer, full, gather_grads


def p_clip_tp(rank, world_size, wrapper):
    """torch's clip_grad_norm_(wrapped.parameters()) on plait tensor-parallel layers (tp = 2, the
    MLP) inside ``wrapper`` over a dp group of one: the norm must sum the tp shards' squares."""
    from plait.parallel.tensor.sharding import gather_state_dict

    tp, layer, full, _ = _hf_mlp_parallel(rank, False)
    dp_group = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank creates every group
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    if wrapper == "zero":
        wrapped = zero(layer, lambda params: sgd(params), stage=2, group=dp_group)
        step = wrapped.step
    else:
        wrapped = data_parallel(layer, dp_group)
        step = sgd(wrapped.parameters()).step
    wrapped(x).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.1)
    step()
    full(x).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(full.parameters(), 0.1)
    sgd(full.parameters()).step()
    return measured(difference(gather_state_dict(layer, tp), state_of(full)))


def _mlp_forward(layer, x):
    return layer(x)  # the row bias added with its gradient summed over the group (forward's contract)


def p_sp_batch_first(rank, world_size, layout):
    """sequence_parallel=True fed HF's (b, s, h) activations replicated on every rank
    (layout "bsh_replicated"), or Megatron's (s/tp, b, h) shard (layout "sbh_sharded")."""
    tp, layer, full, gather_grads = _hf_mlp_parallel(rank, True)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, 16, generator=generator, dtype=torch.float64)  # (b, s, h)
    if layout == "bsh_replicated":
        mine = x
        reference_input = x
    else:
        sbh = x.transpose(0, 1).contiguous()  # (s, b, h)
        mine = sbh[rows(rank, world_size, sbh.shape[0])]
        reference_input = sbh
    out = _mlp_forward(layer, mine)
    out.pow(2).sum().backward()
    want_out = _mlp_forward(full, reference_input)
    want_out.pow(2).sum().backward()
    got = {name: grad for name, grad in gather_grads(layer, tp).items()}
    want = {name: param.grad for name, param in full.named_parameters()}
    if layout == "bsh_replicated":  # the loss is summed over the whole (replicated) output on each rank
        forward = (out - want_out).abs().max().item()
    else:
        forward = (out - want_out[rows(rank, world_size, want_out.shape[0])]).abs().max().item()
    ratio = max((got[n].norm() / want[n].norm()).item() for n in want)
    return measured(max(difference(got, want), forward), f"forward diff {forward:.1e}; largest grad ratio {ratio:.3f}")


def p_sp_entry_exit(rank, world_size, sequence_parallel):
    """HF's (b, s, h) replicated activations through SequenceParallelEntry(tp, seq_dim=1) ->
    ParallelMLP -> SequenceParallelExit(tp, seq_dim=1), against the same MLP in one process."""
    from plait.parallel.tensor import SequenceParallelEntry, SequenceParallelExit

    tp, layer, full, gather_grads = _hf_mlp_parallel(rank, sequence_parallel)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x_mine, x_full = x.clone().requires_grad_(), x.clone().requires_grad_()
    block = nn.Sequential(SequenceParallelEntry(tp, seq_dim=1), layer, SequenceParallelExit(tp, seq_dim=1))
    out = block(x_mine)
    out.pow(2).sum().backward()
    want = full(x_full.transpose(0, 1)).transpose(0, 1)
    want.pow(2).sum().backward()
    got = {**gather_grads(layer, tp), "input": x_mine.grad}
    reference = {**{name: param.grad for name, param in full.named_parameters()}, "input": x_full.grad}
    forward = (out - want).abs().max().item()
    return measured(max(forward, difference(got, reference)), f"forward diff {forward:.1e}")


def p_tp_no_sp_batch_first(rank, world_size):
    """Without sequence parallelism, (b, s, h) replicated is a valid input (the layers act on the last dim)."""
    tp, layer, full, gather_grads = _hf_mlp_parallel(rank, False)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    _mlp_forward(layer, x).pow(2).sum().backward()
    _mlp_forward(full, x).pow(2).sum().backward()
    got = gather_grads(layer, tp)
    return measured(difference(got, {name: param.grad for name, param in full.named_parameters()}))


class TiedNet(nn.Module):
    """GPT-2's shape in small: an embedding, two blocks, a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.block0 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.block1 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.double()

    def forward(self, ids):
        return self.head(self.block1(self.block0(self.embed(ids))))


def _vocab_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def p_pipeline_tied(rank, world_size, schedule_name, how):
    """Stage 0 = embed + block0, stage 1 = block1 + head (head.weight is embed.weight):
    the stage modules handed to PipelineEngine ``how``: "stages" (alone), "model" (model=),
    "tied" (tied= declares the shared weight)."""
    from plait.parallel.pipeline import PipelineEngine, build

    model = TiedNet()
    reference = copy.deepcopy(model)
    stages = {0: nn.Sequential(model.embed, model.block0), 1: nn.Sequential(model.block1, model.head)}
    schedule = build(schedule_name, ranks=2, microbatches=2)
    mine = {s: stages[s] for _, s in schedule.stages_of(rank)}
    kwargs = {"model": model} if how == "model" else {"tied": [[(0, "0.weight"), (1, "1.weight")]]} if how == "tied" \
        else {}
    engine = PipelineEngine(schedule, mine, _vocab_loss, **kwargs)
    opt = sgd(list(engine.parameters()))
    ref_opt = sgd(reference.parameters())
    for step in range(3):
        ids = gpt_ids(step)
        engine.train_step(ids, ids.roll(-1, 1), opt)
        _vocab_loss(reference(ids), ids.roll(-1, 1)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    held = {name: param for name, param in model.named_parameters(remove_duplicate=False)
            if any(param is p for p in engine.parameters())}
    want = dict(reference.named_parameters(remove_duplicate=False))
    return measured(difference({n: p.detach() for n, p in held.items()}, {n: want[n].detach() for n in held}))


def _dcp_save_load(rank, world_size, path, wrapper):
    import torch.distributed.checkpoint as dcp

    model = gpt2()
    wrapped = zero(model, stage=wrapper) if isinstance(wrapper, int) else data_parallel(model)
    if isinstance(wrapper, int):
        zero_train(rank, world_size, wrapped, 1)
        full = lambda w: w.full_state_dict()  # noqa: E731 - the comparison's view
    else:
        opt = adamw(wrapped.parameters())
        gpt_loss(wrapped, gpt_ids(0)[rows(rank, world_size)]).backward()
        opt.step()
        full = lambda w: state_of(w.module)  # noqa: E731
    saved = full(wrapped)
    dcp.save({"model": wrapped.state_dict()}, checkpoint_id=path)
    if rank == 0:  # for p_dcp_reshard: what was saved, whole
        torch.save(saved, os.path.join(path, "saved.pt"))
    other = gpt2(seed=5)
    fresh = zero(other, stage=wrapper) if isinstance(wrapper, int) else data_parallel(other)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    return measured(difference(full(fresh), saved), "dcp.save/load of wrapped.state_dict(), same world")


def p_dcp(rank, world_size, wrapper, path):
    return _dcp_save_load(rank, world_size, os.path.join(path, f"dcp-{wrapper}"), wrapper)


def p_state_dict_api(rank, world_size, stage, what):
    """torch.distributed.checkpoint.state_dict's get/set_model_state_dict and
    get_optimizer_state_dict on a ZeRO model, full_state_dict=True: model keys and values."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict)

    options = StateDictOptions(full_state_dict=True)
    wrapped = zero(gpt2(), stage=stage)
    zero_train(rank, world_size, wrapped, 1)
    reference = gpt_reference(1)
    want = state_of(reference)
    if what == "get_model":
        got = get_model_state_dict(wrapped, options=options)
        extra = sorted(set(got) - set(want))[:3]
        return measured(difference(got, want), f"{len(got)} keys, e.g. {sorted(got)[:2]}; extra {extra}")
    if what == "set_model":
        set_model_state_dict(wrapped, gpt_reference(2).state_dict(), options=options)
        return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(2))))
    reference = gpt2()  # the reference optimizer's state after one step
    ref_opt = adamw(reference.parameters())
    gpt_loss(reference, gpt_ids(0)).backward()
    ref_opt.step()
    want_state = get_optimizer_state_dict(reference, ref_opt, options=options)["state"]
    if what == "get_optimizer_given":  # the optimizer object the user built and handed to ZeRO
        model = gpt2()
        opt = adamw(model.parameters())
        wrapped = zero(model, opt, stage=stage)
        zero_train(rank, world_size, wrapped, 1)
        held = opt
    else:
        held = wrapped.param_optimizer if what == "get_optimizer_param" else wrapped.optimizer
    got_state = get_optimizer_state_dict(wrapped, held, options=options)["state"]
    flat_want = {f"{k}.{s}": v for k, d in want_state.items() for s, v in d.items() if torch.is_tensor(v)}
    flat_got = {f"{k}.{s}": v for k, d in got_state.items() for s, v in d.items() if torch.is_tensor(v)}
    return measured(difference(flat_got, flat_want), f"{len(got_state)} entries, e.g. {sorted(got_state)[:2]}")


def p_load_full_state_dict_strict(rank, world_size, strict):
    """A safetensors-style file without the tied lm_head.weight, loaded into a ZeRO-3 GPT-2."""
    wrapped = zero(gpt2(seed=5), stage=3)
    state = state_of(gpt2())
    del state["lm_head.weight"]
    result = wrapped.load_full_state_dict(state) if strict else wrapped.load_full_state_dict(state, strict=False)
    detail = f"returned {result!r:.80}"
    return measured(difference(wrapped.full_state_dict(), state_of(gpt2())), detail)


def p_stage3_outside(rank, world_size, what, context, path):
    """HF's generate / save_pretrained on zero.module at stage 3, with ``with zero.full_parameters():``
    (context) or bare."""
    wrapped = zero(gpt2(), stage=3)
    zero_train(rank, world_size, wrapped, 1)
    reference = gpt_reference(1)
    ids = gpt_ids(9)[:1, :4]

    def act():
        if what == "generate":
            return wrapped.module.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        import transformers

        directory = os.path.join(path, f"hf-{int(context)}")  # shared: HF writes on rank 0 only
        wrapped.module.save_pretrained(directory, safe_serialization=True)
        dist.barrier()
        return state_of(transformers.GPT2LMHeadModel.from_pretrained(directory))

    if context:
        with wrapped.full_parameters():
            got = act()
    else:
        got = act()
    if what == "generate":
        want = reference.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        return measured(float((got != want).sum()), f"tokens {got.tolist()} vs {want.tolist()}", tol=0)
    return measured(difference(got, state_of(reference)))


def _decay_groups(model, lr: float = 1e-2):
    """HF's grouping: no weight decay for biases and LayerNorm weights; the second group another lr."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2}]


def p_param_groups(rank, world_size, stage):
    """ZeRO given torch.optim.AdamW(HF-style parameter groups over the model's parameters)."""
    model = gpt2()
    wrapped = zero(model, torch.optim.AdamW(_decay_groups(model)), stage=stage)
    zero_train(rank, world_size, wrapped, 3)
    reference = gpt_reference(3, optimizer=lambda params: torch.optim.AdamW(_decay_groups(reference_model)),
                              model=(reference_model := gpt2()))
    return measured(difference(wrapped.full_state_dict(), state_of(reference)))


def p_groups_over_shards(rank, world_size):
    """A factory that builds two param groups over the shards it is given (meaningless: the
    shards mix parameters), compared with the HF grouping it stands in for."""
    wrapped = zero(gpt2(), lambda shards: torch.optim.AdamW([{"params": shards[:1], "weight_decay": 0.1},
                                                              {"params": shards[1:], "weight_decay": 0.0,
                                                               "lr": 5e-3}], lr=1e-2), stage=1)
    zero_train(rank, world_size, wrapped, 3)
    reference = gpt_reference(3, optimizer=lambda params: torch.optim.AdamW(_decay_groups(reference_model)),
                              model=(reference_model := gpt2()))
    return measured(difference(wrapped.full_state_dict(), state_of(reference)), "vs the HF grouping")


def p_optimizer_object(rank, world_size, stage):
    """DeepSpeed/FSDP2 style: the optimizer built over model.parameters() handed to ZeRO."""
    model = gpt2()
    wrapped = zero(model, adamw(model.parameters()), stage=stage)
    zero_train(rank, world_size, wrapped, 3)
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(3))))


def _halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def p_scheduler_on_user_optimizer(rank, world_size):
    """opt = AdamW(model.parameters()); sched = StepLR(opt); ZeRO(model, opt); sched.step() each step."""
    model = gpt2()
    opt = adamw(model.parameters())
    sched = _halving(opt)
    wrapped = zero(model, opt, stage=2)
    for step in range(3):
        gpt_loss(wrapped, gpt_ids(step)[rows(rank, world_size)]).backward()
        wrapped.step()
        wrapped.zero_grad()
        sched.step()
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(3, scheduler=_halving))))


def p_scheduler_on_zero_optimizer(rank, world_size):
    """StepLR(zero.optimizer, ...) stepped after zero.step()."""
    wrapped = zero(gpt2(), stage=2)
    zero_train(rank, world_size, wrapped, 3, scheduler=_halving)
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(3, scheduler=_halving))))


def p_bf16_master(rank, world_size):
    """A bf16 model under ZeRO stage 2, SGD lr 1e-3 for 20 steps: with fp32 master weights
    (FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16) the small updates accumulate; with a bf16
    master they round away. Measured: the share of parameter elements that moved."""
    model = mlp(dtype=torch.bfloat16)
    start = state_of(model)
    master = mlp(dtype=torch.float32)  # the reference: fp32 master, bf16 compute
    compute = mlp(dtype=torch.bfloat16)
    master_opt = sgd(master.parameters(), lr=1e-3)
    wrapped = zero(model, lambda params: sgd(params, lr=1e-3), stage=2)
    for step in range(20):
        x, y = mlp_batch(step, dtype=torch.bfloat16)
        F.cross_entropy(wrapped(x[rows(rank, world_size, 8)]).float(), y[rows(rank, world_size, 8)]).backward()
        wrapped.step()
        wrapped.zero_grad()
        F.cross_entropy(compute(x).float(), y).backward()
        for p, q in zip(master.parameters(), compute.parameters()):
            p.grad = q.grad.float()
            q.grad = None
        master_opt.step()
        master_opt.zero_grad()
        with torch.no_grad():
            for p, q in zip(master.parameters(), compute.parameters()):
                q.copy_(p)
    got = wrapped.full_state_dict()
    moved = sum(int((got[n] != start[n]).sum()) for n in start) / sum(v.numel() for v in start.values())
    want_state = state_of(compute)
    want_moved = sum(int((want_state[n] != start[n]).sum()) for n in start) / sum(v.numel() for v in start.values())
    torch_bf16 = mlp(dtype=torch.bfloat16)  # what torch does in one process with bf16 parameters
    torch_opt = sgd(torch_bf16.parameters(), lr=1e-3)
    for step in range(20):
        x, y = mlp_batch(step, dtype=torch.bfloat16)
        halves = []
        for r in range(world_size):
            mine = rows(r, world_size, 8)
            F.cross_entropy(torch_bf16(x[mine]).float(), y[mine]).backward()
            halves.append([q.grad.clone() for q in torch_bf16.parameters()])
            torch_bf16.zero_grad(set_to_none=True)
        for index, q in enumerate(torch_bf16.parameters()):
            q.grad = (halves[0][index] + halves[1][index]) / 2
        torch_opt.step()
        torch_opt.zero_grad()
    want_bf16 = state_of(torch_bf16)  # relative: the two averages may round a last bf16 bit apart
    relative = max(((got[n].double() - want_bf16[n].double()).abs() / want_bf16[n].double().abs().clamp_min(1e-30)
                    ).max().item() for n in want_bf16)
    return measured(relative, f"relative, vs torch on bf16 parameters (a bf16 master): elements moved ZeRO "
                              f"{moved:.1%}, an fp32 master would move {want_moved:.1%}: wrap float32 and pass "
                              "mp_policy=", tol=2.0 ** -7)


def p_mp_policy(rank, world_size, which):
    """ZeRO(float32 model, mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)),
    torch's FSDP2 class ("torch") or plait's ("plait"), SGD lr 1e-3 for 20 steps, against one
    process doing FSDP2's arithmetic by hand: each rank's half of the batch in bf16, the
    gradients cast to fp32 and averaged, an fp32 master stepped and cast to bf16. Tolerance
    1e-6: the same fp32 operations, up to the order of a two-term average."""
    if which == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy
    else:
        from plait.parallel.zero.mixed_precision import MixedPrecisionPolicy
    model = mlp(dtype=torch.float32)
    start = state_of(model)
    master, compute = mlp(dtype=torch.float32), mlp(dtype=torch.bfloat16)
    master_opt = sgd(master.parameters(), lr=1e-3)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    wrapped = zero(model, sgd(model.parameters(), lr=1e-3), stage=2, mp_policy=policy)
    for step in range(20):
        x, y = mlp_batch(step, dtype=torch.float32)
        F.cross_entropy(wrapped(x[rows(rank, world_size, 8)]).float(), y[rows(rank, world_size, 8)]).backward()
        wrapped.step()
        wrapped.zero_grad()
        halves = []
        for r in range(world_size):  # FSDP2's arithmetic: each rank's half in bf16, grads up-cast, averaged
            mine = rows(r, world_size, 8)
            F.cross_entropy(compute(x[mine].bfloat16()).float(), y[mine]).backward()
            halves.append([q.grad.float() for q in compute.parameters()])
            compute.zero_grad(set_to_none=True)
        for index, p in enumerate(master.parameters()):
            p.grad = sum(half[index] for half in halves) / world_size
        master_opt.step()
        master_opt.zero_grad()
        with torch.no_grad():
            for p, q in zip(master.parameters(), compute.parameters()):
                q.copy_(p)
    from torch.distributed.tensor import DTensor

    got = {n: (v.full_tensor() if isinstance(v, DTensor) else v) for n, v in wrapped.state_dict().items()}
    want = state_of(master)
    total = sum(v.numel() for v in start.values())
    moved = sum(int((got[n].float() != start[n]).sum()) for n in start) / total
    want_moved = sum(int((want[n] != start[n]).sum()) for n in start) / total
    diff = difference({n: v.float() for n, v in got.items()}, want)
    dtypes = sorted({str(v.dtype) for v in got.values()})
    return measured(diff, f"zero.state_dict() (master) elements moved: ZeRO {moved:.1%}, one process {want_moved:.1%}; dtypes "
                          f"{dtypes}; vs one process: per-rank bf16 halves, fp32 average, fp32 master", tol=1e-6)


def p_dp_state_dict_keys(rank, world_size):
    """DataParallel's state_dict() keys (DDP's are 'module.'-prefixed) and a DDP checkpoint loaded into it."""
    model = mlp()
    wrapped = data_parallel(model)
    keys = sorted(wrapped.state_dict())
    ddp_style = {f"module.{k}": v for k, v in state_of(mlp(seed=4)).items()}
    wrapped.load_state_dict(ddp_style)
    diff = difference(state_of(model), state_of(mlp(seed=4)))
    return measured(diff, f"keys {keys[:2]}; a DDP ('module.') checkpoint loaded")


def p_dcp_reshard(rank, world_size, path, stage):
    """The checkpoint dcp.{stage} wrote from 2 ranks, dcp.load-ed into a plain GPT-2's
    state_dict() in one process (another dp size)."""
    import torch.distributed.checkpoint as dcp

    directory = os.path.join(path, f"dcp-{stage}")
    if not os.path.exists(os.path.join(directory, "saved.pt")):
        return {"outcome": "not run", "detail": f"dcp.{stage} wrote no checkpoint"}
    model = gpt2(seed=5)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    return measured(difference(state_of(model), torch.load(os.path.join(directory, "saved.pt"))))


def p_autocast_zero(rank, world_size, stage):
    """float32 model, torch.autocast('cpu', bfloat16) around the forward: ZeRO vs torch DDP."""
    model, ddp_model = mlp(dtype=torch.float32), mlp(dtype=torch.float32)
    wrapped = zero(model, lambda params: sgd(params), stage=stage)
    ddp = nn.parallel.DistributedDataParallel(ddp_model)
    opt = sgd(ddp.parameters())
    for step in range(3):
        x, y = mlp_batch(step, dtype=torch.float32)
        x, y = x[rows(rank, world_size, 8)], y[rows(rank, world_size, 8)]
        for net, stepper in ((wrapped, None), (ddp, opt)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = net(x)
            F.cross_entropy(out.float(), y).backward()
            if stepper is None:
                wrapped.step()
                wrapped.zero_grad()
            else:
                opt.step()
                opt.zero_grad()
    return measured(difference(wrapped.full_state_dict(), state_of(ddp_model)), "vs torch DDP, float32",
                    tol=1e-6)


def _mesh(shape, names=None):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def p_device_mesh(rank, world_size, where):
    """A torch DeviceMesh passed as group=: 1-D to ZeRO / DataParallel / plait.comm.all_reduce,
    or a named dimension of a 2-D mesh to ZeRO."""
    if where == "all_reduce":
        from plait import comm

        tensor = torch.tensor([float(rank + 1)], dtype=torch.float64)
        comm.all_reduce(tensor, group=_mesh((2,)))
        return measured(abs(tensor.item() - 3.0))
    if where == "zero_2d":
        mesh = _mesh((2, 1), ("dp", "tp"))["dp"]
    else:
        mesh = _mesh((2,))
    if where == "dataparallel":
        model = gpt2()
        wrapped = data_parallel(model, mesh)
        opt = adamw(wrapped.parameters())
        for step in range(2):
            gpt_loss(wrapped, gpt_ids(step)[rows(rank, world_size)]).backward()
            opt.step()
            opt.zero_grad()
        return measured(difference(state_of(model), state_of(gpt_reference(2))))
    wrapped = zero(gpt2(), stage=2, group=mesh)
    zero_train(rank, world_size, wrapped, 2)
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(2))))


def p_dtensor(rank, world_size, wrapper, shape):
    """torch's own tensor parallelism (parallelize_module: ColwiseParallel/RowwiseParallel on the MLP)
    on a dp x tp mesh of ``shape``, then plait's ``wrapper`` over the dp dimension."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh(shape, ("dp", "tp"))
    model, reference = mlp(), mlp()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    dp_rank, dp_size = mesh["dp"].get_local_rank(), shape[0]
    if wrapper == "zero":
        wrapped = zero(model, lambda params: sgd(params), stage=2, group=mesh["dp"].get_group())
        step, zero_grad = wrapped.step, wrapped.zero_grad
    else:  # the dp dimension's process group (a DeviceMesh as group= is probe device_mesh.*)
        wrapped = data_parallel(model, mesh["dp"].get_group())
        opt = sgd(wrapped.parameters())
        step, zero_grad = opt.step, opt.zero_grad
    ref_opt = sgd(reference.parameters())
    for index in range(2):
        x, y = mlp_batch(index)
        F.cross_entropy(wrapped(x[rows(dp_rank, dp_size, 8)]), y[rows(dp_rank, dp_size, 8)]).backward()
        step()
        zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    return measured(difference(got, dict(reference.named_parameters())))


# ----------------------------------------------------------------------------- beyond the issue
def p_grad_scaler(rank, world_size, wrapper, inf_on_rank1):
    """torch.amp.GradScaler('cpu'): scaler.scale(loss).backward(); scaler.step(OPT); scaler.update(),
    OPT being what the user holds (DataParallel: the torch optimizer; ZeRO: ``zero`` itself or
    ``zero.optimizer``); with ``inf_on_rank1`` rank 1's loss is inf at step 1 (the step must be
    skipped on every rank, as one process skips it)."""
    model, reference = mlp(), mlp()
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), torch.amp.GradScaler("cpu",
                                                                                                init_scale=2.0 ** 8)
    if wrapper == "dataparallel":
        wrapped = data_parallel(model)
        opt = sgd(wrapped.parameters())
        stepper, zero_grad = opt, opt.zero_grad
    else:
        stage, held = wrapper.split(":")
        wrapped = zero(model, lambda params: sgd(params), stage=int(stage))
        stepper = wrapped if held == "zero" else wrapped.param_optimizer if held == "param" else wrapped.optimizer
        zero_grad = wrapped.zero_grad
    ref_opt = sgd(reference.parameters())
    for step in range(3):
        x, y = mlp_batch(step)
        blow = float("inf") if (inf_on_rank1 and step == 1) else 1.0
        mine = rows(rank, world_size, 8)
        loss = F.cross_entropy(wrapped(x[mine]), y[mine]) * (blow if rank == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(stepper)
        scaler.update()
        zero_grad()
        ref_loss = (F.cross_entropy(reference(x[:4]), y[:4]) + F.cross_entropy(reference(x[4:]), y[4:]) * blow) / 2
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
    got = wrapped.full_state_dict() if wrapper != "dataparallel" else state_of(model)
    return measured(difference(got, state_of(reference)), f"scale {scaler.get_scale()} (one process "
                                                           f"{ref_scaler.get_scale()})")


def p_accumulate(rank, world_size, wrapper, no_sync):
    """Gradient accumulation over 2 micro-batches: inside ``no_sync()`` or plain repeated backward."""
    if wrapper == "dataparallel":
        model = gpt2()
        wrapped = data_parallel(model)
        opt = adamw(wrapped.parameters())
        for step in range(2):
            ids = gpt_ids(step)[rows(rank, world_size)]
            with wrapped.no_sync() if no_sync else torch.enable_grad():
                (gpt_loss(wrapped, ids[:1]) / 2).backward()
            (gpt_loss(wrapped, ids[1:]) / 2).backward()
            opt.step()
            opt.zero_grad()
        return measured(difference(state_of(model), state_of(gpt_reference(2, accumulate=2))))
    wrapped = zero(gpt2(), stage=int(wrapper))
    zero_train(rank, world_size, wrapped, 2, accumulate=2, no_sync=no_sync)
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(2, accumulate=2))))


def p_eval_no_grad(rank, world_size, stage):
    """zero.eval(); with torch.no_grad(): logits = zero(ids).logits; zero.train(); then train a step."""
    model = gpt2(resid_pdrop=0.3)  # dropout on: eval() must reach the inner module
    wrapped = zero(model, stage=stage)
    reference = gpt2(resid_pdrop=0.3)
    wrapped.eval()
    reference.eval()
    with torch.no_grad():
        got, want = wrapped(gpt_ids(5)).logits, reference(gpt_ids(5)).logits
    forward = (got - want).abs().max().item()
    wrapped.train()
    reference.train()
    wrapped.eval()  # the steps below without dropout masks (they would differ in draws)
    reference.eval()
    zero_train(rank, world_size, wrapped, 1)
    gpt_reference(1, model=reference)
    return measured(max(forward, difference(wrapped.full_state_dict(), state_of(reference))),
                    f"eval logits diff {forward:.1e}")


def p_module_access(rank, world_size, stage):
    """After a step: zero.module.lm_head.weight read directly, and sum(p.numel() for p in zero.parameters())."""
    wrapped = zero(gpt2(), stage=stage)
    zero_train(rank, world_size, wrapped, 1)
    reference = gpt_reference(1)
    count = sum(p.numel() for p in wrapped.parameters())
    want_count = sum(p.numel() for p in reference.parameters())
    got = wrapped.module.lm_head.weight.detach().clone()
    diff = (got - reference.lm_head.weight).abs().max().item()
    return measured(diff if count == want_count else float("inf"), f"numel {count} (one process {want_count})")


def p_inner_module(rank, world_size, wrapper):
    """Forward through ``wrapped.module`` (the inner model), bypassing the wrapper, then the usual step."""
    model = gpt2()
    if wrapper == "dataparallel":
        wrapped = data_parallel(model)
        opt = adamw(wrapped.parameters())
        step, zero_grad = opt.step, opt.zero_grad
    else:
        wrapped = zero(model, stage=int(wrapper))
        step, zero_grad = wrapped.step, wrapped.zero_grad
    for index in range(2):
        gpt_loss(wrapped.module, gpt_ids(index)[rows(rank, world_size)]).backward()
        step()
        zero_grad()
    got = state_of(model) if wrapper == "dataparallel" else wrapped.full_state_dict()
    return measured(difference(got, state_of(gpt_reference(2))))


def p_hf_kwargs(rank, world_size, wrapper):
    """wrapped(input_ids=..., labels=...).loss: keyword arguments and HF's ModelOutput through the wrapper."""
    model = gpt2()
    if wrapper == "dataparallel":
        wrapped = data_parallel(model)
        opt = adamw(wrapped.parameters())
        for step in range(2):
            ids = gpt_ids(step)[rows(rank, world_size)]
            wrapped(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        return measured(difference(state_of(model), state_of(gpt_reference(2))))
    wrapped = zero(model, stage=int(wrapper))
    zero_train(rank, world_size, wrapped, 2)
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(2))))


class Branchy(nn.Module):
    """An MLP whose ``extra`` branch only rank 0 uses (as a routed expert or a conditional head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.double()

    def forward(self, x, use_extra: bool):
        h = self.body(x)
        return self.head(h + self.extra(h) if use_extra else h)


def p_unused_on_one_rank(rank, world_size, wrapper):
    """A branch rank 0 uses and rank 1 does not; DataParallel with find_unused_parameters False/True, ZeRO."""
    model, reference = Branchy(), Branchy()
    if wrapper.startswith("dataparallel"):
        wrapped = data_parallel(model, find_unused_parameters=wrapper.endswith("find"))
        opt = adamw(wrapped.parameters())
        step, zero_grad = opt.step, opt.zero_grad
    else:
        wrapped = zero(model, stage=int(wrapper))
        step, zero_grad = wrapped.step, wrapped.zero_grad
    ref_opt = adamw(reference.parameters())
    for index in range(2):
        x, y = mlp_batch(index)
        mine = rows(rank, world_size, 8)
        F.cross_entropy(wrapped(x[mine], use_extra=rank == 0), y[mine]).backward()
        step()
        zero_grad()
        ((F.cross_entropy(reference(x[:4], True), y[:4]) + F.cross_entropy(reference(x[4:], False), y[4:])) / 2
         ).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = state_of(model) if wrapper.startswith("dataparallel") else wrapped.full_state_dict()
    return measured(difference(got, state_of(reference)))


def _freeze(model):
    """LoRA-style: the embeddings and the first block frozen (requires_grad=False)."""
    for name, param in model.named_parameters():
        if name.startswith(("transformer.wte", "transformer.wpe", "transformer.h.0.")):
            param.requires_grad_(False)
    return model


def p_frozen(rank, world_size, wrapper):
    model = _freeze(gpt2())
    if wrapper == "dataparallel":
        wrapped = data_parallel(model)
        opt = adamw([p for p in wrapped.parameters() if p.requires_grad])
        for step in range(2):
            gpt_loss(wrapped, gpt_ids(step)[rows(rank, world_size)]).backward()
            opt.step()
            opt.zero_grad()
        got = state_of(model)
    else:
        wrapped = zero(model, stage=int(wrapper))
        zero_train(rank, world_size, wrapped, 2)
        got = wrapped.full_state_dict()
    reference = _freeze(gpt2())
    gpt_reference(2, model=reference, optimizer=lambda params: adamw([p for p in params if p.requires_grad]))
    return measured(difference(got, state_of(reference)))


def p_freeze_after_wrap(rank, world_size, stage):
    """requires_grad_(False) on the embeddings and block 0 after wrapping and a step (fine-tuning
    that freezes mid-run), then another step; one process: the frozen ones get no gradient and
    AdamW skips them."""
    model = gpt2()
    wrapped = zero(model, stage=stage)
    zero_train(rank, world_size, wrapped, 1)
    _freeze(model)
    zero_train(rank, world_size, wrapped, 1)
    reference = gpt2()
    opt = adamw(reference.parameters())
    for step in range(2):
        if step == 1:
            _freeze(reference)
        gpt_loss(reference, gpt_ids(step)).backward()
        opt.step()
        opt.zero_grad()
    return measured(difference(wrapped.full_state_dict(), state_of(reference)))


def p_optimizer_calls(rank, world_size, stage, how):
    """What a FSDP2/DDP user writes for the step and zero_grad: zero.zero_grad(set_to_none=False),
    zero.optimizer.zero_grad() or zero.optimizer.step() in place of zero's own."""
    wrapped = zero(gpt2(), stage=stage)
    if how == "set_to_none_false":
        zero_train(rank, world_size, wrapped, 3, zero_grad=lambda: wrapped.zero_grad(set_to_none=False))
    elif how == "optimizer.zero_grad":
        zero_train(rank, world_size, wrapped, 3, zero_grad=wrapped.optimizer.zero_grad)
    else:
        zero_train(rank, world_size, wrapped, 3, step=wrapped.optimizer.step)
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(3))))


def p_module_zero_grad(rank, world_size, stage):
    """model.zero_grad() (nn.Module's, on the inner model) in place of zero.zero_grad()."""
    model = gpt2()
    wrapped = zero(model, stage=stage)
    zero_train(rank, world_size, wrapped, 3, zero_grad=model.zero_grad)
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(3))))


def p_grad_read(rank, world_size, wrapper, rank0_only):
    """Reading gradients after backward for logging: {name: p.grad.clone()} on every rank, or
    (rank0_only) a per-parameter norm on rank 0 only (``if rank == 0: log(p.grad.norm())``)."""
    model, reference = gpt2(), gpt2()
    wrapped = data_parallel(model) if wrapper == "dataparallel" else zero(model, stage=int(wrapper))
    gpt_loss(wrapped, gpt_ids(0)[rows(rank, world_size)]).backward()
    gpt_loss(reference, gpt_ids(0)).backward()
    if rank0_only:
        norms = {n: float(p.grad.norm()) for n, p in model.named_parameters()} if rank == 0 else None
        want = {n: float(p.grad.norm()) for n, p in reference.named_parameters()}
        worst = max(abs(norms[n] - want[n]) for n in want) if rank == 0 else 0.0
        dist.barrier()
        return measured(worst, "norms logged on rank 0 only")
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    return measured(difference(got, {n: p.grad for n, p in reference.named_parameters()}))


def p_edit_after_wrap(rank, world_size, wrapper, how):
    """Weights changed in place after wrapping, before training: ``how`` "mul_" (torch.no_grad():
    model.lm_head.weight.mul_(0.5), a re-init) or "load_state_dict" (wrapped.module.load_state_dict(sd),
    loading pretrained weights into the inner model); then 2 steps."""
    model = gpt2()
    if wrapper == "dataparallel":
        wrapped = data_parallel(model)
        opt = adamw(wrapped.parameters())
        step, zero_grad, final = opt.step, opt.zero_grad, lambda: state_of(model)
    else:
        wrapped = zero(model, stage=int(wrapper))
        step, zero_grad, final = wrapped.step, wrapped.zero_grad, wrapped.full_state_dict
    reference = gpt2()
    pretrained = state_of(gpt2(seed=5))
    for net in (model, reference):
        if how == "mul_":
            with torch.no_grad():
                net.lm_head.weight.mul_(0.5)
        else:
            net.load_state_dict(pretrained)
    for index in range(2):
        gpt_loss(wrapped, gpt_ids(index)[rows(rank, world_size)]).backward()
        step()
        zero_grad()
    return measured(difference(final(), state_of(gpt_reference(2, model=reference))))


def p_meta_init(rank, world_size):
    """FSDP2's large-model init: build on the meta device, shard, then to_empty() and initialise."""
    with torch.device("meta"):
        model = gpt2()
    wrapped = zero(model, stage=3)
    wrapped.to_empty(device="cpu")
    return {"outcome": "ran", "detail": "accepted a meta-device model"}


def p_dp_zero_grad_not_none(rank, world_size):
    model = gpt2()
    wrapped = data_parallel(model)
    opt = adamw(wrapped.parameters())
    for step in range(3):
        gpt_loss(wrapped, gpt_ids(step)[rows(rank, world_size)]).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return measured(difference(state_of(model), state_of(gpt_reference(3))))


def p_torch_save_sharded(rank, world_size, path, phase):
    """torch.save({"model": zero.state_dict(), "optimizer": zero.optimizer.state_dict()}) per rank
    (the model and the optimizer, as torch users save them); load into a fresh wrapper (same world), or
    (phase "other_world") into a 1-rank ZeRO."""
    file = os.path.join(path, f"zero-rank{rank}.pt")
    if phase == "save_and_load":
        wrapped = zero(gpt2(), stage=2)
        zero_train(rank, world_size, wrapped, 1)
        torch.save({"model": wrapped.state_dict(), "optimizer": wrapped.optimizer.state_dict()}, file)
        fresh = zero(gpt2(seed=5), stage=2)
        saved = torch.load(file, weights_only=False)
        fresh.load_state_dict(saved["model"])
        fresh.optimizer.load_state_dict(saved["optimizer"])
        zero_train(rank, world_size, fresh, 1)
        zero_train(rank, world_size, wrapped, 1)
        return measured(difference(fresh.full_state_dict(), wrapped.full_state_dict()))
    fresh = zero(gpt2(seed=5), stage=2)
    fresh.load_state_dict(torch.load(os.path.join(path, "zero-rank0.pt"), weights_only=False)["model"])
    return {"outcome": "ran", "detail": "loaded 2-rank shards into 1 rank without error"}


def p_distributed_sampler(rank, world_size):
    """torch.utils.data.DistributedSampler + DataLoader feeding DataParallel (shuffle, seed, set_epoch)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    x, y = mlp_batch(0, total=16)
    dataset = TensorDataset(x, y)
    model, reference = mlp(), mlp()
    wrapped = data_parallel(model)
    opt, ref_opt = sgd(wrapped.parameters()), sgd(reference.parameters())
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    samplers = [DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=3) for r in range(2)]
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for s in samplers:
            s.set_epoch(epoch)
        every = [list(DataLoader(dataset, batch_size=4, sampler=s)) for s in samplers]
        for index, (xb, yb) in enumerate(DataLoader(dataset, batch_size=4, sampler=sampler)):
            F.cross_entropy(wrapped(xb), yb).backward()
            opt.step()
            opt.zero_grad()
            parts = [every[r][index] for r in range(2)]
            (sum(F.cross_entropy(reference(px), py) for px, py in parts) / 2).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    return measured(difference(state_of(model), state_of(reference)))


def p_compile(rank, world_size, wrapper):
    """torch.compile(wrapped, backend="aot_eager") (dynamo + AOT autograd; inductor needs a compiler)."""
    model = gpt2()
    if wrapper == "dataparallel":
        wrapped = data_parallel(model)
        opt = adamw(wrapped.parameters())
        step, zero_grad, final = opt.step, opt.zero_grad, lambda: state_of(model)
    else:
        wrapped = zero(model, stage=int(wrapper))
        step, zero_grad, final = wrapped.step, wrapped.zero_grad, wrapped.full_state_dict
    compiled = torch.compile(wrapped, backend="aot_eager")
    with warnings.catch_warnings():  # dynamo's notes on what it does not trace (graph breaks)
        warnings.simplefilter("ignore")
        for index in range(2):
            gpt_loss(compiled, gpt_ids(index)[rows(rank, world_size)]).backward()
            step()
            zero_grad()
    return measured(difference(final(), state_of(gpt_reference(2))))


def p_register_comm_hook(rank, world_size, where):
    """DDP's comm hook: DataParallel.register_comm_hook(state, hook), or plait's hook on torch DDP."""
    model = mlp()
    if where == "dataparallel":
        wrapped = data_parallel(model)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
        return {"outcome": "ran", "detail": "accepted"}
    from plait.comm import ddp_comm_hook

    reference = mlp()
    ddp, ref_ddp = nn.parallel.DistributedDataParallel(model), nn.parallel.DistributedDataParallel(reference)
    ddp.register_comm_hook(*ddp_comm_hook(algorithm="ring"))
    opt, ref_opt = sgd(ddp.parameters()), sgd(ref_ddp.parameters())
    for step in range(3):
        x, y = mlp_batch(step)
        mine = rows(rank, world_size, 8)
        for net, o in ((ddp, opt), (ref_ddp, ref_opt)):
            F.cross_entropy(net(x[mine]), y[mine]).backward()
            o.step()
            o.zero_grad()
    return measured(difference(state_of(model), state_of(reference)), "vs DDP's own all-reduce")


def p_to_dtype_after_wrap(rank, world_size, wrapper):
    """Wrap a float32 model, then wrapped.to(torch.float64), then train (compared with float64 throughout)."""
    model = gpt2().float()
    if wrapper == "dataparallel":
        wrapped = data_parallel(model)
        wrapped.to(torch.float64)
        opt = adamw(wrapped.parameters())
        for step in range(2):
            gpt_loss(wrapped, gpt_ids(step)[rows(rank, world_size)]).backward()
            opt.step()
            opt.zero_grad()
        got = state_of(model)
    else:
        wrapped = zero(model, stage=int(wrapper))
        wrapped.to(torch.float64)
        zero_train(rank, world_size, wrapped, 2)
        got = wrapped.full_state_dict()
    dtypes = sorted({str(v.dtype) for v in got.values() if v.is_floating_point()})
    return measured(difference(got, state_of(gpt_reference(2, model=gpt2().float().double()))), f"dtypes {dtypes}")


def p_batchnorm(rank, world_size, wrapper):
    """A ResNet-like CNN with BatchNorm (buffers broadcast from rank 0, as DDP's broadcast_buffers):
    plait's ``wrapper`` against torch DDP; "syncbn": SyncBatchNorm under DataParallel against one process."""
    model, reference = cnn(), cnn()
    if wrapper == "syncbn":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if wrapper in ("dataparallel", "syncbn"):
        wrapped = data_parallel(model)
        opt = sgd(wrapped.parameters())
        step, zero_grad, final = opt.step, opt.zero_grad, lambda: state_of(model)
    else:
        wrapped = zero(model, lambda params: sgd(params), stage=int(wrapper))
        step, zero_grad, final = wrapped.step, wrapped.zero_grad, wrapped.full_state_dict
    ddp = reference if wrapper == "syncbn" else nn.parallel.DistributedDataParallel(reference)
    ref_opt = sgd(ddp.parameters())
    for index in range(2):
        x, y = images(index)
        mine = rows(rank, world_size, 8)
        F.cross_entropy(wrapped(x[mine]), y[mine]).backward()
        step()
        zero_grad()
        if wrapper == "syncbn":
            F.cross_entropy(ddp(x), y).backward()
        else:
            F.cross_entropy(ddp(x[mine]), y[mine]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return measured(difference(final(), state_of(reference)),
                    "vs one process (full-batch BN)" if wrapper == "syncbn" else "vs torch DDP")


def p_two_forwards(rank, world_size, wrapper):
    """loss = f(x1) + f(x2) then one backward."""
    model = gpt2()
    if wrapper == "dataparallel":
        wrapped = data_parallel(model)
        opt = adamw(wrapped.parameters())
        step, zero_grad, final = opt.step, opt.zero_grad, lambda: state_of(model)
    else:
        wrapped = zero(model, stage=int(wrapper))
        step, zero_grad, final = wrapped.step, wrapped.zero_grad, wrapped.full_state_dict
    for index in range(2):
        ids = gpt_ids(index)[rows(rank, world_size)]
        ((gpt_loss(wrapped, ids[:1]) + gpt_loss(wrapped, ids[1:])) / 2).backward()
        step()
        zero_grad()
    return measured(difference(final(), state_of(gpt_reference(2, accumulate=2))))


def p_rewrap(rank, world_size, first, second):
    """Train a step wrapped as ``first``, ``del`` it, wrap the same model as ``second``, train a step (SGD)."""
    model = gpt2()
    wrapped = zero(model, lambda params: sgd(params), stage=int(first))
    zero_train(rank, world_size, wrapped, 1)
    del wrapped
    if second == "dataparallel":
        again = data_parallel(model)
        opt = sgd(again.parameters())
        gpt_loss(again, gpt_ids(1)[rows(rank, world_size)]).backward()
        opt.step()
        got = state_of(model)
    else:
        again = zero(model, lambda params: sgd(params), stage=int(second))
        ids = gpt_ids(1)[rows(rank, world_size)]
        gpt_loss(again, ids).backward()
        again.step()
        got = again.full_state_dict()
    return measured(difference(got, state_of(gpt_reference(2, optimizer=sgd))))


def p_tied_stage3(rank, world_size, checkpointing):
    """HF GPT-2 (wte tied to lm_head, across two stage-3 units) at stage 3, optionally with HF's
    gradient_checkpointing_enable()."""
    model, reference = gpt2(), gpt2()
    if checkpointing:
        for net in (model, reference):
            with warnings.catch_warnings():  # transformers 5 renames it activation_checkpointing_enable
                warnings.simplefilter("ignore", FutureWarning)
                net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapped = zero(model, stage=3)
    zero_train(rank, world_size, wrapped, 3)
    return measured(difference(wrapped.full_state_dict(), state_of(gpt_reference(3, model=reference))))


def p_ddp_arguments(rank, world_size, how):
    """DDP's constructor habits: device_ids=[rank] as a keyword, or [rank] positionally (DDP's
    second argument is device_ids; DataParallel's is group)."""
    model = mlp()
    if how == "keyword":
        data_parallel(model, device_ids=[rank])
    else:
        data_parallel(model, [rank])
    return {"outcome": "ran", "detail": "accepted"}


def p_stage3_module_state_dict(rank, world_size):
    """zero.module.state_dict() at stage 3, saved with torch.save and loaded back (HF's save path)."""
    import io

    wrapped = zero(gpt2(), stage=3)
    zero_train(rank, world_size, wrapped, 1)
    buffer = io.BytesIO()
    torch.save(wrapped.module.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    return measured(difference(loaded, state_of(gpt_reference(1))))


# ----------------------------------------------------------------------------- the table of probes
@dataclass
class Probe:
    name: str
    idiom: str
    fn: object
    kwargs: dict = field(default_factory=dict)
    words: tuple = ()  # a refusal "by name" mentions one of these (the idiom, or the fix)
    fresh: bool = False  # run in a fresh world (it may leave the group unusable)
    world_size: int = 2


def probes(path: str) -> list[Probe]:
    P = Probe
    out = []
    for stage in (1, 2, 3):
        out.append(P(f"clip.torch.zero{stage}", f"torch clip_grad_norm_(zero.parameters()) ZeRO-{stage}",
                     p_clip_torch_zero, {"stage": stage}, ("clip_grad_norm_",)))
    out += [
        P("clip.plait.zero3", "zero.clip_grad_norm_(max_norm) ZeRO-3", p_clip_plait_zero, {"stage": 3}),
        P("clip.torch.dp", "torch clip_grad_norm_(dp.parameters()) DataParallel", p_clip_torch_dp),
        P("clip.torch.zero2.tp2", "torch clip_grad_norm_ ZeRO-2 over plait tp=2 layers", p_clip_tp,
          {"wrapper": "zero"}, ("clip_grad_norm_",)),
        P("clip.torch.dp.tp2", "torch clip_grad_norm_ DataParallel over plait tp=2 layers", p_clip_tp,
          {"wrapper": "dataparallel"}, ("clip_grad_norm_",)),
        P("sp.bsh_replicated", "sequence_parallel=True, HF (b,s,h) input replicated", p_sp_batch_first,
          {"layout": "bsh_replicated"}, ("sequence", "layout", "shape")),
        P("sp.sbh_sharded", "sequence_parallel=True, (s/tp,b,h) shard (Megatron layout)", p_sp_batch_first,
          {"layout": "sbh_sharded"}),
        P("tp.bsh_no_sp", "tensor parallel without SP, (b,s,h) input", p_tp_no_sp_batch_first),
        P("sp.entry_exit", "SequenceParallelEntry/Exit(seq_dim=1) around SP layers", p_sp_entry_exit,
          {"sequence_parallel": True}),
        P("tp.entry_exit_no_sp", "SequenceParallelEntry/Exit(seq_dim=1), no SP", p_sp_entry_exit,
          {"sequence_parallel": False}),
    ]
    for schedule in ("1f1b", "zero_bubble"):
        for how in ("stages", "model", "tied"):
            out.append(P(f"pipeline.tied.{schedule}.{how}", f"pipeline, weight tied across ranks, {schedule}, "
                         f"{'stage modules only' if how == 'stages' else how + '='}", p_pipeline_tied,
                         {"schedule_name": schedule, "how": how}, ("tied", "shared", "model=")))
    for wrapper in (1, 3, "dataparallel"):
        label = f"ZeRO-{wrapper}" if wrapper != "dataparallel" else "DataParallel"
        out.append(P(f"dcp.{wrapper if wrapper != 'dataparallel' else 'dp'}",
                     f"dcp.save/load(wrapped.state_dict()) {label}", p_dcp, {"wrapper": wrapper, "path": path},
                     ("checkpoint", "state_dict"), fresh=True))
    out += [P(f"dcp.reshard.zero{stage}_to_1", f"...the ZeRO-{stage} checkpoint dcp.load-ed by 1 plain process",
              p_dcp_reshard, {"path": path, "stage": stage}, ("checkpoint",), world_size=1) for stage in (1, 3)]
    out.append(P("dp.state_dict_keys", "dp.state_dict() keys; DDP 'module.' checkpoint loaded", p_dp_state_dict_keys,
                 {}, ("module.",)))
    for stage in (1, 3):
        for what in ("get_model", "set_model", "get_optimizer", "get_optimizer_given", "get_optimizer_param"):
            out.append(P(f"state_dict_api.{what}.zero{stage}", f"{what}_state_dict(zero, full_state_dict=True) "
                         f"ZeRO-{stage}", p_state_dict_api, {"stage": stage, "what": what}, ("state_dict",)))
    out += [
        P("load_full.strict", "zero.load_full_state_dict(sd without tied lm_head)", p_load_full_state_dict_strict,
          {"strict": True}, ("missing", "lm_head")),
        P("load_full.strict_false", "zero.load_full_state_dict(..., strict=False)", p_load_full_state_dict_strict,
          {"strict": False}, ("strict",)),
    ]
    for what in ("generate", "save_pretrained"):
        out.append(P(f"stage3.{what}.bare", f"zero.module.{what}(...) at ZeRO-3", p_stage3_outside,
                     {"what": what, "context": False, "path": path}, ("full_parameters", "stage 3", "gather")))
        out.append(P(f"stage3.{what}.full_parameters", f"with zero.full_parameters(): {what} at ZeRO-3",
                     p_stage3_outside, {"what": what, "context": True, "path": path}, ("full_parameters",)))
    out.append(P("stage3.module_state_dict", "torch.save(zero.module.state_dict()) at ZeRO-3",
                 p_stage3_module_state_dict, {}, ("full_state_dict", "full_parameters", "stage 3")))
    for stage in (1, 2, 3):
        out.append(P(f"param_groups.zero{stage}", f"AdamW(HF no-decay groups) object to ZeRO-{stage}",
                     p_param_groups, {"stage": stage}, ("group", "optimizer")))
    out += [
        P("param_groups.over_shards", "factory building 2 groups over the shards", p_groups_over_shards, {},
          ("group",)),
        P("optimizer_object.zero2", "ZeRO(model, AdamW(model.parameters()))", p_optimizer_object, {"stage": 2},
          ("optimizer",)),
        P("scheduler.user_optimizer", "StepLR on the optimizer object given to ZeRO", p_scheduler_on_user_optimizer,
          {}, ("optimizer", "scheduler")),
        P("scheduler.zero_optimizer", "StepLR(zero.optimizer)", p_scheduler_on_zero_optimizer),
        P("precision.bf16_model", "bf16 model under ZeRO-2, no policy (as torch: bf16 master)", p_bf16_master, {},
          ("master", "precision", "bfloat16")),
        P("precision.mp_policy.torch", "mp_policy=torch FSDP2 MixedPrecisionPolicy(bf16, fp32 reduce)",
          p_mp_policy, {"which": "torch"}, ("mp_policy", "MixedPrecisionPolicy")),
        P("precision.mp_policy.plait", "mp_policy=plait MixedPrecisionPolicy(bf16, fp32 reduce)", p_mp_policy,
          {"which": "plait"}, ("mp_policy", "MixedPrecisionPolicy")),
        P("precision.autocast.zero3", "torch.autocast(bf16) forward, ZeRO-3 vs DDP", p_autocast_zero, {"stage": 3}),
    ]
    for where in ("all_reduce", "zero", "dataparallel", "zero_2d"):
        out.append(P(f"device_mesh.{where}", f"DeviceMesh as group= ({where})", p_device_mesh, {"where": where},
                     ("DeviceMesh", "mesh")))
    for wrapper in ("zero", "dataparallel"):
        for shape in ((2, 1), (1, 2)):
            out.append(P(f"dtensor.{wrapper}.dp{shape[0]}tp{shape[1]}",
                         f"DTensor params (parallelize_module) under {wrapper}, dp{shape[0]}xtp{shape[1]}",
                         p_dtensor, {"wrapper": wrapper, "shape": shape}, ("DTensor",)))
    # beyond the issue
    for wrapper, inf in (("dataparallel", False), ("dataparallel", True), ("2:zero", False), ("2:optimizer", False),
                         ("1:optimizer", True), ("2:optimizer", True), ("2:param", True)):
        label = wrapper if wrapper == "dataparallel" else f"ZeRO-{wrapper[0]}, scaler.step(zero" + \
            {"zero": "", "optimizer": ".optimizer", "param": ".param_optimizer"}[wrapper.split(":")[1]] + ")"
        out.append(P(f"grad_scaler.{wrapper.replace(':', '.')}{'.inf_rank1' if inf else ''}",
                     f"GradScaler {label}{', inf on rank 1' if inf else ''}", p_grad_scaler,
                     {"wrapper": wrapper, "inf_on_rank1": inf}, ("GradScaler", "scaler", "optimizer.step", "sharded")))
    for wrapper in ("dataparallel", "1", "2", "3"):
        for no_sync in (True, False):
            label = "DataParallel" if wrapper == "dataparallel" else f"ZeRO-{wrapper}"
            out.append(P(f"accumulate.{'no_sync' if no_sync else 'plain'}.{wrapper}",
                         f"accumulation, {'no_sync()' if no_sync else 'repeated backward'}, {label}", p_accumulate,
                         {"wrapper": wrapper, "no_sync": no_sync}))
    out += [P(f"eval_no_grad.zero{s}", f"zero.eval() + no_grad forward, then train, ZeRO-{s}", p_eval_no_grad,
              {"stage": s}) for s in (1, 3)]
    out += [P(f"module_access.zero{s}", f"zero.module.lm_head.weight / numel after a step, ZeRO-{s}",
              p_module_access, {"stage": s}, ("stage 3", "full_parameters", "freed")) for s in (1, 3)]
    out += [P(f"inner_module.{w}", f"forward through wrapped.module (bypass), {w}", p_inner_module, {"wrapper": w},
              ("wrapper", "module")) for w in ("dataparallel", "2", "3")]
    out += [P(f"hf_kwargs.{w}", f"wrapped(input_ids=, labels=).loss, {w}", p_hf_kwargs, {"wrapper": w})
            for w in ("dataparallel", "3")]
    out += [P(f"unused_one_rank.{w}", f"param unused on rank 1, {w}", p_unused_on_one_rank, {"wrapper": w},
              ("unused",)) for w in ("dataparallel", "dataparallel.find", "2", "3")]
    out += [P(f"frozen.{w}", f"frozen params (requires_grad=False), {w}", p_frozen, {"wrapper": w})
            for w in ("dataparallel", "1", "3")]
    out += [P(f"freeze_after_wrap.zero{s}", f"requires_grad_(False) after wrapping, ZeRO-{s}", p_freeze_after_wrap,
              {"stage": s}, ("wrap", "requires_grad")) for s in (1, 3)]
    out.append(P("zero_grad_not_none.dp", "optimizer.zero_grad(set_to_none=False), DataParallel",
                 p_dp_zero_grad_not_none))
    for stage in (1, 3):
        out.append(P(f"zero_grad_not_none.zero{stage}", f"zero.zero_grad(set_to_none=False), ZeRO-{stage}",
                     p_optimizer_calls, {"stage": stage, "how": "set_to_none_false"}))
    out += [P(f"edit_after_wrap.{how}.{w}", f"{'weight.mul_(0.5)' if how == 'mul_' else 'module.load_state_dict(sd)'}"
              f" after wrapping, {w}", p_edit_after_wrap, {"wrapper": w, "how": how},
              ("full_parameters", "stage 3", "load_full_state_dict"))
            for how in ("mul_", "load_state_dict") for w in ("dataparallel", "1", "2", "3")]
    out.append(P("meta_init.zero3", "meta-device model, ZeRO-3, to_empty()", p_meta_init, {}, ("meta device", "to_empty")))
    out += [P(f"module_zero_grad.zero{s}", f"model.zero_grad() not zero.zero_grad(), ZeRO-{s}", p_module_zero_grad,
              {"stage": s}, ("zero_grad",)) for s in (1, 2, 3)]
    out += [P(f"grad_read.{w}{'.rank0_norm' if r0 else ''}",
              f"{'p.grad.norm() on rank 0 only' if r0 else '{n: p.grad.clone()}'} after backward, {w}", p_grad_read,
              {"wrapper": w, "rank0_only": r0}, ("grad", "sharded", "collective"))
            for w, r0 in (("dataparallel", False), ("1", False), ("2", False), ("3", False), ("2", True))]
    for stage in (1, 2, 3):
        out.append(P(f"optimizer_zero_grad.zero{stage}", f"zero.optimizer.zero_grad() not zero.zero_grad(), "
                     f"ZeRO-{stage}", p_optimizer_calls, {"stage": stage, "how": "optimizer.zero_grad"},
                     ("zero_grad",)))
        out.append(P(f"optimizer_step.zero{stage}", f"zero.optimizer.step() not zero.step(), ZeRO-{stage}",
                     p_optimizer_calls, {"stage": stage, "how": "optimizer.step"}, ("zero.step", "step()")))
    out += [
        P("torch_save.sharded", "torch.save(zero + optimizer state_dict) + load, same world, ZeRO-2", p_torch_save_sharded,
          {"path": path, "phase": "save_and_load"}),
        P("torch_save.other_world", "...those shards loaded into 1 rank", p_torch_save_sharded,
          {"path": path, "phase": "other_world"}, ("world_size", "rank", "full state dict", "layout"),
          world_size=1),
        P("distributed_sampler.dp", "DistributedSampler + DataLoader, DataParallel", p_distributed_sampler),
    ]
    out += [P(f"compile.{w}", f"torch.compile(wrapped, aot_eager), {w}", p_compile, {"wrapper": w},
              ("compile",)) for w in ("dataparallel", "2", "3")]
    out += [
        P("comm_hook.dataparallel", "dp.register_comm_hook(state, hook)", p_register_comm_hook,
          {"where": "dataparallel"}, ("register_comm_hook", "comm hook", "compression")),
        P("comm_hook.ddp_plait", "torch DDP + plait.comm.ddp_comm_hook", p_register_comm_hook, {"where": "ddp"}),
    ]
    out += [P(f"to_dtype_after_wrap.{w}", f"wrapped.to(float64) after wrapping, {w}", p_to_dtype_after_wrap,
              {"wrapper": w}, ("dtype", "wrap")) for w in ("dataparallel", "2", "3")]
    out += [P(f"batchnorm.{w}", f"CNN with BatchNorm, {w}" + (" (vs DDP)" if w != "syncbn" else ""), p_batchnorm,
              {"wrapper": w}, ("SyncBatchNorm", "BatchNorm")) for w in ("dataparallel", "3", "syncbn")]
    out += [P(f"two_forwards.{w}", f"two forwards then one backward, {w}", p_two_forwards, {"wrapper": w})
            for w in ("dataparallel", "2", "3")]
    out += [P(f"rewrap.zero{a}.{b}", f"del ZeRO-{a}, re-wrap as {b}", p_rewrap, {"first": a, "second": b})
            for a, b in (("3", "3"), ("3", "dataparallel"), ("1", "2"))]
    out += [P("tied.zero3", "HF GPT-2 tied wte/lm_head at ZeRO-3", p_tied_stage3, {"checkpointing": False}),
            P("tied.zero3.checkpointing", "... with gradient_checkpointing_enable()", p_tied_stage3,
              {"checkpointing": True}, ("checkpoint", "recompute")),
            P("ddp_args.device_ids", "DataParallel(model, device_ids=[rank])", p_ddp_arguments, {"how": "keyword"},
              ("device_ids",)),
            P("ddp_args.positional", "DataParallel(model, [rank]) (DDP's device_ids)", p_ddp_arguments,
              {"how": "positional"}, ("group",))]
    return out


# ----------------------------------------------------------------------------- running and judging
def run_probe(rank, world_size, name, path):
    """On each rank: the probe's function (its own reference computed in-process)."""
    probe = next(p for p in probes(path) if p.name == name)
    return probe.fn(rank, world_size, **probe.kwargs)


def _last_error_line(failures: dict) -> tuple[str, str]:
    """(exception type, message) of the first failed rank, from its remote traceback."""
    kind, text = next(iter(failures.values()))
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(kind) or line.split(":")[0].endswith(kind):
            return kind, line.split(":", 1)[1].strip() if ":" in line else line
    return kind, lines[-1] if lines else ""


def _may_have_broken_the_group(error, world_size: int) -> bool:
    """A failure on some ranks only, or in a collective, can leave the pooled world's
    communicator unusable (a mismatched call poisons it)."""
    from plait.testing import RankError

    if not isinstance(error, RankError):
        return True
    return len(error.failures) < world_size or any(
        kind in ("MismatchError", "CommError", "CommTimeout", "DistributedTimeout")
        for kind, _ in error.failures.values())


def judge(probe: Probe, results=None, error=None) -> tuple[str, str]:
    from plait.testing import DistributedTimeout, RankError, WorkerCrashed

    if error is not None:
        if isinstance(error, RankError):
            kind, message = _last_error_line(error.failures)
            ranks = sorted(error.failures)
            where = f"rank {ranks[0]}" if len(ranks) == 1 else "every rank"
            named = kind in USER_ERRORS and not any(marker in message for marker in UNRELATED) and (
                not probe.words or any(word.lower() in message.lower() for word in probe.words))
            outcome = "refused by name" if named else "crashed unrelated"
            return outcome, f"{kind} on {where}: {message[:220]}"
        if isinstance(error, DistributedTimeout):
            return "crashed unrelated", f"HANG: ranks {error.pending_ranks} still running at the deadline"
        if isinstance(error, WorkerCrashed):
            return "crashed unrelated", f"a rank process died ({error})"[:200]
        return "crashed unrelated", f"{type(error).__name__}: {error}"[:200]
    first = results[0]
    if "outcome" in first:
        return first["outcome"], first["detail"]
    diff = max(result["diff"] for result in results)
    detail = f"max |diff| {diff:.1e} (tol {first['tol']:.0e}){'; ' + first['detail'] if first['detail'] else ''}"
    return ("exact" if diff <= first["tol"] else "SILENTLY WRONG"), detail


def main(argv=None) -> int:
    from plait.testing import run_distributed, run_fresh_world, shutdown_pools

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated words: run the probes whose name holds one")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--timeout-s", type=float, default=90.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="torch-idioms-") as path:
        chosen = probes(path)
        if args.only:
            words = [word for word in args.only.split(",") if word]
            chosen = [p for p in chosen if any(word in p.name for word in words)]
        if args.list:
            for probe in chosen:
                print(f"{probe.name:40s} {probe.idiom}")
            return 0
        import plait

        print(f"# torch idioms on plait from {Path(plait.__file__).parent}, torch {torch.__version__}, "
              f"{len(chosen)} probes, 2 gloo ranks unless said")
        print(f"{'probe':38s} | {'idiom':62s} | {'outcome':17s} | detail")
        rows_out = []
        started = time.monotonic()
        for probe in chosen:
            runner = run_fresh_world if probe.fresh else run_distributed
            began = time.monotonic()
            try:
                results = runner(run_probe, probe.world_size, probe.name, path, timeout_s=args.timeout_s)
                outcome, detail = judge(probe, results=results)
            except Exception as error:  # noqa: BLE001 - every failure is an outcome to report
                outcome, detail = judge(probe, error=error)
                if _may_have_broken_the_group(error, probe.world_size):
                    shutdown_pools()  # the next probe starts on a new world, not a poisoned one
            seconds = time.monotonic() - began
            print(f"{probe.name:38s} | {probe.idiom[:62]:62s} | {outcome:17s} | {detail} [{seconds:.1f} s]",
                  flush=True)
            rows_out.append({"probe": probe.name, "idiom": probe.idiom, "outcome": outcome, "detail": detail,
                             "seconds": round(seconds, 1)})
        shutdown_pools()
        counts = {}
        for row in rows_out:
            counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
        print(f"# {len(rows_out)} probes in {time.monotonic() - started:.0f} s: "
              + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        if args.json:
            Path(args.json).write_text(json.dumps(rows_out, indent=2))
    return 0


if __name__ == "__main__":
    # the ranks unpickle run_probe by its module name: import this file as ``torch_idioms``
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch_idioms

    raise SystemExit(torch_idioms.main())
