"""Training-loop habits beyond the issue: GradScaler, accumulation, eval, module access,
kwargs, unused and frozen parameters, zero_grad and step variants, reading .grad, edits after wrapping."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from idioms.common import (adamw, data_parallel, difference, gpt2, gpt_ids, gpt_loss, gpt_reference, measured, mlp,
                            mlp_batch, rows, sgd, state_of, wrapped_training, zero, zero_train)


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
    wrapped, step, zero_grad, final = wrapped_training(model, wrapper)
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
