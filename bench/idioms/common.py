"""The models, data, references and helpers every probe of bench/torch_idioms.py shares:
Hugging Face GPT-2 from a config, a ResNet-like CNN, an MLP, one-process references."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


TOL = 1e-10  # float64, <= 3 steps: reordered sums differ by ~1e-15 relative per step
VOCAB, SEQ, BATCH = 64, 8, 4


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


def wrapped_training(model, wrapper: str):
    """``model`` wrapped as ``wrapper`` ("dataparallel", or a ZeRO stage "1"-"3") and its
    (wrapped, step, zero_grad, final state) for a training loop."""
    if wrapper == "dataparallel":
        wrapped = data_parallel(model)
        opt = adamw(wrapped.parameters())
        return wrapped, opt.step, opt.zero_grad, lambda: state_of(model)
    wrapped = zero(model, stage=int(wrapper))
    return wrapped, wrapped.step, wrapped.zero_grad, wrapped.full_state_dict


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
