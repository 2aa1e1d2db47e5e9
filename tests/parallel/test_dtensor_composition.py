"""plait's wrappers over a model with DTensor parameters (torch's own tensor parallelism,
``parallelize_module`` with ColwiseParallel/RowwiseParallel on the tp dimension of a
2-D ``init_device_mesh``: the FSDP2 + TP pattern), on a 2 x 2 (dp x tp) world of gloo
ranks.

DataParallel over ``mesh["dp"]`` works on the local shards (every dp rank holds the
same tp shard, so the dp average of each local gradient is that shard of the dp
average) and trains exactly as one process on the whole batch, torch's
``clip_grad_norm_`` included (the gradients are DTensors, so it reduces over tp).
ZeRO (the module and ShardedOptimizer), the parameter server, the pipeline engine and
data parallelism over a group that holds two ranks of the tp mesh are refused by name
before the first step (on the code before issue 33, DataParallel and ZeRO failed with
an unrelated ".numpy() is not supported for tensor subclasses").

Tolerance: float64, 3 SGD steps. The tp layers split each matmul's sum over the hidden
dimension into two partial sums added by the all-reduce, and the dp average adds two
half-batch means where one process takes one mean: the same terms in another order, a
few ulps (2.2e-16) relative per gradient element, and SGD's update is linear in the
gradient, so after 3 steps of lr 0.1 the parameters agree to ~1e-15: rtol 1e-10, atol
1e-12 leave room and still catch any real error (a gradient off by a factor of 2, or not
averaged over dp, moves the parameters by ~1e-2).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.testing import run_distributed

BATCH, FEATURES, HIDDEN, CLASSES, STEPS = 8, 6, 16, 4, 3
CLIP = 0.5  # below the gradient norms here (~1), so every step clips


class MLP(nn.Module):
    """A transformer MLP block in front of a classifier: up (column-parallel), down
    (row-parallel), head (replicated)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(FEATURES, HIDDEN)
        self.down = nn.Linear(HIDDEN, FEATURES)
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.head(x + self.down(torch.tanh(self.up(x))))


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP().double()


def _batch(step: int):
    generator = torch.Generator().manual_seed(10 + step)
    return (torch.randn(BATCH, FEATURES, dtype=torch.float64, generator=generator),
            torch.randint(0, CLASSES, (BATCH,), generator=generator))


def _optimizer(params):
    # SGD with momentum: every update is linear in the gradient, so a wrong scale shows (AdamW would hide one)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _reference(clip: bool) -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = _optimizer(model.parameters())
    for step in range(STEPS):
        inputs, targets = _batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _refusal(call) -> str:
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def _train(model, mesh, clip: bool) -> dict[str, torch.Tensor]:
    """DataParallel over mesh['dp'] of a model parallelised on mesh['tp']; its parameters
    gathered whole."""
    from plait.parallel import DataParallel

    wrapped = DataParallel(model, group=mesh["dp"])
    optimizer = _optimizer(wrapped.parameters())
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    for step in range(STEPS):
        inputs, targets = _batch(step)
        optimizer.zero_grad()
        F.cross_entropy(wrapped(inputs[rows]), targets[rows]).backward()
        if clip:
            # torch's own idiom: the .grad are DTensors (plait's dp average of each local shard), so the
            # norm reduces over the tp mesh as torch's tensor parallelism does, the same on every dp rank
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), CLIP)
        optimizer.step()
    return {name: param.full_tensor().detach().clone() if hasattr(param, "full_tensor") else param.detach().clone()
            for name, param in model.named_parameters()}


def _dp_by_tp(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from plait.parallel import DataParallel, ParameterServer, ShardedOptimizer, ZeRO
    from plait.parallel.pipeline import build
    from plait.parallel.pipeline.engine import PipelineEngine

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_model(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    refused = {
        "ZeRO": _refusal(lambda: ZeRO(model, _optimizer, stage=1, group=mesh["dp"])),
        "ParameterServer": _refusal(lambda: ParameterServer(model, _optimizer, group=mesh["dp"])),
        "ShardedOptimizer": _refusal(lambda: ShardedOptimizer(_optimizer(model.parameters()), mesh["dp"])),
        "PipelineEngine": _refusal(lambda: PipelineEngine(build("1f1b", 2, 2), {mesh["dp"].get_local_rank(): model},
                                                          F.cross_entropy, group=mesh["dp"])),
        "DataParallel over the world": _refusal(lambda: DataParallel(model)),
    }
    # the head stays a plain tensor beside the DTensors (torch's clip_grad_norm_ cannot mix the two: torch's
    # own limitation); a second model has every layer parallelised, the head's output gathered, and clips
    mixed = _train(model, mesh, clip=False)
    whole = parallelize_module(_model(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel(),
                                                       "head": ColwiseParallel(output_layouts=Replicate())})
    return refused, mixed, _train(whole, mesh, clip=True)


@pytest.mark.slow
def test_data_parallel_over_dp_of_a_dtensor_model_trains_like_one_process():
    want = {False: _reference(clip=False), True: _reference(clip=True)}
    for refused, mixed, clipped in run_distributed(_dp_by_tp, 4):
        for clip, got in ((False, mixed), (True, clipped)):
            assert set(got) == set(want[clip])
            for name in want[clip]:
                torch.testing.assert_close(got[name], want[clip][name], rtol=1e-10, atol=1e-12,
                                           msg=lambda text, clip=clip, name=name: f"clip={clip} {name}: {text}")
        assert refused["ZeRO"].startswith("TypeError: ZeRO: the model has DTensor parameters ('up.weight'")
        assert "DataParallel(model, group=mesh['dp'])" in refused["ZeRO"]
        assert refused["ParameterServer"].startswith("TypeError: ParameterServer: the model has DTensor parameters")
        assert refused["ShardedOptimizer"].startswith(
            "TypeError: ShardedOptimizer: the model has DTensor parameters ('param_groups[0] parameter 0'")
        assert refused["PipelineEngine"].startswith("TypeError: PipelineEngine: the model has DTensor parameters "
                                                    "('stage "), refused["PipelineEngine"]
        assert " up.weight'" in refused["PipelineEngine"]
        assert "plait.parallel.hybrid for dp x tp x pp" in refused["PipelineEngine"]
        assert refused["DataParallel over the world"].startswith(
            "ValueError: DataParallel: parameter 'up.weight' is a DTensor on a mesh of global ranks")
        assert "mesh['dp']" in refused["DataParallel over the world"]
