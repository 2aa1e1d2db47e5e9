"""The split backward's B and W (plait.parallel.pipeline.split_backward), one process:
the same gradients, bitwise, as B then a plain backward for W; W's work only the
weight-gradient half (counted in FLOPs, not timed); the fall-back where replaying
a node would count a weight twice."""

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from plait.parallel.pipeline.split_backward import boundary_plan, input_backward, weight_backward
from torch.autograd.graph import get_gradient_edge


def _mlp(layers=4, width=16):
    torch.manual_seed(0)
    return nn.Sequential(*[module for _ in range(layers) for module in (nn.Linear(width, width), nn.Tanh())])


class TwiceOnThePath(nn.Module):
    """The same Linear applied twice along the path: its node's weight branch and its
    input-path child reach one weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(torch.tanh(self.linear(x))))


class GatedByAWeight(nn.Module):
    """x * sigmoid(g): the weight's own ops (sigmoid) lie off the input path."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.gate = nn.Parameter(torch.randn(8))
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x) * torch.sigmoid(self.gate)


def _grads(module, x, grad, split: bool):
    """(input gradient, parameter gradients) after B then W; ``split``: W from B's
    captures, else the plain backward."""
    module.zero_grad(set_to_none=True)
    stage_input = x.detach().clone().requires_grad_(True)
    out = module(stage_input)
    params = [param for param in module.parameters() if param.requires_grad]
    if split:
        deferred = input_backward(out, grad, stage_input, params)
    else:
        deferred = None
        torch.autograd.backward(out, grad, inputs=[stage_input], retain_graph=True)
    weight_backward(out, grad, deferred, params)
    return stage_input.grad, [param.grad for param in params], deferred


def _assert_same(module, x, grad):
    plain_input, plain_params, _ = _grads(module, x, grad, split=False)
    split_input, split_params, deferred = _grads(module, x, grad, split=True)
    assert torch.equal(plain_input, split_input)
    assert len(plain_params) == len(split_params)
    for plain, split in zip(plain_params, split_params):
        assert torch.equal(plain, split)
    return deferred


def test_an_mlp_gets_the_plain_gradients_bitwise_from_one_replay_per_linear():
    module = _mlp()
    x, grad = torch.randn(5, 16), torch.randn(5, 16)
    deferred = _assert_same(module, x, grad)
    assert deferred is not None and len(deferred.nodes) == 4  # one AddmmBackward per Linear
    assert [len(params) for params in deferred.params] == [2, 2, 2, 2]  # its weight and bias


def test_two_micro_batches_accumulate_as_the_plain_backward_does():
    module = _mlp(layers=3, width=8).double()
    xs, grads = torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)
    results = []
    for split in (False, True):
        module.zero_grad(set_to_none=True)
        kept = []
        params = list(module.parameters())
        for x, grad in zip(xs, grads):  # both Bs, then both Ws (zero bubble defers W)
            stage_input = x.clone().requires_grad_(True)
            out = module(stage_input)
            if split:
                kept.append((out, grad, input_backward(out, grad, stage_input, params)))
            else:
                torch.autograd.backward(out, grad, inputs=[stage_input], retain_graph=True)
                kept.append((out, grad, None))
        for out, grad, deferred in kept:
            weight_backward(out, grad, deferred, params)
        results.append([param.grad.clone() for param in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_w_does_only_the_weight_gradient_work():
    module = _mlp(layers=4, width=32)
    x, grad = torch.randn(64, 32), torch.randn(64, 32)
    params = list(module.parameters())
    flops = {}
    for split in (False, True):
        stage_input = x.clone().requires_grad_(True)
        out = module(stage_input)
        deferred = input_backward(out, grad, stage_input, params) if split else None
        if not split:
            torch.autograd.backward(out, grad, inputs=[stage_input], retain_graph=True)
        with FlopCounterMode(display=False) as counter:
            weight_backward(out, grad, deferred, params)
        flops[split] = counter.get_total_flops()
    per_matmul = 2 * 64 * 32 * 32
    assert flops[True] == 4 * per_matmul  # dW of each layer
    assert flops[False] == 7 * per_matmul  # dW of each layer, and dX again for layers 2-4


def test_a_weight_used_twice_on_the_path_falls_back_to_the_plain_backward():
    module = TwiceOnThePath()
    x, grad = torch.randn(3, 8), torch.randn(3, 8)
    stage_input = x.clone().requires_grad_(True)
    out = module(stage_input)
    params = list(module.parameters())
    assert boundary_plan(out.grad_fn, get_gradient_edge(stage_input).node, params) is None
    assert _assert_same(module, x, grad) is None


def test_a_weight_whose_own_ops_lie_off_the_path():
    module = GatedByAWeight()
    deferred = _assert_same(module, torch.randn(3, 8), torch.randn(3, 8))
    assert deferred is not None
    assert sorted(len(params) for params in deferred.params) == [1, 2]  # the gate; the Linear's weight and bias


def test_frozen_parameters_get_no_gradient():
    module = _mlp(layers=2, width=8)
    module[0].weight.requires_grad_(False)
    _, params, deferred = _grads(module, torch.randn(2, 8), torch.randn(2, 8), split=True)
    assert module[0].weight.grad is None and all(grad is not None for grad in params)
    _assert_same(module, torch.randn(2, 8), torch.randn(2, 8))
