"""Auto-parallel plans executed on real gloo ranks against one process (float64).

A 2-layer MLP on (batch 6, sequence 6, features 6) -> hidden 12 -> 6 classes with a
cross-entropy over every position, under hand-written plans: pure batch (= data
parallelism), Megatron column -> row, row-first (a P output reduce-scattered into a
batch shard), column then gathered (all-gather, then a slice of a tensor with a gradient),
sequence then batch (an all-to-all), on 1-D meshes of 2 and 3 ranks, and
on a 2x2 mesh (batch on axis 0, column/row on axis 1). Every rank builds the
one-process model from the same seed as its oracle and compares the loss, this rank's
shard of every parameter's gradient (its own local gradient, no gather), and after two
optimizer steps (SGD, then Adam) the gathered parameters (full_state_dict).

Tolerances: a sharded matmul sums the same products in another association (p partial
sums added by the all-reduce; a mean split into local sums over a global count), so
values of order 1 built from ~100 products differ by a few ulps: LOSS_GRAD_ATOL = 1e-12
(float64's ulp at 1 is 2.2e-16). After two SGD steps the parameters differ by lr times
that: PARAMS_SGD_ATOL = 1e-12. Adam's step m/(sqrt(v)+eps) divides by sqrt(v) ~ |g|, so
a gradient of size ~1e-4 with a 1e-16 error moves the step by ~1e-12 relative; lr 1e-2:
PARAMS_ADAM_ATOL = 1e-10.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.testing import run_distributed

LOSS_GRAD_ATOL, PARAMS_SGD_ATOL, PARAMS_ADAM_ATOL = 1e-12, 1e-12, 1e-10
BATCH, SEQ, FEATURES, HIDDEN, CLASSES = 6, 6, 6, 12, 6
ONE_D_PLANS = ("batch", "megatron", "row_first", "column_gather", "sequence_then_batch")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y):
        out = self.fc2(F.gelu(self.fc1(x)))
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP().double()


def _batch(step: int):
    generator = torch.Generator().manual_seed(50 + step)
    x = torch.randn(BATCH, SEQ, FEATURES, dtype=torch.float64, generator=generator)
    y = torch.randint(0, CLASSES, (BATCH, SEQ), generator=generator)
    return x, y


def _layouts(plan: dict, ndim: int):
    """{node: (inputs, output, params)} in text ("S0", "R,S1") -> NodeLayouts."""
    from plait.names.placements import parse_layout
    from plait.parallel.auto.execute import NodeLayout

    def lay(text):
        return parse_layout(text) if ndim > 1 else (text,)

    return {name: NodeLayout(tuple(lay(t) for t in inputs), lay(output), tuple((n, lay(t)) for n, t in params))
            for name, (inputs, output, params) in plan.items()}


def mlp_plans(ndim: int) -> dict[str, dict]:
    """Hand-written plans for the MLP graph (node names from the tracer)."""
    w1, b1, w2, b2 = "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"
    if ndim == 2:  # batch on axis 0, Megatron column -> row on axis 1
        return {"batch_x_megatron": {
            "x": ((), "S0,R", ()), "y": ((), "S0,R", ()),
            "linear": (("S0,R",), "S0,S2", ((w1, "R,S0"), (b1, "R,S0"))),
            "gelu": (("S0,S2",), "S0,S2", ()),
            "linear_1": (("S0,S2",), "S0,P", ((w2, "R,S1"), (b2, "R,R"))),
            "reshape": (("S0,R",), "S0,R", ()), "reshape_1": (("S0,R",), "S0,R", ()),
            "cross_entropy_loss": (("S0,R", "S0,R"), "P,R", ())}}
    return {
        "batch": {"x": ((), "S0", ()), "y": ((), "S0", ()),
                  "linear": (("S0",), "S0", ((w1, "R"), (b1, "R"))), "gelu": (("S0",), "S0", ()),
                  "linear_1": (("S0",), "S0", ((w2, "R"), (b2, "R"))),
                  "reshape": (("S0",), "S0", ()), "reshape_1": (("S0",), "S0", ()),
                  "cross_entropy_loss": (("S0", "S0"), "P", ())},
        "megatron": {"x": ((), "R", ()), "y": ((), "R", ()),
                     "linear": (("R",), "S2", ((w1, "S0"), (b1, "S0"))), "gelu": (("S2",), "S2", ()),
                     "linear_1": (("S2",), "P", ((w2, "S1"), (b2, "R"))),
                     "reshape": (("R",), "R", ()), "reshape_1": (("R",), "R", ()),
                     "cross_entropy_loss": (("R", "R"), "R", ())},
        "row_first": {"x": ((), "R", ()), "y": ((), "S0", ()),
                      "linear": (("S2",), "P", ((w1, "S1"), (b1, "R"))), "gelu": (("S0",), "S0", ()),
                      "linear_1": (("S0",), "S0", ((w2, "R"), (b2, "R"))),
                      "reshape": (("S0",), "S0", ()), "reshape_1": (("S0",), "S0", ()),
                      "cross_entropy_loss": (("S0", "S0"), "P", ())},
        "column_gather": {"x": ((), "R", ()), "y": ((), "S0", ()),
                          "linear": (("R",), "S2", ((w1, "S0"), (b1, "S0"))), "gelu": (("S2",), "S2", ()),
                          "linear_1": (("R",), "R", ((w2, "R"), (b2, "R"))),
                          "reshape": (("S0",), "S0", ()), "reshape_1": (("S0",), "S0", ()),
                          "cross_entropy_loss": (("S0", "S0"), "P", ())},
        "sequence_then_batch": {"x": ((), "S1", ()), "y": ((), "S0", ()),
                                "linear": (("S1",), "S1", ((w1, "R"), (b1, "R"))), "gelu": (("S1",), "S1", ()),
                                "linear_1": (("S1",), "S1", ((w2, "R"), (b2, "R"))),
                                "reshape": (("S0",), "S0", ()), "reshape_1": (("S0",), "S0", ()),
                                "cross_entropy_loss": (("S0", "S0"), "P", ())},
    }


COUNTS = ("bytes_sent", "all_reduce_calls", "buckets", "refused")


def parity(model_fn, batch_fn, plans: dict, mesh_shape, adam: tuple = (), simplified: bool = False,
           reshard_path=None, group=None, accumulate: tuple = (), options=None) -> dict:
    """Each plan ({name: layouts}) on this rank, traced once: the errors against the
    one-process model after steps of SGD (and of Adam for the plans in ``adam``), and
    what its axis communicators did in the first step (bytes sent, all-reduce calls)
    with its number of gradient buckets. ``simplified``: the plans name the nodes of
    the simplified graph (as the planner's do); ``reshard_path``: the executor's path of
    layout changes (None: its default order); ``group``: the ranks the mesh lies on
    (None: the world); ``accumulate``: plans whose steps accumulate the gradients of two
    batches (two backward passes) before the optimizer step; ``options``: plan name ->
    AutoParallelModule keywords."""
    from plait.parallel.auto.device_mesh import AutoMesh
    from plait.parallel.auto.execute import AutoParallelModule
    from plait.parallel.auto.trace import simplify, trace_graph

    traced = trace_graph(model_fn(), batch_fn(0))
    graph = simplify(traced.graph) if simplified else traced.graph
    results = {}
    for plan_name, layouts in plans.items():
        errors = results[plan_name] = {}
        for optimizer_name in ("sgd", "adam") if plan_name in adam else ("sgd",):
            reference = model_fn()
            auto = AutoParallelModule(traced, layouts, AutoMesh(tuple(mesh_shape)), graph=graph,
                                      reshard_path=reshard_path, group=group, **(options or {}).get(plan_name, {}))
            make = (lambda params: torch.optim.SGD(params, lr=0.1)) if optimizer_name == "sgd" else \
                (lambda params: torch.optim.Adam(params, lr=1e-2))
            optimizers = [make(auto.parameters()), make(reference.parameters())]
            ref_params = dict(reference.named_parameters())
            micro = 2 if plan_name in accumulate else 1
            for step in range(2):
                auto.reset_comm_stats()
                for optimizer in optimizers:
                    optimizer.zero_grad()
                for part in range(micro):
                    inputs = batch_fn(micro * step + part)
                    loss, ref_loss = auto(*inputs), reference(*inputs)
                    loss.backward()
                    ref_loss.backward()
                    errors[f"{optimizer_name}_loss_{step}_{part}"] = abs(float(loss.detach() - ref_loss.detach()))
                if step == 0 and optimizer_name == "sgd":
                    stats = auto.comm_stats()
                    errors["bytes_sent"] = sum(entry["bytes_sent"] for entry in stats.values())
                    errors["all_reduce_calls"] = stats.get("all_reduce", {}).get("calls", 0)
                    errors["buckets"] = len(auto.gradient_buckets())
                errors[f"{optimizer_name}_grads_{step}"] = max(
                    float((param.grad - auto.reference_shard(ref_params[name].grad, name)).abs().max())
                    for name, param in auto.named_parameters())
                for optimizer in optimizers:
                    optimizer.step()
            full = auto.full_state_dict()
            errors[f"{optimizer_name}_params"] = max(float((full[name] - value).abs().max())
                                                     for name, value in reference.state_dict().items())
    return results


def _mlp_worker(rank: int, world_size: int, mesh_shape, plan_names, adam=(), priced: bool = False,
                halves: bool = False) -> dict:
    """``halves``: the world of 4 as two meshes of ``mesh_shape`` (ranks 0-1 and 2-3),
    each given as a process group."""
    import torch.distributed as dist

    group = None
    if halves:
        group = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    plans = mlp_plans(len(mesh_shape))
    results = parity(_mlp, _batch, {name: _layouts(plans[name], len(mesh_shape)) for name in plan_names}, mesh_shape,
                     adam, group=group)
    if priced:  # the same plans through the planner's cheapest reshard paths (plait.plan.auto.reshard_cost)
        from plait.parallel.auto.device_mesh import AutoMesh
        from plait.plan.auto.reshard_cost import reshard_path
        from plait.plan.cluster import cluster_preset

        mesh, cluster = AutoMesh(tuple(mesh_shape)), cluster_preset("dgx-a100", gpus=world_size)
        priced_plans = parity(_mlp, _batch, {f"{name}_priced": _layouts(plans[name], len(mesh_shape))
                                             for name in plan_names}, mesh_shape,
                              reshard_path=lambda s, d, shape, size: reshard_path(s, d, shape, size, mesh, cluster))
        results.update(priced_plans)
    if "batch" in plan_names and world_size == 2:  # torch.autograd.grad would get the hooks' zeros: refused
        from plait.parallel.auto.device_mesh import AutoMesh
        from plait.parallel.auto.execute import auto_parallelize

        auto = auto_parallelize(_mlp(), _batch(0), _layouts(plans["batch"], 1), AutoMesh((2,)), simplify=False)
        try:
            torch.autograd.grad(auto(*_batch(0)), list(auto.parameters()))
            results["batch"]["refused"] = ""
        except RuntimeError as error:
            results["batch"]["refused"] = str(error)
    return results


def _check(results: list[dict]) -> None:
    for rank, plans in enumerate(results):
        for plan, errors in plans.items():
            for key, value in errors.items():
                if key in COUNTS:
                    continue
                limit = PARAMS_ADAM_ATOL if key == "adam_params" else (
                    PARAMS_SGD_ATOL if key.endswith("params") else LOSS_GRAD_ATOL)
                assert value <= limit, f"rank {rank} plan {plan}: {key} = {value:.3e} > {limit:.0e}"


@pytest.mark.slow
def test_mlp_plans_two_ranks():
    """Batch, Megatron, row-first and sequence->batch on 2 ranks equal one process."""
    results = run_distributed(_mlp_worker, 2, (2,), ONE_D_PLANS,
                              adam=("megatron",))
    _check(results)
    # bytes at the transport, per rank, on 2 ranks (every all-reduce algorithm sends n per rank at p = 2):
    # batch: the gradient all-reduce of all 162 parameters + the loss's target count + the loss (8 bytes each);
    # Megatron: one all-reduce of the row-parallel output (6, 6, 6) (x needs no gradient, so f's is not run)
    params = FEATURES * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES
    assert [plans["batch"]["bytes_sent"] for plans in results] == [(params + 2) * 8] * 2
    # ... in 3 all-reduces: ONE bucket of all the parameters' gradients (not one per linear), the count, the loss
    assert [plans["batch"]["all_reduce_calls"] for plans in results] == [3] * 2
    assert all("torch.autograd.grad of a step whose data-parallel gradients are bucketed is not supported"
               in plans["batch"]["refused"] for plans in results)
    assert [plans["megatron"]["bytes_sent"] for plans in results] == [BATCH * SEQ * CLASSES * 8] * 2


@pytest.mark.slow
def test_mlp_plans_three_ranks_and_2x2():
    """The same plans on 3 ranks, batch x Megatron on a 2x2 mesh (also through the
    planner's priced reshard paths), and two 1-D meshes of 2 side by side in a world of 4
    (group=), equal one process."""
    _check(run_distributed(_mlp_worker, 3, (3,), ONE_D_PLANS))
    _check(run_distributed(_mlp_worker, 4, (2, 2), ("batch_x_megatron",), adam=("batch_x_megatron",), priced=True))
    _check(run_distributed(_mlp_worker, 4, (2,), ("megatron", "sequence_then_batch"), halves=True))


@pytest.mark.parametrize("change, named", [
    ({"gelu": None}, "no NodeLayout for nodes ['gelu']"),
    ({"gelu": (("P",), "P", ())}, "node 'gelu' (elementwise, aten.gelu.default) on mesh axis 0: elementwise gelu is not "
                                  "linear"),
    ({"reshape": (("S1",), "S0", ())}, "node 'reshape' (view, aten.reshape.default): inputs [('S1',)] -> output "
                                       "('S0',) moves the wrong elements"),
    ({"linear_1": (("S2",), "P", (("fc2.weight", "S1"), ("fc2.bias", "S0")))}, "node 'linear_1' (linear"),
    ({"linear": (("R",), "S2", (("fc1.weight", "S0"),))}, "lays out parameters ['fc1.weight'], but the node reads"),
])
def test_refused_layouts_are_named_before_any_group(change, named):
    """A plan the executor cannot run exactly is refused naming the node, before any
    process group is made (here there is none)."""
    from plait.parallel.auto.device_mesh import AutoMesh
    from plait.parallel.auto.execute import auto_parallelize

    plan = dict(mlp_plans(1)["megatron"])
    for name, value in change.items():
        if value is None:
            del plan[name]
        else:
            plan[name] = value
    with pytest.raises(ValueError) as error:  # the user's entry point: trace, (no) simplify, check
        auto_parallelize(_mlp(), _batch(0), _layouts(plan, 1), AutoMesh((2,)), simplify=False)
    assert named in str(error.value)


def _planned(mesh_shape, memory_fraction: float, zoo: str = "") -> dict:
    """The planner's layouts for the MLP (or plait.models.auto_zoo's ``zoo`` model, its
    TINY sizes) on ``mesh_shape`` (priced on DGX-A100s in float32) under a memory limit
    of ``memory_fraction`` of the replicated plan's, which forces sharded parameters."""
    from plait.plan.auto.planner import auto_plan
    from plait.plan.cluster import cluster_preset

    model, inputs = (_zoo(zoo), _zoo_batch(zoo, 0)) if zoo else (_mlp(), _batch(0))
    cluster = cluster_preset("dgx-a100", gpus=int(torch.Size(mesh_shape).numel()))
    whole = auto_plan(model, inputs, cluster, mesh_shapes=[tuple(mesh_shape)], dtype="float32")
    plan = auto_plan(model, inputs, cluster, mesh_shapes=[tuple(mesh_shape)], dtype="float32",
                     memory_limit_bytes=whole.cost.memory_bytes * memory_fraction)
    return {name: layout for name, layout in plan.layouts.items() if plan.graph.node(name).kind != "output"}


def _zoo(name: str):
    from plait.models.auto_zoo import TINY, build

    return build(name, **TINY[name], dtype=torch.float64)[0]


def _zoo_batch(name: str, step: int):
    from plait.models.auto_zoo import TINY, build

    return build(name, **TINY[name], dtype=torch.float64, seed=step)[1]


class _Zoo:
    """Picklable model and batch factories of a zoo model (parity's model_fn, batch_fn)."""

    def __init__(self, name: str):
        self.name = name

    def model(self):
        return _zoo(self.name)

    def batch(self, step: int):
        return _zoo_batch(self.name, step)


def _planned_worker(rank: int, world_size: int, mesh_shape, plans: dict, zoo: str = "") -> dict:
    if zoo:
        return parity(_Zoo(zoo).model, _Zoo(zoo).batch, plans, mesh_shape, simplified=True)
    return parity(_mlp, _batch, plans, mesh_shape, simplified=True)


@pytest.mark.slow
def test_planner_plans_run_exactly():
    """The planner's own plans (F's auto_plan on the simplified graph, sharded by a memory
    limit: Megatron-like on 2 ranks; on 2x2 weights sharded over both axes, nested S2
    and partial sums on both axes; the zoo's mixture of experts (a matmul with stacked
    expert weights as its parameter operand) and MLP-Mixer) run equal to one process."""
    for mesh_shape, fractions in (((2,), (0.6,)), ((2, 2), (0.6, 0.4))):
        plans = {f"planned_{fraction}": _planned(mesh_shape, fraction) for fraction in fractions}
        for plan in plans.values():  # the memory limit shards the first linear's weight
            assert "R" not in dict(plan["linear"].params)["fc1.weight"], plan["linear"]
        _check(run_distributed(_planned_worker, int(torch.Size(mesh_shape).numel()), mesh_shape, plans))
    for zoo, mesh_shape in (("moe", (2,)), ("mixer", (2, 2))):
        plans = {f"{zoo}_planned": _planned(mesh_shape, 0.5, zoo)}
        assert any("S" in str(layout.params) for layout in plans[f"{zoo}_planned"].values())
        _check(run_distributed(_planned_worker, int(torch.Size(mesh_shape).numel()), mesh_shape, plans, zoo))
