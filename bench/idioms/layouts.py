"""The issue's layout probes: torch's clipping on ZeRO (and over plait tensor layers),
sequence-parallel layouts and their entry/exit, pipeline weights tied across ranks."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from idioms.common import (VOCAB, adamw, data_parallel, difference, gpt2, gpt_ids, gpt_loss, gpt_reference, measured,
                            rows, sgd, state_of, zero, zero_train)


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
