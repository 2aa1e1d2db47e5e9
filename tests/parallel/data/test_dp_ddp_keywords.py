"""torch DDP's constructor keywords on plait's DataParallel (plait.parallel.data.ddp_keywords):
those whose meaning plait has train exactly as plait's own spelling would (2 gloo ranks,
float64, against one process over the whole batch: the same sums in another order, a few
ulps, 1e-12 absolute); the others are refused by name with plait's spelling (single
process: the keywords are read before anything else runs)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.parallel.data.data_parallel import DataParallel
from plait.testing import run_distributed

TOL = 1e-12  # float64, see the module docstring


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batch(step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=generator, dtype=torch.float64), torch.randint(0, 3, (8,), generator=generator)


def _train(model, steps: int, rows=slice(None)):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step)
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _ddp_spelling(rank, world_size):
    model = _model()
    wrapped = DataParallel(model, device_ids=None, output_device=None, process_group=dist.group.WORLD,
                           bucket_cap_mb=1, find_unused_parameters=False, broadcast_buffers=True,
                           gradient_as_bucket_view=False, static_graph=False, dim=0)
    share = 8 // world_size
    _train(wrapped, 2, slice(rank * share, (rank + 1) * share))
    reference = _model()
    _train(reference, 2)
    difference = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    refusals = []
    for misuse in (lambda: wrapped.register_comm_hook(None, lambda state, bucket: None),  # DDP's hook
                   lambda: wrapped.float()(_batch(0)[0].float())):  # cast after wrapping, then a forward
        try:
            misuse()
            refusals.append("ran")
        except (TypeError, RuntimeError) as error:
            refusals.append(str(error))
    return difference, refusals


@pytest.mark.slow
def test_ddp_keywords_with_plait_meaning_train_exactly():
    for difference, (hook, cast) in run_distributed(_ddp_spelling, 2):
        assert difference < TOL
        assert hook.startswith("DataParallel: register_comm_hook is DDP's") and "ddp_comm_hook" in hook, hook
        assert "parameter '0.weight' is torch.float32" in cast and "before wrapping" in cast, cast


@pytest.mark.parametrize("keyword, value, fix", [
    ("device_ids", [0], "move the model there first"),
    ("output_device", 0, "move the model there first"),
    ("gradient_as_bucket_view", True, "drop gradient_as_bucket_view="),
    ("static_graph", True, "drop static_graph="),
    ("init_sync", True, "init='broadcast'"),
    ("dim", 1, "drop dim="),
    ("skip_all_reduce_unused_params", True, "find_unused_parameters=True"),
])
def test_ddp_keywords_without_plait_meaning_are_refused_by_name(keyword, value, fix):
    with pytest.raises(TypeError, match=rf"^DataParallel: {keyword}=") as caught:
        DataParallel(_model(), **{keyword: value})
    assert fix in str(caught.value)


def test_a_keyword_ddp_does_not_have_is_pythons_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_size'"):
        DataParallel(_model(), bucket_size=1)
