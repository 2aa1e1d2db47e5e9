"""The Communicator is the handle: every wrapper given one runs on it, and a bare group
means its own communicator, created with the program's stated config.

Observed independently of what the wrappers report: the Communicator's own counters
(``stats()``: calls per collective and the algorithm each ran) and the deadline a
point-to-point message carries. The config overrides the algorithms (the default
table would pick star, Bruck, direct or a tree for these small calls), so a call that
ran on another communicator shows up as a missing or different algorithm."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import plait.comm as comm
from plait.comm.communicator import REGISTRY
from plait.testing import run_fresh_world

RING = {"all_reduce": "ring", "all_gather": "ring", "reduce_scatter": "ring", "broadcast": "ring"}
TIMEOUT_S = 77.0


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _algorithms(communicator) -> dict:
    """collective -> the algorithms it ran on ``communicator`` (and how often)."""
    return {name: dict(entry["algorithms"]) for name, entry in communicator.stats().items()}


def _unregistered_communicator():
    """A Communicator of a new group that no registry knows: only a wrapper that uses the
    object it was given can reach it."""
    group = dist.new_group([0, 1])
    communicator = comm.Communicator(group, comm.CommConfig(timeout_s=TIMEOUT_S, algorithms=RING))
    communicator.created.wait()
    return group, communicator


def wrappers_on_a_communicator(rank, world_size):
    from plait.parallel import DataParallel, ParameterServer, ShardedOptimizer, ZeRO
    from plait.parallel.pipeline.engine import PipelineEngine
    from plait.parallel.pipeline.schedules import one_f_one_b
    from plait.parallel.tensor import TensorParallel
    from plait.parallel.tensor.mappings import all_reduced_copy

    seen = {}
    inputs = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))

    def check(name, build_and_run):
        group, communicator = _unregistered_communicator()
        build_and_run(communicator)
        communicator.synchronize()
        seen[name] = {"algorithms": _algorithms(communicator), "registry": REGISTRY.lookup(group) is not None}

    def data_parallel(communicator):
        model = DataParallel(_model(), group=communicator)
        model(inputs).sum().backward()

    def zero3(communicator):
        model = ZeRO(_model(), lambda params: torch.optim.SGD(params, lr=0.1), stage=3, group=communicator)
        model(inputs).sum().backward()
        model.step()

    def sharded_optimizer(communicator):
        model = _model()
        optimizer = ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator)
        model(inputs).sum().backward()
        optimizer.reduce_gradients()  # the trainer's order: reduce, (clip,) step
        optimizer.step()

    def parameter_server(communicator):
        server = ParameterServer(_model(), lambda params: torch.optim.SGD(params, lr=0.1), group=communicator)
        seen["parameter_server_timeout_s"] = server.timeout_s

    def pipeline(communicator):
        torch.manual_seed(0)
        stages = [nn.Linear(6, 6), nn.Linear(6, 3)]
        engine = PipelineEngine(one_f_one_b(2, 2), {rank: stages[rank]}, F.mse_loss, group=communicator,
                                timeout_s=60)
        engine.train_step(inputs, torch.zeros(4, 3))

    def tensor_parallel(communicator):
        all_reduced_copy(torch.ones(3), TensorParallel(group=communicator))

    def p2p(communicator):
        before = communicator.transport.messages_sent
        message = (comm.isend(torch.ones(2), group=communicator, group_dst=1) if rank == 0
                   else comm.irecv(torch.zeros(2), group=communicator, group_src=0))
        message.wait()
        seen["p2p_timeout_s"] = message.timeout_s
        seen["p2p_messages"] = communicator.transport.messages_sent - before

    for name, run in (("DataParallel", data_parallel), ("ZeRO", zero3), ("ShardedOptimizer", sharded_optimizer),
                      ("ParameterServer", parameter_server), ("PipelineEngine", pipeline),
                      ("TensorParallel", tensor_parallel), ("p2p", p2p)):
        check(name, run)
    return seen


@pytest.mark.slow
def test_every_wrapper_given_a_communicator_runs_on_it():
    for rank, seen in enumerate(run_fresh_world(wrappers_on_a_communicator, 2, timeout_s=240)):
        for name in ("DataParallel", "ZeRO", "ShardedOptimizer", "ParameterServer", "PipelineEngine",
                     "TensorParallel", "p2p"):
            assert not seen[name]["registry"], (name, "created a second communicator for the group")
        assert seen["DataParallel"]["algorithms"]["all_reduce"] == {"ring": 1}
        assert seen["ZeRO"]["algorithms"]["all_gather"].get("ring", 0) >= 2  # forward and backward gathers
        assert seen["ZeRO"]["algorithms"]["reduce_scatter"].get("ring", 0) >= 1
        assert seen["ShardedOptimizer"]["algorithms"]["reduce_scatter"].get("ring", 0) >= 1
        assert seen["ShardedOptimizer"]["algorithms"]["all_gather"].get("ring", 0) >= 1
        assert sum(seen["ParameterServer"]["algorithms"]["broadcast"].values()) >= 1  # small: in the agreement
        assert seen["parameter_server_timeout_s"] == TIMEOUT_S
        assert seen["PipelineEngine"]["algorithms"]["all_reduce"] == {"ring": 1}  # the step's loss
        assert seen["TensorParallel"]["algorithms"]["all_reduce"] == {"ring": 1}
        assert seen["p2p_timeout_s"] == TIMEOUT_S
        if rank == 0:
            assert seen["p2p_messages"] == 1  # through the communicator's own transport


def bare_groups_use_the_stated_config(rank, world_size):
    from plait.parallel import DataParallel

    comm.init_communicator(None, comm.CommConfig(timeout_s=TIMEOUT_S, algorithms=RING, hierarchy="1x2"))
    seen = {}
    group = dist.new_group([0, 1])  # no communicator of its own: made on first use
    comm.all_reduce(torch.ones(3), group=group)
    communicator = comm.communicator_for(group)
    seen["collective"] = (communicator.config.timeout_s, _algorithms(communicator)["all_reduce"],
                          communicator.config.hierarchy)
    wrapped = dist.new_group([0, 1])
    model = DataParallel(_model(), group=wrapped)
    model(torch.ones(2, 6)).sum().backward()
    communicator = comm.communicator_for(wrapped)
    communicator.synchronize()
    seen["DataParallel"] = (communicator.config.timeout_s, _algorithms(communicator)["all_reduce"])
    pair = dist.new_group([0, 1])  # point-to-point creates no communicator: its deadline is the stated one
    message = (comm.isend(torch.ones(2), group=pair, group_dst=1) if rank == 0
               else comm.irecv(torch.zeros(2), group=pair, group_src=0))
    message.wait()
    seen["p2p"] = message.timeout_s
    return seen


@pytest.mark.slow
def test_a_bare_group_means_its_communicator_made_with_the_stated_config():
    for seen in run_fresh_world(bare_groups_use_the_stated_config, 2, timeout_s=180):
        assert seen["collective"] == (TIMEOUT_S, {"ring": 1}, None)  # the world's hierarchy names the world's ranks
        assert seen["DataParallel"] == (TIMEOUT_S, {"ring": 1})
        assert seen["p2p"] == TIMEOUT_S


class _LooksLikeACommunicator:
    """Has a Communicator's attributes but is not one."""

    def __init__(self):
        self.waited = False
        self.transport, self.created, self.group, self.config = object(), self, None, None

    def wait(self):
        self.waited = True


def test_p2p_does_not_take_a_look_alike_for_a_communicator():
    fake = _LooksLikeACommunicator()
    with pytest.raises(TypeError, match="group="):
        comm.isend(torch.ones(1), 1, group=fake)
    assert not fake.waited
