"""Every ``group=`` of plait takes a torch ``DeviceMesh`` as torch users pass one: a 1-D
mesh (``init_device_mesh("cpu", (4,))``) or one named dimension of a larger one
(``mesh["dp"]`` of a 2 x 2 ``("dp", "tp")`` mesh), meaning its process group. On a world
of 4 gloo ranks, each public entry (collectives, list collectives, p2p, the DDP comm
hook, DataParallel, ZeRO, ShardedOptimizer, TensorParallel's layers, PipelineEngine,
ParameterServer) run with the mesh gives bit for bit what it gives with the process
group (the mesh resolves to that group's own communicator, so the same algorithm runs
on the same bytes: tolerance 0). A mesh of two dimensions passed whole, and plait's own
per-axis ``plait.parallel.mesh.DeviceMesh``, are refused by name with the fix, and so
are torch's functional-collective ``(mesh, dim)`` pair and a DTensor given to a
collective (it hung: plait ran on some ranks' local shards and DTensor's dispatch on
others).

Before issue 33 every one of these failed ("Group DeviceMesh(...) is not registered",
or a TypeError asking for ``mesh.get_group()``)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.testing import run_distributed


def _model(width: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3)).double()


def _inputs(rank: int, rows: int = 4):
    generator = torch.Generator().manual_seed(rank)
    return (torch.randn(rows, 4, dtype=torch.float64, generator=generator),
            torch.randint(0, 3, (rows,), generator=generator))


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [param.detach().clone() for param in module.parameters()]


def _error(call) -> str:
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def _collectives(group, rank):
    """A sample of the collectives, list collectives and a p2p exchange on ``group``."""
    from plait import comm
    from plait.comm.communicator import process_group

    import torch.distributed as dist

    pg = process_group(group)
    size, me = dist.get_world_size(pg), dist.get_rank(pg)
    ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size()))
    out = {}
    x = torch.arange(6, dtype=torch.float64) * (rank + 1)
    comm.all_reduce(x, group=group)
    out["all_reduce"] = x
    gathered = torch.empty(3 * size, dtype=torch.float64)
    comm.all_gather_into_tensor(gathered, torch.full((3,), float(rank), dtype=torch.float64), group=group)
    out["all_gather_into_tensor"] = gathered
    scattered = torch.empty(2, dtype=torch.float64)
    comm.reduce_scatter_tensor(scattered, torch.arange(2.0 * size, dtype=torch.float64) + rank, group=group)
    out["reduce_scatter_tensor"] = scattered
    y = torch.full((2,), float(rank), dtype=torch.float64)
    comm.broadcast(y, src=ranks[-1], group=group)
    out["broadcast"] = y
    parts = [torch.empty(2, dtype=torch.float64) for _ in range(size)]
    comm.all_gather(parts, torch.full((2,), rank + 0.5, dtype=torch.float64), group=group)
    out["all_gather"] = torch.cat(parts)
    comm.barrier(group=group)
    # p2p: every rank sends to the next group rank and receives from the previous one
    received = torch.empty(2, dtype=torch.float64)
    sent = comm.isend(torch.full((2,), float(rank), dtype=torch.float64), group=group, group_dst=(me + 1) % size)
    source = comm.recv(received, group=group, group_src=(me - 1) % size)
    sent.wait()
    out["p2p"] = torch.cat([received, torch.tensor([float(source)], dtype=torch.float64)])
    return out


def _train_data_parallel(group, rank):
    from plait.parallel import DataParallel

    model = DataParallel(_model(), group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        inputs, targets = _inputs(10 * step + rank)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    return model, _params(model)


def _train_zero(group, rank):
    from plait.parallel import ZeRO

    model = ZeRO(_model(), lambda params: torch.optim.SGD(params, lr=0.1), stage=3, group=group)
    inputs, targets = _inputs(rank)
    F.cross_entropy(model(inputs), targets).backward()
    model.step()
    return model, list(model.full_state_dict().values())


def _train_sharded_optimizer(group, rank):
    from plait.parallel import ShardedOptimizer

    model = _model()
    sharded = ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group, stage=1)
    sharded.begin_step()
    inputs, targets = _inputs(rank)
    F.cross_entropy(model(inputs), targets).backward()
    sharded.reduce_gradients()
    sharded.step()
    return sharded, _params(model)


def _tensor_parallel(group, rank):
    from plait.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TensorParallel

    tp = TensorParallel(group=group)
    up = ColumnParallelLinear(4, 8, tp, dtype=torch.float64)
    down = RowParallelLinear(8, 4, tp, dtype=torch.float64)
    x = torch.randn(3, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))  # (s, b, h), replicated
    down(torch.tanh(up(x))).pow(2).sum().backward()
    return tp, [up.weight.grad, down.weight.grad, down(torch.tanh(up(x))).detach()]


def _pipeline(group, rank):
    from plait.comm.communicator import process_group
    from plait.parallel.pipeline import build
    from plait.parallel.pipeline.engine import PipelineEngine

    import torch.distributed as dist

    stage = dist.get_rank(process_group(group))
    chunks = [nn.Sequential(*list(_model())[:2]), nn.Sequential(*list(_model())[2:])]
    engine = PipelineEngine(build("1f1b", 2, 2), {stage: chunks[stage]}, F.cross_entropy, group=group, timeout_s=60)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    inputs, targets = _inputs(7)
    loss = engine.train_step(inputs, targets, optimizer)
    return engine, [torch.tensor([loss], dtype=torch.float64)] + _params(chunks[stage])


def _parameter_server(group, rank):
    from plait.parallel import ParameterServer

    model = _model()
    ps = ParameterServer(model, lambda params: torch.optim.SGD(params, lr=0.1), group=group)

    def train(ps):
        inputs, targets = _inputs(rank)
        ps.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        ps.step()
        return _params(model)

    result = ps.run(train)
    return ps, result if not ps.is_server else list(ps.server_parameters().values())


def _ddp_hook(group, rank):
    from torch.nn.parallel import DistributedDataParallel

    from plait.comm import ddp_comm_hook
    from plait.comm.communicator import process_group

    model = DistributedDataParallel(_model(), process_group=process_group(group))
    model.register_comm_hook(*ddp_comm_hook(group=group))
    inputs, targets = _inputs(rank)
    F.cross_entropy(model(inputs), targets).backward()
    return None, [param.grad.clone() for param in model.parameters()]


def _every_entry(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from plait import comm
    from plait.comm.communicator import communicator_for
    from plait.parallel import DataParallel
    from plait.parallel.mesh import DeviceMesh as PlaitMesh
    from plait.parallel.mesh import ParallelDims
    from plait.parallel.tensor import TensorParallel

    line = init_device_mesh("cpu", (world_size,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = grid["dp"], grid["tp"]
    out = {"same communicator": [communicator_for(line) is communicator_for(None),
                                 communicator_for(dp) is communicator_for(dp.get_group()),
                                 communicator_for(tp) is communicator_for(grid.get_group("tp"))]}
    pairs = {"1-D mesh": (line, None), "mesh['dp']": (dp, dp.get_group()), "mesh['tp']": (tp, tp.get_group())}
    compared = {}
    for label, (mesh, group) in pairs.items():
        with_mesh, with_group = _collectives(mesh, rank), _collectives(group, rank)
        for name in with_group:
            compared[f"{name} on {label}"] = ([with_mesh[name]], [with_group[name]])
    wrappers = {"DataParallel": (_train_data_parallel, dp), "ZeRO": (_train_zero, dp),
                "ShardedOptimizer": (_train_sharded_optimizer, dp), "TensorParallel": (_tensor_parallel, tp),
                "PipelineEngine": (_pipeline, tp), "ParameterServer": (_parameter_server, tp),
                "ddp_comm_hook": (_ddp_hook, dp)}
    kept = {}
    for name, (run, mesh) in wrappers.items():
        wrapper, with_mesh = run(mesh, rank)
        _, with_group = run(mesh.get_group(), rank)
        compared[name] = (with_mesh, with_group)
        kept[name] = wrapper
    out["compared"] = compared
    # what a wrapper keeps: .group as given (the mesh), .communicator the process group's own
    out["DataParallel.group is the mesh"] = kept["DataParallel"].group is dp
    out["DataParallel.communicator"] = kept["DataParallel"].communicator is communicator_for(dp.get_group())
    out["ZeRO.communicator"] = kept["ZeRO"].communicator is communicator_for(dp.get_group())
    out["TensorParallel.size"] = kept["TensorParallel"].size
    out["PipelineEngine.group"] = kept["PipelineEngine"].group is tp.get_group()
    # init_communicator(mesh) configures the mesh's process group's communicator, the one group= then means
    made = comm.init_communicator(tp, comm.CommConfig(algorithms={"all_reduce": "ring"}))
    out["init_communicator"] = made is communicator_for(tp.get_group()) is communicator_for(tp)
    # a mesh of ranks 0 and 1 only: on ranks 2 and 3 a collective on it is a no-op, as on a group they are not in
    pair = DeviceMesh("cpu", [0, 1])
    z = torch.full((2,), float(rank + 1), dtype=torch.float64)
    out["outside"] = (comm.all_reduce(z, group=pair), z)
    plait_mesh = PlaitMesh.create(ParallelDims(dp=2, tp=2))
    shard = distribute_tensor(torch.arange(4.0, dtype=torch.float64), tp, [Shard(0)])
    out["refused"] = {
        "all_reduce(group=2-D mesh)": _error(lambda: comm.all_reduce(torch.ones(2), group=grid)),
        "DataParallel(group=2-D mesh)": _error(lambda: DataParallel(_model(), group=grid)),
        "TensorParallel(group=2-D mesh)": _error(lambda: TensorParallel(group=grid)),
        "unnamed 2-D mesh": _error(lambda: comm.all_reduce(torch.ones(2), group=init_device_mesh("cpu", (2, 2)))),
        "all_reduce(group=plait mesh)": _error(lambda: comm.all_reduce(torch.ones(2), group=plait_mesh)),
        "DataParallel(group=plait mesh)": _error(lambda: DataParallel(_model(), group=plait_mesh)),
        "send(group=2-D mesh)": _error(lambda: comm.send(torch.ones(2), group=grid, group_dst=0)),
        "all_reduce(group=(mesh, 0))": _error(lambda: comm.all_reduce(torch.ones(2), group=(grid, 0))),
        "all_reduce(a DTensor)": _error(lambda: comm.all_reduce(shard, group=tp)),
    }
    dist.barrier()
    return out


@pytest.mark.slow
def test_every_group_argument_takes_a_device_mesh():
    for rank, out in enumerate(run_distributed(_every_entry, 4, timeout_s=240)):
        assert out["same communicator"] == [True, True, True]
        for name, (with_mesh, with_group) in out["compared"].items():
            assert len(with_mesh) == len(with_group) and with_mesh, (rank, name)
            for a, b in zip(with_mesh, with_group):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"rank {rank}: {name}")
        assert out["DataParallel.group is the mesh"] and out["DataParallel.communicator"]
        assert out["ZeRO.communicator"] and out["PipelineEngine.group"]
        assert out["TensorParallel.size"] == 2
        assert out["init_communicator"]
        handle, summed = out["outside"]
        assert handle is None
        torch.testing.assert_close(summed, torch.full((2,), 3.0 if rank < 2 else rank + 1.0, dtype=torch.float64))
        refused = out["refused"]
        assert refused["all_reduce(group=2-D mesh)"].startswith("TypeError: group=DeviceMesh(")
        for name in ("all_reduce(group=2-D mesh)", "DataParallel(group=2-D mesh)", "TensorParallel(group=2-D mesh)",
                     "send(group=2-D mesh)"):
            assert "is a 2-D DeviceMesh with dims ('dp', 'tp')" in refused[name], refused[name]
            assert "pass one dimension, e.g. mesh['dp']" in refused[name], refused[name]
        assert refused["DataParallel(group=2-D mesh)"].startswith("TypeError: DataParallel: group=")
        assert "of shape (2, 2)" in refused["unnamed 2-D mesh"] and "mesh.get_group(0)" in refused["unnamed 2-D mesh"]
        assert "(mesh, dim) pair is torch's functional-collective spelling" in refused["all_reduce(group=(mesh, 0))"]
        assert refused["all_reduce(a DTensor)"].startswith("TypeError: all_reduce: tensor is a DTensor ((Shard(dim=0),)")
        assert "pass tensor.to_local() (this rank's shard)" in refused["all_reduce(a DTensor)"]
        for name in ("all_reduce(group=plait mesh)", "DataParallel(group=plait mesh)"):
            assert "is a plait.parallel.mesh.DeviceMesh" in refused[name], refused[name]
            assert "pass one axis's group, e.g. mesh.group['dp']" in refused[name], refused[name]
