"""Wrapping and tooling habits beyond the issue: torch.save, DistributedSampler, torch.compile,
comm hooks, casts after wrapping, BatchNorm, re-wrapping, tied weights at stage 3, DDP arguments."""

from __future__ import annotations

import io
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from idioms.common import (adamw, cnn, data_parallel, difference, gpt2, gpt_ids, gpt_loss, gpt_reference, images,
                            measured, mlp, mlp_batch, rows, sgd, state_of, wrapped_training, zero, zero_train)


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
    wrapped, step, zero_grad, final = wrapped_training(model, wrapper)
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
    wrapped, step, zero_grad, final = wrapped_training(model, wrapper)
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
