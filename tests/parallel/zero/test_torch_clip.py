"""torch's clipping idiom on plait's data-parallel wrappers (plait.parallel.zero.grad_views):
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (foreach default, on and
off; ``get_total_norm`` + ``clip_grads_with_norm_``) and plait's ``zero.clip_grad_norm_``
on ZeRO stages 1-3, and torch's idiom on DataParallel, give the norm and the parameters
one process gets training the whole batch; with plait tensor-parallel layers (dp 2 × tp 2)
too, under ZeRO and DataParallel (plait.parallel.data.tp_grads); every other op on a
ZeRO-sharded gradient is refused by name. A hybrid model (pp 2) whose embedding and head
are one weight on two pipeline ranks clips by the norm that counts it once (plait's own
clip: train_step(grad_clip=), with and without ZeRO's ShardedOptimizer).

Before (the code without gradient views): stage 1 clipped by each rank's local,
un-reduced norm; stages 2 and 3 saw no gradient (.grad None), got a norm of 0 and
clipped nothing; with tp layers plait's own method summed each tp rank's shard alone, and
torch's on DataParallel took each tp rank's local norm; the hybrid clip counted the tied
weight on both pipeline ranks (a norm too large).

Tolerance: float64, 3 SGD steps (momentum 0.9, lr 0.1), every step clipped (max_norm
below every norm). The ranks average per-rank mean gradients where one process sums the
whole batch: the same terms in another order, ~1e-16 relative per element; the norm is a
sum of squares in another order (~1e-15 relative), the clip factor max_norm / norm
likewise, and SGD is linear in them, so 3 steps keep the parameters within 1e-12 absolute
(rtol 1e-10) and the norms within rtol 1e-12."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.parallel.data.data_parallel import DataParallel
from plait.parallel.hybrid import build_hybrid, train_step
from plait.parallel.mesh import DeviceMesh, ParallelDims
from plait.parallel.tensor import ColumnParallelLinear, RowParallelLinear, UNSHARDED, new_tensor_parallel
from plait.parallel.tensor.sharding import shard_spec, shard_tensor
from plait.parallel.zero.module import ZeRO
from plait.parallel.zero.optimizer import ShardedOptimizer
from plait.testing import run_distributed
from tests.hf_models import tiny_gpt2

STEPS, BATCH, SEQ, VOCAB, MAX_NORM = 3, 4, 8, 64, 0.05
IDIOMS = ("torch", "torch_foreach", "torch_loop", "total_then_clip", "plait")


def _gpt2():
    return tiny_gpt2(0, VOCAB)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(10 + step))


def _clip(idiom: str, wrapper, params) -> torch.Tensor:
    if idiom == "plait":
        return wrapper.clip_grad_norm_(MAX_NORM)
    if idiom == "total_then_clip":  # torch >= 2.6's two halves
        norm = torch.nn.utils.get_total_norm([param.grad for param in params if param.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
        return norm
    foreach = {"torch": None, "torch_foreach": True, "torch_loop": False}[idiom]
    return torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=foreach)


def _reference_gpt2():
    model = _gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for step in range(STEPS):
        tokens = _tokens(step)
        model(tokens, labels=tokens).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), norms


def _train_gpt2(rank, world_size, kind, stage, idiom):
    model = _gpt2()
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    if kind == "zero":
        wrapper = ZeRO(model, sgd, stage=stage)
    else:
        wrapper = DataParallel(model)
        optimizer = sgd(model.parameters())
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    norms = []
    for step in range(STEPS):
        tokens = _tokens(step)[rows]
        wrapper(tokens, labels=tokens).loss.backward()
        if idiom == "torch":  # an evaluation between the backward and the clip leaves the gradients
            with torch.no_grad():
                wrapper(tokens)
        norms.append(float(_clip(idiom, wrapper, list(model.parameters()))))
        if kind == "zero":
            wrapper.step()
            wrapper.zero_grad()
        else:
            optimizer.step()
            optimizer.zero_grad()
    state = wrapper.full_state_dict() if kind == "zero" else model.state_dict()
    return {name: value.detach().clone() for name, value in state.items()}, norms


def _gpt2_cases(rank, world_size):
    """Every idiom at stage 1 (whose views reduce at the first norm), the others at stages 2 and
    3 between them, and torch's on DataParallel, in one pool call."""
    cases = [("zero", 1, idiom) for idiom in IDIOMS] + [("zero", 2, "torch"), ("zero", 2, "plait"),
                                                         ("zero", 3, "torch_loop"), ("zero", 3, "total_then_clip"),
                                                         ("zero", 3, "plait"), ("dp", 0, "torch")]
    return {case: _train_gpt2(rank, world_size, *case) for case in cases}


@pytest.mark.slow
def test_torch_clip_on_zero_and_data_parallel_equals_one_process():
    want_state, want_norms = _reference_gpt2()
    for got in run_distributed(_gpt2_cases, 2):
        for case, (state, norms) in got.items():
            torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64),
                                       torch.tensor(want_norms, dtype=torch.float64), rtol=1e-12, atol=0,
                                       msg=f"{case}: norms")
            for name, value in want_state.items():
                if name in state:  # the state dict's buffers (attention masks) are the same on both
                    torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=f"{case}: {name}")


# ----- tensor-parallel layers inside ZeRO: dp 2 x tp 2 -------------------------------------------

class TensorParallelNet(nn.Module):
    """A LayerNorm and a head (tp-replicated) around a Megatron MLP (column-parallel up with
    its bias sharded, row-parallel down with its bias replicated); input (s, b, 16)."""

    def __init__(self, tp):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(16, dtype=torch.float64)
        self.up = ColumnParallelLinear(16, 32, tp, dtype=torch.float64, seed=1)
        self.down = RowParallelLinear(32, 16, tp, dtype=torch.float64, seed=2)
        self.head = nn.Linear(16, 4, dtype=torch.float64)

    def forward(self, x):
        return self.head(x + self.down(torch.tanh(self.up(self.norm(x)))))


def _tp_data(step: int):
    generator = torch.Generator().manual_seed(50 + step)
    return (torch.randn(3, BATCH, 16, generator=generator, dtype=torch.float64),
            torch.randn(3, BATCH, 4, generator=generator, dtype=torch.float64))


def _reference_tp():
    model = TensorParallelNet(UNSHARDED)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for step in range(STEPS):
        x, y = _tp_data(step)
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), norms


def _tp_cases(rank, world_size):
    tp = new_tensor_parallel(2)
    dp_groups = [dist.new_group([first, first + 2]) for first in (0, 1)]  # every rank creates every group
    dp_group, dp_rank = dp_groups[rank % 2], rank // 2
    alone = [dist.new_group([each]) for each in range(world_size)][rank]  # a dp group of one: tp only
    out = {}
    for stage, idiom in ((1, "torch"), (1, "plait"), (2, "torch_foreach"), (3, "torch_loop"), (3, "plait"),
                         (0, "torch"), (0, "torch_foreach")):  # stage 0: DataParallel
        model = TensorParallelNet(tp)
        sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
        if stage:
            wrapper = ZeRO(model, sgd, stage=stage, group=dp_group)
        else:
            wrapper, optimizer = DataParallel(model, dp_group), sgd(model.parameters())
        norms = []
        for step in range(STEPS):
            x, y = _tp_data(step)
            rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
            nn.functional.mse_loss(wrapper(x[:, rows]), y[:, rows]).backward()
            norms.append(float(_clip(idiom, wrapper, list(model.parameters()))))
            (wrapper if stage else optimizer).step()
            (wrapper if stage else optimizer).zero_grad()
        specs = {name: shard_spec(param) for name, param in model.named_parameters()}
        state = wrapper.full_state_dict() if stage else model.state_dict()
        state = {name: value.detach().clone() for name, value in state.items()}
        out[(stage, idiom)] = (state, norms, specs, tp.rank)
    model = TensorParallelNet(tp)  # DataParallel over one rank: no average, the tp norms all the same
    wrapper, optimizer = DataParallel(model, alone), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for step in range(STEPS):
        x, y = _tp_data(step)
        nn.functional.mse_loss(wrapper(x), y).backward()
        norms.append(float(_clip("torch", wrapper, list(model.parameters()))))
        optimizer.step()
        optimizer.zero_grad()
    specs = {name: shard_spec(param) for name, param in model.named_parameters()}
    out[(0, "torch, a dp group of one")] = ({name: value.detach().clone() for name, value in
                                            model.state_dict().items()}, norms, specs, tp.rank)
    return out


@pytest.mark.slow
def test_torch_clip_with_tensor_parallel_layers_inside_zero_and_data_parallel_equals_one_process():
    want_state, want_norms = _reference_tp()
    for got in run_distributed(_tp_cases, 4):
        for case, (state, norms, specs, tp_rank) in got.items():
            torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64),
                                       torch.tensor(want_norms, dtype=torch.float64), rtol=1e-12, atol=0,
                                       msg=f"{case}: norms")
            for name, value in want_state.items():
                want = shard_tensor(value, specs.get(name), tp_rank, 2)
                torch.testing.assert_close(state[name], want, rtol=1e-10, atol=1e-12, msg=f"{case}: {name}")


# ----- other norms, torch's zero_grad, and what is refused ---------------------------------------------

def _small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 1)).double()


def _small_data(rank: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 8, dtype=torch.float64).view(2, 4) * (rank + 1)


def _small_reference(world_size: int, batches: int):
    """One process: the mean over the ranks' losses of the last of ``batches`` backwards
    (the earlier ones dropped by zero_grad), as each rank's mean loss averaged."""
    model = _small_model()
    for _ in range(batches):
        model.zero_grad()
        sum(model(_small_data(rank)).sum() for rank in range(world_size)).div(world_size).backward()
    return model


def _stepped_difference(zero, reference) -> float:
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    zero.step()
    return max(float((got - want).abs().max()) for got, want in
               zip(zero.full_state_dict().values(), reference.state_dict().values()))


def _small_cases(rank, world_size):
    """Per stage: get_total_norm with p = 1, 3, inf against one process; model.zero_grad()
    (torch's, not zero's) between two backwards drops the first from the shards;
    clip_grad_value_ (foreach default and on) clamps the averaged gradient; the refusals."""
    out = {}
    for stage in (1, 2, 3):
        sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
        model = _small_model()
        zero = ZeRO(model, sgd, stage=stage)
        zero(_small_data(rank)).sum().backward()
        reference = _small_reference(world_size, 1)
        norms = {order: (float(torch.nn.utils.get_total_norm([param.grad for param in model.parameters()], order)),
                         float(torch.nn.utils.get_total_norm([param.grad for param in reference.parameters()],
                                                             order)))
                 for order in (1.0, 3.0, float("inf"))}
        model.zero_grad()  # torch's idiom: every .grad None
        zero(_small_data(rank)).sum().backward()
        zero.clip_grad_norm_(0.01)
        reference = _small_reference(world_size, 2)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        worst = {"zero_grad": _stepped_difference(zero, reference)}
        for foreach in (None, True):
            model = _small_model()
            zero = ZeRO(model, sgd, stage=stage)
            zero(_small_data(rank)).sum().backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.3, foreach=foreach)  # clamps some elements
            reference = _small_reference(world_size, 1)
            torch.nn.utils.clip_grad_value_(reference.parameters(), 0.3)
            worst[f"clip_value foreach={foreach}"] = _stepped_difference(zero, reference)
        model = _small_model()
        zero = ZeRO(model, sgd, stage=stage)
        loss = zero(_small_data(rank)).sum()
        loss.backward(retain_graph=True)
        errors = {}
        for label, call in (("read", lambda: model[0].weight.grad + 1),
                            ("sum", lambda: model[2].bias.grad.sum()),
                            ("accumulate", lambda: loss.backward())):
            try:
                call()
                errors[label] = None
            except RuntimeError as error:
                errors[label] = str(error)
        out[stage] = (norms, worst, errors, repr(model[0].weight.grad))
    return out


@pytest.mark.slow
def test_other_norms_clip_value_torch_zero_grad_and_refusals_by_name():
    """Tolerance: float64 sums of the same terms in another order, 1e-12 relative."""
    for got in run_distributed(_small_cases, 2):
        for stage, (norms, worst, errors, text) in got.items():
            for order, (mine, want) in norms.items():
                assert mine == pytest.approx(want, rel=1e-12), (stage, order)
            for label, difference in worst.items():
                assert difference <= 1e-12, (stage, label, difference)
            assert "'0.weight'" in text and f"stage {stage}" in text
            for label, message in errors.items():
                assert message is not None and "the gradient of '" in message, (stage, label, message)
                assert "zero.clip_grad_norm_" in message, (stage, label, message)
            assert "run the forward through the ZeRO wrapper" in errors["accumulate"]


# ----- plait's own clip of a hybrid model: a weight tied across pipeline ranks counts once -----------

class _Head(nn.Module):
    def __init__(self, norm, head):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x):
        return self.head(self.norm(x))


class TiedStack(nn.Module):
    """An embedding, a Tanh MLP and a LayerNorm + head tied to the embedding (as GPT-2's):
    cut in two pipeline stages, the embedding and the head land on different ranks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 8, dtype=torch.float64)
        self.mid = nn.Sequential(nn.Linear(8, 8, dtype=torch.float64), nn.Tanh())
        self.norm = nn.LayerNorm(8, dtype=torch.float64)
        self.head = nn.Linear(8, 13, bias=False, dtype=torch.float64)
        self.head.weight = self.embed.weight
        self.layers = [self.embed, self.mid, _Head(self.norm, self.head)]

    def forward(self, tokens):
        for layer in self.layers:
            tokens = layer(tokens)
        return tokens


def _cross_entropy(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, 13), targets.reshape(-1))


def _stack_data(step: int):
    tokens = torch.randint(0, 13, (4, 7), generator=torch.Generator().manual_seed(70 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _reference_stack():
    model = TiedStack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for step in range(STEPS):
        inputs, targets = _stack_data(step)
        _cross_entropy(model(inputs), targets).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return {name: param.detach().clone() for name, param in model.named_parameters()}, norms


def _hybrid_cases(rank, world_size):
    mesh = DeviceMesh.create(ParallelDims(pp=2))
    out = {}
    for zero_stage in (0, 1):
        model = TiedStack()
        hybrid = build_hybrid(model, model.layers, mesh, _cross_entropy, schedule="1f1b", microbatches=2,
                              timeout_s=60)
        optimizer = torch.optim.SGD(list(hybrid.parameters()), lr=0.1, momentum=0.9)
        if zero_stage:
            shared = set(hybrid.engine.shared_parameters)
            optimizer = ShardedOptimizer(optimizer, mesh.group["dp"], stage=zero_stage,
                                         late=[param for name, param in hybrid.names.items() if name in shared])
        norms = []
        for step in range(STEPS):
            inputs, targets = _stack_data(step)
            _, norm, _ = train_step(hybrid, inputs, targets, optimizer, step=step, grad_clip=MAX_NORM)
            norms.append(norm)
        out[zero_stage] = ({name: param.detach().clone() for name, param in hybrid.names.items()}, norms,
                           dict(hybrid.engine.shared_parameters))
    return out


@pytest.mark.slow
def test_hybrid_clip_counts_a_weight_tied_across_pipeline_ranks_once():
    want_state, want_norms = _reference_stack()
    for got in run_distributed(_hybrid_cases, 2):
        for zero_stage, (state, norms, shared) in got.items():
            assert "embed.weight" in shared, shared  # the tie spans the two pipeline ranks
            torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64),
                                       torch.tensor(want_norms, dtype=torch.float64), rtol=1e-12, atol=0,
                                       msg=f"zero {zero_stage}: norms")
            for name, value in state.items():
                torch.testing.assert_close(value, want_state[name], rtol=1e-10, atol=1e-12,
                                           msg=f"zero {zero_stage}: {name}")
