"""ZeRO stages 1-3 (plait.parallel.zero.module) on real gloo ranks: float64 training equals one
process training the whole batch, with gradient accumulation, clipping, a tied
weight, an unused parameter, a root-level parameter and uneven shards (N = 2..5);
memory after a step is measured from live storages against ZeRO's formulas; bytes
sent per step are counted at the transport against 2Ψ(N-1)/N and 3Ψ(N-1)/N; bad use
is named.

Tolerance: float64, 3 steps. ZeRO averages per-rank mean gradients (a sum of N
partial sums, then / N) where the reference sums the whole batch at once: the same
terms in another order, so each gradient element differs by at most ~B·ε·Σ|terms|
(B = 12 samples, ε = 2⁻⁵² ≈ 2.2e-16), about 1e-14 relative here; AdamW's update
m/(√v + eps) is a smooth function of the gradient, so 3 steps of lr 1e-2 keep the
parameters within 1e-12 absolute (rtol 1e-10 for the larger ones)."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.parallel.data.data_parallel import DataParallel
from plait.parallel.zero.module import ZeRO, default_wrap
from plait.testing import run_distributed, run_fresh_world

BATCH, SEQ, VOCAB = 12, 5, 11


class TiedNet(nn.Module):
    """An embedding tied to the output head (one Parameter in two modules), two
    residual MLP blocks, a LayerNorm, a parameter of the root itself and a Linear the
    forward never uses."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 7)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 7)) for _ in range(2)])
        self.norm = nn.LayerNorm(7)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 7))
        self.head = nn.Linear(7, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.unused = nn.Linear(3, 3)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x) * self.scale)


def _model() -> TiedNet:
    torch.manual_seed(0)
    return TiedNet().double()


def _data(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, torch.roll(tokens, 1, dims=1)


def _loss(model, tokens, targets):
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(steps: int, accumulate: int, clip: float | None):
    model = _model()
    optimizer = _optimizer(model.parameters())
    for step in range(steps):
        tokens, targets = _data(step)
        for part in range(accumulate):
            rows = slice(part * BATCH // accumulate, (part + 1) * BATCH // accumulate)
            (_loss(model, tokens[rows], targets[rows]) / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.clone() for name, value in model.state_dict().items()}


def _zero_train(rank, world_size, stage, steps, accumulate, clip):
    model = _model()
    zero = ZeRO(model, _optimizer, stage=stage)
    per_rank = BATCH // world_size
    for step in range(steps):
        tokens, targets = _data(step)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        tokens, targets = tokens[mine], targets[mine]
        for part in range(accumulate):
            rows = slice(part * per_rank // accumulate, (part + 1) * per_rank // accumulate)
            context = zero.no_sync() if part < accumulate - 1 else torch.enable_grad()
            with context:
                (_loss(zero, tokens[rows], targets[rows]) / accumulate).backward()
        if clip is not None:
            zero.clip_grad_norm_(clip)
        zero.step()
        zero.zero_grad()
    return zero.full_state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero_trains_like_one_process(stage, world_size):
    clip = 0.5 if world_size != 3 else None
    accumulate = 2 if world_size != 4 else 1
    want = _reference(3, accumulate, clip)
    for got in run_distributed(_zero_train, world_size, stage, 3, accumulate, clip):
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


class TwoHeads(nn.Module):
    """A body and two heads; each forward runs one head."""

    def __init__(self):
        super().__init__()
        self.body, self.left, self.right = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x, head):
        return getattr(self, head)(torch.tanh(self.body(x)))


def _accumulated_outside_no_sync(rank, world_size, stage, synced):
    """Two backwards before one step, the first through ``left``, the second through
    ``right``: both outside no_sync (``synced``: each reduces), or the first inside."""
    torch.manual_seed(0)
    model = TwoHeads().double()
    before = model.left.weight.detach().clone()
    zero = ZeRO(model, lambda params: torch.optim.SGD(params, lr=0.1), stage=stage)
    x = torch.linspace(-1, 1, 8, dtype=torch.float64).view(2, 4) * (rank + 1)
    with zero.no_sync() if not synced else torch.enable_grad():
        zero(x, "left").sum().backward()
    zero(x, "right").sum().backward()
    zero.step()
    state = zero.full_state_dict()
    return state, bool(torch.equal(state["left.weight"], before))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_gradient_of_an_earlier_synced_backward_is_stepped(stage):
    """A parameter with a gradient since zero_grad() is stepped even when the last
    backward before the step did not reach it, as when the backwards accumulate in
    no_sync() (before one engine served both ZeRO fronts, the module's stages 2 and 3
    kept only the last reduction's "had a gradient" flags, and left ``left`` as it was)."""
    for (synced, left_unchanged), (accumulated, _) in zip(
            run_distributed(_accumulated_outside_no_sync, 2, stage, True),
            run_distributed(_accumulated_outside_no_sync, 2, stage, False)):
        assert not left_unchanged
        for name in accumulated:
            torch.testing.assert_close(synced[name], accumulated[name], rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.slow
def test_five_ranks_shard_unevenly():
    """N = 5 does not divide any unit's size (nor the batch of 12: 10 rows used here)."""
    global BATCH
    want = None
    try:
        BATCH = 10
        want = _reference(2, 1, 0.5)
        results = run_distributed(_zero_train_10, 5, 3, 2, 1, 0.5)
    finally:
        BATCH = 12
    for got in results:
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


def _zero_train_10(rank, world_size, stage, steps, accumulate, clip):
    global BATCH
    BATCH = 10
    try:
        return _zero_train(rank, world_size, stage, steps, accumulate, clip)
    finally:
        BATCH = 12


def _memory_and_traffic(rank, world_size, stage):
    model = _model()
    zero = ZeRO(model, _optimizer, stage=stage, algorithm="ring")
    tokens, targets = _data(0)
    comm.reset_stats()
    _loss(zero, tokens[:2], targets[:2]).backward()
    after_backward = zero.model_state_bytes()
    with_grad = sum(param.numel() for param in model.parameters() if zero.grads.local_grad(param) is not None) * 8
    zero.step()
    stats = comm.stats()
    sent = {name: entry["bytes_sent"] for name, entry in stats.items()}
    units = []
    for unit in zero.units:
        unit_module = zero._unit_modules[unit.index]
        role = "root" if zero._is_root(unit) else "unused" if unit_module is model.unused else "used"
        units.append((unit.padded * 8, role))
    return {"sent": sent, "memory": zero.model_state_bytes(), "units": units, "with_grad": with_grad,
            "after_backward": after_backward}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_and_traffic_equal_zeros_formulas(stage):
    """After one step, float64 AdamW, N = 4, Ψ = the padded parameter bytes:
    optimizer state 2Ψ/N (Adam's two moments; plus a step count per shard, a scalar
    each), parameters Ψ (stages 1-2, where the shard stepped is a slice of them) or
    none gathered (stage 3: only the Ψ/N master shards), gradients Ψ/N
    (the shards); between the backward and the step, stage 1 holds the full gradients
    of the parameters that got one, stages 2 and 3 only the shards.
    Bytes sent, counted by plait.comm at the transport, ring algorithms: each unit's
    reduce-scatter and each all-gather send (N-1)/N of the unit's bytes: stages 1-2
    one of each per unit, 2Ψ(N-1)/N; stage 3 a gather before the forward and one
    before the backward for each unit the forward used, the root unit (its own and
    the tied parameters) once for the whole step, the unused Linear never:
    3Ψ(N-1)/N less what those two save. Exact: every unit is padded to N shards."""
    n = 4
    results = run_distributed(_memory_and_traffic, n, stage)
    for result in results:
        psi = sum(nbytes for nbytes, _ in result["units"])
        memory = result["memory"]
        assert memory["master_bytes"] == (0 if stage < 3 else psi // n)
        assert psi // n * 2 <= memory["optimizer_bytes"] <= psi // n * 2 + 8 * len(result["units"])
        assert memory["params_bytes"] == (psi if stage < 3 else 0)  # stage 3: every unit freed
        assert memory["grads_bytes"] == psi // n
        held = result["after_backward"]["grads_bytes"]
        assert held == (result["with_grad"] if stage == 1 else psi // n)
        gathers = {"root": 1, "used": 2, "unused": 0} if stage == 3 else {"root": 1, "used": 1, "unused": 1}
        assert result["sent"]["reduce_scatter"] == psi * (n - 1) // n
        assert result["sent"]["all_gather"] == sum(nbytes * gathers[role] for nbytes, role in result["units"]) \
            * (n - 1) // n
        if stage < 3:
            assert result["sent"]["reduce_scatter"] + result["sent"]["all_gather"] == 2 * psi * (n - 1) // n


def _bad_use(rank, world_size):
    errors = []
    model = _model()
    for call in (lambda: ZeRO(model, _optimizer, stage=4),
                 lambda: ZeRO(model, lambda params: torch.optim.LBFGS(params), stage=1),
                 lambda: ZeRO(model, torch.optim.AdamW(nn.Linear(2, 2).parameters()), stage=1)):
        try:
            call()
        except ValueError as error:
            errors.append(str(error))
    zero = ZeRO(_model(), _optimizer, stage=2)
    try:
        zero.step()
    except RuntimeError as error:
        errors.append(str(error))
    try:
        zero.load_full_state_dict({"embed.weight": torch.zeros(VOCAB, 7)})
    except ValueError as error:
        errors.append(str(error))
    zero.module.extra = nn.Linear(2, 2).double()
    try:
        zero(_data(0)[0])
    except RuntimeError as error:
        errors.append(str(error))
    try:
        ZeRO(FunctionalNorm(), _optimizer, stage=3)(torch.ones(2, 4))
    except RuntimeError as error:
        errors.append(str(error))
    return errors


class FunctionalNorm(nn.Module):
    """Uses its child's parameters without calling the child: a unit under the
    default wrap whose parameters are freed when the parent reads them."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return nn.functional.layer_norm(self.linear(x), (4,), self.norm.weight, self.norm.bias)


@pytest.mark.slow
def test_bad_use_is_named():
    errors = run_distributed(_bad_use, 2)[0]
    assert "stage=4 must be 1, 2 or 3" in errors[0]
    assert "LBFGS is not an element-wise optimizer" in errors[1]
    assert "holds 2 tensors that are not the wrapped module's parameters" in errors[2]  # (over its own: accepted)
    assert "step() without a backward" in errors[3]
    assert "missing ['blocks.0.0.bias'" in errors[4]
    assert "parameters were added, removed or resized after wrapping" in errors[5]
    assert "used a parameter of a unit outside that unit's forward" in errors[6]
    assert "must not be a unit: give wrap= a policy" in errors[6]


def test_default_wrap_looks_inside_containers():
    model = TiedNet()
    units = default_wrap(model)
    assert units == [model.embed, model.blocks[0][0], model.blocks[0][2], model.blocks[1][0], model.blocks[1][2],
                     model.norm, model.head, model.unused]


def _different_models(rank, world_size):
    torch.manual_seed(rank)
    try:
        ZeRO(TiedNet().double(), _optimizer, stage=1)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_ranks_with_different_models_are_named_at_wrap():
    for message in run_distributed(_different_models, 2):
        assert "parameter values differ from rank 0's on ranks [1]" in message


class SmallResNet(nn.Module):
    """A model from outside plait: a stem, one residual block with BatchNorm (buffers
    that DDP and ZeRO both broadcast from rank 0 before each forward), a classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                                   nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6))
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.fc(x.mean(dim=(2, 3)))


def _zero_against_ddp(rank, world_size, stage):
    torch.manual_seed(0)
    model = SmallResNet().double()
    reference = torch.nn.parallel.DistributedDataParallel(SmallResNet().double())
    reference.module.load_state_dict(model.state_dict())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    zero = ZeRO(model, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), stage=stage)
    for step in range(3):
        generator = torch.Generator().manual_seed(step * 10 + rank)
        images = torch.randn(4, 3, 8, 8, generator=generator, dtype=torch.float64)
        labels = torch.randint(0, 5, (4,), generator=generator)
        for wrapped, optimizer in ((reference, reference_optimizer), (zero, None)):
            nn.functional.cross_entropy(wrapped(images), labels).backward()
            if optimizer is None:
                zero.step()
                zero.zero_grad()
            else:
                optimizer.step()
                optimizer.zero_grad()
    want = reference.module.state_dict()
    got = zero.full_state_dict()
    return max(float((got[name].double() - want[name].double()).abs().max()) for name in want)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_resnet_from_outside_plait_trains_as_under_ddp(stage):
    """Float64, 3 SGD-momentum steps on 3 ranks: the same parameters and BatchNorm
    statistics as torch's DistributedDataParallel, within 1e-12 (the two average the
    same gradients in another order: roundoff, as in the module docstring)."""
    assert max(run_distributed(_zero_against_ddp, 3, stage)) <= 1e-12


def _mixed_precision(rank, world_size, stage):
    """bf16 autocast over float32 weights (plait's mixed precision): ZeRO and plait's
    DataParallel see the same per-rank batch, so the same bf16 forward and backward."""
    results = []
    for kind in ("dataparallel", "zero"):
        torch.manual_seed(0)
        model = TiedNet()
        if kind == "zero":
            wrapped = ZeRO(model, _optimizer, stage=stage)
            step, clear = wrapped.step, wrapped.zero_grad
        else:
            wrapped = DataParallel(model)
            optimizer = _optimizer(wrapped.parameters())
            step, clear = optimizer.step, optimizer.zero_grad
        for index in range(3):
            tokens, targets = _data(index)
            mine = slice(rank * 6, rank * 6 + 6)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = wrapped(tokens[mine])
            assert logits.dtype == torch.bfloat16  # the head's matmul ran in bf16
            nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets[mine].reshape(-1)).backward()
            step()
            clear()
        results.append(wrapped.full_state_dict() if kind == "zero" else
                       {name: value.clone() for name, value in model.state_dict().items()})
    return results


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_trains_as_data_parallel(stage):
    """Under bf16 autocast with float32 master weights, N = 2, 3 AdamW steps: bitwise
    equal to plait's DataParallel. Each rank runs the same bf16 forward and backward
    on the same rows either way; the float32 gradients are averaged as (a + b) / 2 by
    both (one addition, a division by 2 that is exact), and AdamW steps each element
    alone. The Linear no forward uses is left out: DataParallel gives it a zero
    gradient (so weight decay moves it), ZeRO leaves it as torch's optimizers leave a
    parameter without one (the float64 tests above check that against one process)."""
    for reference, zero in run_distributed(_mixed_precision, 2, stage):
        for name, value in reference.items():
            if not name.startswith("unused."):
                assert torch.equal(zero[name], value), name


def _dies_mid_step(rank, world_size, stage):
    comm.init_communicator(None, comm.CommConfig(timeout_s=10.0))
    zero = ZeRO(_model(), _optimizer, stage=stage)
    tokens, targets = _data(0)
    loss = _loss(zero, tokens[rank::world_size], targets[rank::world_size])
    if rank == 2:
        dist.destroy_process_group()  # its connections close, as when a process dies
        time.sleep(2.0)
        return None
    start = time.monotonic()
    try:
        loss.backward()
        zero.step()
    except comm.CommError as error:
        return str(error), time.monotonic() - start
    return "no error", 0.0


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_rank_dying_mid_step_is_named(stage):
    results = run_fresh_world(_dies_mid_step, 3, stage, timeout_s=90)
    for rank in (0, 1):
        message, elapsed_s = results[rank]
        assert f"rank {rank}" in message and "peer 2" in message, message
        assert elapsed_s < 10.5  # the closed connection or the 10 s deadline, never a hang


def _stage3_peak(rank, world_size):
    zero = ZeRO(_model(), _optimizer, stage=3)
    peak = [0]

    def sample(tensor):
        peak[0] = max(peak[0], zero.model_state_bytes()["params_bytes"])
        return tensor

    tokens, targets = _data(0)
    for _ in range(2):  # the second step prefetches in the first one's order
        with torch.autograd.graph.saved_tensors_hooks(sample, sample):
            _loss(zero, tokens[:4], targets[:4]).backward()
        zero.step()
        zero.zero_grad()
    units = {("root" if zero._is_root(unit) else f"unit{unit.index}"): unit.padded * 8 for unit in zero.units}
    return peak[0], units


@pytest.mark.slow
def test_stage_three_holds_at_most_the_computing_unit_and_the_prefetched_one():
    """Peak bytes of gathered parameter buffers during forward and backward (sampled,
    from live storages, whenever autograd saves or reads a tensor): the root unit (its
    own and the tied parameters, gathered for the whole step) plus at most two units
    (the one computing and the one being prefetched), never every unit at once."""
    for peak, units in run_distributed(_stage3_peak, 2):
        others = sorted((nbytes for name, nbytes in units.items() if name != "root"), reverse=True)
        assert units["root"] + others[0] <= peak <= units["root"] + others[0] + others[1]
        assert peak < sum(units.values())


def _rank0_state(rank, world_size, stage):
    trained = _zero_train(rank, world_size, stage, 1, 1, None)  # every rank: the whole state
    zero = ZeRO(_model(), _optimizer, stage=stage)
    mine = ZeRO(_model(), _optimizer, stage=stage)
    mine.load_full_state_dict(trained)
    only_rank0 = mine.full_state_dict(rank0_only=True)
    zero.load_full_state_dict(only_rank0 if rank == 0 else None, from_rank0=True)
    errors = []
    for bad in ({**trained, "embed.weight": torch.zeros(3, 7, dtype=torch.float64)}, ["not", "a", "dict"]):
        try:
            zero.load_full_state_dict(bad if rank == 0 else None, from_rank0=True)
        except ValueError as error:
            errors.append(str(error))
    return trained, only_rank0, zero.full_state_dict(), errors


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_full_state_dicts_on_rank_zero_only(stage):
    """full_state_dict(rank0_only=True) gives the state on rank 0 and {} elsewhere;
    load_full_state_dict(from_rank0=True) loads rank 0's into every rank (the others
    pass None); a bad dict on rank 0 is named on every rank, no rank left waiting."""
    for rank, (trained, only_rank0, loaded, errors) in enumerate(run_distributed(_rank0_state, 3, stage)):
        assert (only_rank0 == {}) == (rank != 0)
        for name, value in trained.items():
            assert torch.equal(loaded[name], value), name
            if rank == 0:
                assert torch.equal(only_rank0[name], value), name
        assert "embed.weight (3, 7) (the model's: (11, 7))" in errors[0]
        assert "needs a dict of tensors, got list" in errors[1]
