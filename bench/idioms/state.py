"""The issue's state and setup probes: DCP, torch's state-dict APIs, load_full_state_dict,
stage 3 outside the wrapper, param groups, optimizer objects, precision, DeviceMesh, DTensor."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from idioms.common import (adamw, data_parallel, difference, gpt2, gpt_ids, gpt_loss, gpt_reference, measured, mlp,
                            mlp_batch, rows, sgd, state_of, zero, zero_train)


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
    return measured(diff, f"zero.state_dict() (master) elements moved: ZeRO {moved:.1%}, one process "
                          f"{want_moved:.1%}; dtypes "
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
