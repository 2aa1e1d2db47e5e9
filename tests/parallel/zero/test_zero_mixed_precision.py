"""ZeRO's mixed-precision policy (FSDP2's MixedPrecisionPolicy: param_dtype, reduce_dtype,
output_dtype, cast_forward_inputs) at stages 1-3 on 2 ranks, against one process doing
the same by hand: float32 master parameters and AdamW state, a bfloat16 copy of the
model cast from them before each step's forward, each rank's rows run forward and
backward in bfloat16 (the float32 input cast to bfloat16, the logits cast to float32),
the bfloat16 gradients cast to ``reduce_dtype``, summed over the ranks and halved, cast
to float32 and stepped. Also torch's own autocast idiom (float32 parameters) with no
policy, and the measured dtypes and bytes: master shards and optimizer state float32,
gathered parameters bfloat16.

Tolerance: none, bit-exact. Each rank's forward and backward is the reference's on the
same rows with the same bfloat16 weights (same kernels, one thread); with 2 ranks the
reduce-scatter's sum has two terms, g0 + g1 = g1 + g0 exactly in IEEE arithmetic
whichever order the ring adds them, and / 2 is exact; AdamW is element-wise, so the
float32 master shards step exactly as the whole master tensors."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

from plait.parallel.zero import MixedPrecisionPolicy, ZeRO
from plait.testing import run_distributed

BATCH, FEATURES, CLASSES, STEPS, WORLD = 8, 16, 5, 3, 2
BF16 = torch.bfloat16


class Net(nn.Module):
    """Two residual-free blocks, a LayerNorm and a head: a root parameter too."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(FEATURES, 24), nn.Linear(24, FEATURES)
        self.norm = nn.LayerNorm(FEATURES)
        self.head = nn.Linear(FEATURES, CLASSES)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, FEATURES))

    def forward(self, x):
        return self.head(self.norm(self.down(torch.tanh(self.up(x)))) * self.scale)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()  # float32: the master weights


def _data(step: int):
    generator = torch.Generator().manual_seed(200 + step)
    return torch.randn(BATCH, FEATURES, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _loss(logits, targets):
    return nn.functional.cross_entropy(logits, targets)


def _reference(reduce_dtype, autocast: bool) -> list[torch.Tensor]:
    """One process, by hand: float32 masters, a 16-bit copy per step (or autocast over
    float32 parameters), the ranks' rows one after the other."""
    masters = _model()
    optimizer = _optimizer(masters.parameters())
    compute = _model() if autocast else _model().to(BF16)
    rows = BATCH // WORLD
    for step in range(STEPS):
        with torch.no_grad():
            for copy, master in zip(compute.parameters(), masters.parameters()):
                copy.copy_(master)  # the cast
        x, y = _data(step)
        per_rank = []
        for rank in range(WORLD):
            compute.zero_grad()
            mine = slice(rank * rows, (rank + 1) * rows)
            if autocast:
                with torch.autocast("cpu", dtype=BF16):
                    logits = compute(x[mine])
                _loss(logits.float(), y[mine]).backward()
            else:
                _loss(compute(x[mine].to(BF16)).float(), y[mine]).backward()
            per_rank.append([param.grad.to(reduce_dtype) for param in compute.parameters()])
        for master, grads in zip(masters.parameters(), zip(*per_rank)):
            master.grad = (grads[0] + grads[1]).div(WORLD).to(torch.float32)
        optimizer.step()
        optimizer.zero_grad()
    return [param.detach().clone() for param in masters.parameters()]


def _masters(zero: ZeRO, model: nn.Module) -> list[torch.Tensor]:
    """Every parameter's float32 master, all-gathered from the shards the optimizer steps."""
    values = {}
    for unit in zero.units:
        full = torch.empty(unit.padded, dtype=unit.shard.dtype)
        dist.all_gather_into_tensor(full, unit.shard.detach().contiguous())
        for param, offset in zip(unit.params, unit.offsets):
            values[id(param)] = full[offset:offset + param.numel()].view(param.shape)
    return [values[id(param)] for param in model.parameters()]


def _train(rank, world_size):
    scenarios = {"stage1": (1, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32,
                                                    output_dtype=torch.float32)),
                 "stage2-torch-policy-bf16-reduce": (2, TorchMixedPrecisionPolicy(
                     param_dtype=BF16, reduce_dtype=BF16, output_dtype=torch.float32)),
                 "stage3-names": (3, MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32",
                                                          output_dtype="fp32")),
                 "stage2-autocast": (2, None)}
    results = {}
    rows = BATCH // world_size
    for label, (stage, policy) in scenarios.items():
        model = _model()
        zero = ZeRO(model, _optimizer(model.parameters()), stage=stage, mp_policy=policy)
        dtypes = {str(param.dtype) for param in model.parameters()}
        for step in range(STEPS):
            x, y = _data(step)
            mine = slice(rank * rows, (rank + 1) * rows)
            if policy is None:
                with torch.autocast("cpu", dtype=BF16):
                    logits = zero(x[mine])
                logits = logits.float()
            else:
                logits = zero(x[mine])  # float32 in, bfloat16 compute, float32 out (output_dtype)
            assert logits.dtype == torch.float32
            _loss(logits, y[mine]).backward()
            zero.step()
            zero.zero_grad()
        state = [value for entry in zero.optimizer.state.values() for value in entry.values()
                 if torch.is_tensor(value) and value.dim() == 1]
        full = zero.full_state_dict()  # the masters (float32), not the bfloat16 parameters
        results[label] = {"masters": _masters(zero, model), "param_dtypes": dtypes,
                          "full": [full[name] for name, _ in model.named_parameters()],
                          "state_dtypes": {str(value.dtype) for value in state},
                          "exp_avg_dtypes": {str(entry["exp_avg"].dtype) for entry in zero.optimizer.state.values()},
                          "memory": zero.model_state_bytes(),
                          "shard_numel": sum(unit.shard_numel for unit in zero.units),
                          "padded": sum(unit.padded for unit in zero.units)}
    return results


@pytest.mark.slow
def test_policy_is_fp32_master_training_by_hand():
    want = {"stage1": _reference(torch.float32, False),
            "stage2-torch-policy-bf16-reduce": _reference(BF16, False),
            "stage3-names": _reference(torch.float32, False),
            "stage2-autocast": _reference(torch.float32, True)}
    # the 16-bit reduce is a different training: the check below can tell them apart
    assert any(not torch.equal(a, b) for a, b in zip(want["stage1"], want["stage2-torch-policy-bf16-reduce"]))
    for got in run_distributed(_train, WORLD):
        for label, masters in want.items():
            result = got[label]
            for index, (value, expected) in enumerate(zip(result["masters"], masters)):
                torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=f"{label} parameter {index}")
                torch.testing.assert_close(result["full"][index], expected, rtol=0, atol=0,
                                           msg=f"{label} full_state_dict {index}")
            assert result["state_dtypes"] == {"torch.float32"} and result["exp_avg_dtypes"] == {"torch.float32"}
            memory = result["memory"]
            assert memory["master_bytes"] == (4 * result["shard_numel"] if label != "stage2-autocast" else 0)
            if label in ("stage1", "stage2-torch-policy-bf16-reduce"):
                assert result["param_dtypes"] == {"torch.bfloat16"}
                assert memory["params_bytes"] == 2 * result["padded"]  # the gathered parameters: bfloat16
            assert memory["optimizer_bytes"] >= 2 * 4 * result["shard_numel"]  # exp_avg, exp_avg_sq: float32
        assert got["stage2-autocast"]["param_dtypes"] == {"torch.float32"}


def test_policy_values_are_checked():
    assert MixedPrecisionPolicy(param_dtype="bf16").param_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="param_dtype=torch.int8 must be a floating-point dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="reduce_dtype='half' must be a torch dtype, one of"):
        MixedPrecisionPolicy(reduce_dtype="half")
