"""ZeRO with the optimizer as torch users write it: an optimizer object built over the
model's parameters with Hugging Face-style param groups (weight decay 0.1 on the
weights, 0.0 on biases and LayerNorm weights, another lr for that group) and an lr
scheduler built over it before wrapping, on HF GPT-2 (tied wte/lm_head) at stages 1-3
on 3 ranks, against one process training the whole batch; no flat unit mixes groups (at
stage 3 a module with parameters in both groups gives two units); bad optimizers are
refused by name.

Tolerance: float64, 3 steps of AdamW, as tests/parallel/zero/test_zero.py: the ranks'
per-rank mean gradients, averaged, equal the whole batch's to ~1e-14 relative (the same
terms summed in another order, B = 6 sequences of 8 tokens, ε = 2⁻⁵²), so the parameters
agree to 1e-12 absolute (rtol 1e-10 for the larger ones). The groups matter: the same
training with one group moves the no-decay parameters by far more (checked)."""

import pytest
import torch
from torch import nn

from plait.parallel.zero.module import ZeRO
from plait.testing import run_distributed
from tests.hf_models import tiny_gpt2

BATCH, SEQ, VOCAB, STEPS = 6, 8, 64, 3


def _gpt2():
    return tiny_gpt2(0, VOCAB)


def _hf_groups(model: nn.Module, grouped: bool = True) -> list[dict]:
    """As Hugging Face's Trainer groups them: no weight decay on biases and LayerNorm
    weights (and here a higher lr for those)."""
    norms = {id(param) for module in model.modules() if isinstance(module, nn.LayerNorm)
             for param in module.parameters()}
    decay = [param for name, param in model.named_parameters() if id(param) not in norms and "bias" not in name]
    rest = [param for name, param in model.named_parameters() if id(param) in norms or "bias" in name]
    if not grouped:
        return [{"params": decay + rest, "weight_decay": 0.1}]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-2}]


def _optimizer_and_scheduler(model, grouped=True):
    optimizer = torch.optim.AdamW(_hf_groups(model, grouped), lr=1e-2, weight_decay=0.5)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _loss(model, tokens):
    """The next-token loss in float64 (Hugging Face's ``labels=`` loss casts the logits to
    float32 first, which would cap the comparison at float32's precision)."""
    logits = model(tokens).logits[:, :-1]
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _data(step: int):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))
    return tokens


def _reference(grouped=True) -> dict[str, torch.Tensor]:
    model = _gpt2()
    optimizer, scheduler = _optimizer_and_scheduler(model, grouped)
    for step in range(STEPS):
        tokens = _data(step)
        _loss(model, tokens).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _train(rank, world_size):
    """Stages 1-3 with the grouped optimizer object (tiny buckets at stages 1-2, so each
    group has several), the scheduler built before wrapping, the loop written as for
    DDP (the user's optimizer's zero_grad); then the refusals."""
    results = {}
    for stage in (1, 2, 3):
        model = _gpt2()
        optimizer, scheduler = _optimizer_and_scheduler(model)
        zero = ZeRO(model, optimizer, stage=stage, bucket_mb=0.01)
        assert zero.optimizer is optimizer
        groups_of = {id(param): index for index, group in enumerate(_hf_groups(model))  # the same Parameters
                     for param in group["params"]}
        mixed = [unit.index for unit in zero.units if len({groups_of[id(param)] for param in unit.params}) > 1]
        per_module: dict[int, set] = {}
        for unit, group in zip(zero.units, zero._unit_groups):
            per_module.setdefault(id(zero._unit_modules[unit.index]), set()).add(group)
        per_rank = BATCH // world_size
        for step in range(STEPS):
            tokens = _data(step)[rank * per_rank:(rank + 1) * per_rank]
            _loss(zero, tokens).backward()
            zero.step()
            scheduler.step()
            optimizer.zero_grad()  # the user's optimizer, as with DDP (steps the shards now)
        results[stage] = {"state": zero.full_state_dict(), "mixed_units": mixed,
                          "module_in_two_groups": any(len(groups) == 2 for groups in per_module.values()),
                          "lrs": [group["lr"] for group in optimizer.param_groups]}
    results["errors"] = _refusals()
    return results


def _refusals() -> list[str]:
    errors = []
    model = _gpt2()
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _loss(model, _data(0)).backward()
    stepped.step()
    model.zero_grad()
    frozen = _gpt2()
    partial = torch.optim.AdamW([param for name, param in frozen.named_parameters() if "ln_f" not in name])
    for call in (lambda: ZeRO(_gpt2(), torch.optim.AdamW(nn.Linear(3, 3).parameters())),
                 lambda: ZeRO(_gpt2(), lambda shards: torch.optim.AdamW(
                     [{"params": shards[:1]}, {"params": shards[1:], "weight_decay": 0.0}])),
                 lambda: ZeRO(model, stepped),
                 lambda: ZeRO(frozen, partial),
                 lambda: ZeRO(_gpt2(), "adamw")):
        try:
            call()
            errors.append("accepted")
        except (ValueError, TypeError) as error:
            errors.append(str(error))
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    zero = ZeRO(model, optimizer, stage=2)
    _loss(zero, _data(0)[:2]).backward()
    try:
        optimizer.step()  # the DDP/FSDP2 idiom: must not step the shards without the reduce and gather
        errors.append("accepted")
    except RuntimeError as error:
        errors.append(str(error))
    zero.step()  # the wrapper's own step still works after the refusal
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2, dtype=torch.float64))]})
    _loss(zero, _data(0)[:2]).backward()
    try:
        zero.step()
        errors.append("accepted")
    except RuntimeError as error:
        errors.append(str(error))
    adagrad_model = _gpt2()
    ZeRO(adagrad_model, torch.optim.Adagrad(adagrad_model.parameters(), lr=0.1), stage=1)  # fresh state: accepted
    return errors


@pytest.mark.slow
def test_hf_param_groups_and_optimizer_object_at_every_stage():
    want = _reference()
    single_group = _reference(grouped=False)
    biases = [name for name in want if name.endswith("bias") and "attn.bias" not in name]
    assert max(float((want[name] - single_group[name]).abs().max()) for name in biases) > 1e-3  # groups matter
    for got in run_distributed(_train, 3):
        for stage in (1, 2, 3):
            result = got[stage]
            assert result["mixed_units"] == [], f"stage {stage}: units mixing two param groups"
            assert result["lrs"] == [1e-2 / (1 + STEPS), 3e-2 / (1 + STEPS)]  # the scheduler drove the shards' lr
            assert set(result["state"]) == set(want)
            for name in want:
                torch.testing.assert_close(result["state"][name], want[name], rtol=1e-10, atol=1e-12,
                                           msg=f"stage {stage} {name}")
        assert got[3]["module_in_two_groups"]  # stage 3: one module, two units
        errors = got["errors"]
        assert "holds 2 tensors that are not the wrapped module's parameters" in errors[0]
        assert "made 2 param groups over the shards" in errors[1] and "give the optimizer itself" in errors[1]
        assert "has already stepped" in errors[2]
        assert "does not hold the trainable parameters ['transformer.ln_f.weight'" in errors[3]
        assert "optimizer=str must be a torch.optim optimizer" in errors[4]
        assert "optimizer.step() called directly" in errors[5] and "zero.step()" in errors[5]
        assert "param groups were changed after wrapping (add_param_group" in errors[6]
