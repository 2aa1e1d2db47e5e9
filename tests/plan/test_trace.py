"""describe_layers / describe_module / saved_activation_bytes against hand counts.

Expected numbers come from the math of what each kernel computes and what
autograd saves in eager torch (float64: 8 bytes an element), not from the code.
"""

import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.models.gpt import GPT, GPTConfig
from plait.plan.trace import describe_layers, describe_module, saved_activation_bytes

F64 = torch.float64
BYTES = 8  # float64


def _sample(*shape):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(0))


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# --- matmul layers ------------------------------------------------------------------------------------------------

def test_linear_flops_first_and_later_layer():
    b, n_in, n_out = 5, 3, 7
    first = describe_layers([nn.Linear(n_in, n_out, dtype=F64)], _sample(b, n_in))[0]
    assert first.forward_flops == 2 * b * n_in * n_out
    assert first.backward_flops == 2 * b * n_in * n_out  # dW only: the data batch has no gradient
    assert first.params == n_in * n_out + n_out
    assert (first.forward_kernels, first.backward_kernels) == (1, 2)  # addmm; mm (dW) + sum (db)
    assert first.forward_bytes == 0  # matmul bytes are priced by FLOPs
    assert first.backward_bytes == (b * n_out + n_out) * BYTES  # db = sum over the batch of dY: read dY, write db
    assert (first.input_bytes, first.output_bytes) == (b * n_in * BYTES, b * n_out * BYTES)

    second = describe_layers([nn.Identity(), nn.Linear(n_in, n_out, dtype=F64)], _sample(b, n_in))[1]
    assert second.forward_flops == 2 * b * n_in * n_out
    assert second.backward_flops == 4 * b * n_in * n_out  # dW and dX
    assert second.backward_kernels == 3


def test_mlp_per_layer_costs_and_saved_activations():
    b, n_in, hidden, n_out = 4, 3, 6, 2
    layers = [nn.Linear(n_in, hidden, dtype=F64), nn.ReLU(), nn.Linear(hidden, n_out, dtype=F64)]
    fc1, relu, fc2 = describe_layers(layers, _sample(b, n_in))
    assert [fc1.name, relu.name, fc2.name] == ["0:Linear", "1:ReLU", "2:Linear"]
    assert (fc1.forward_flops, fc1.backward_flops) == (2 * b * n_in * hidden, 2 * b * n_in * hidden)
    assert (relu.forward_flops, relu.backward_flops) == (0, 0)
    assert (fc2.forward_flops, fc2.backward_flops) == (2 * b * hidden * n_out, 4 * b * hidden * n_out)
    assert [fc1.params, relu.params, fc2.params] == [n_in * hidden + hidden, 0, hidden * n_out + n_out]
    # ReLU: forward reads x and writes y; backward threshold_backward reads dY and y, writes dX
    assert (relu.forward_kernels, relu.backward_kernels) == (1, 1)
    assert relu.forward_bytes == 2 * b * hidden * BYTES
    assert relu.backward_bytes == 3 * b * hidden * BYTES
    # Saved for backward:
    # fc1 (input without grad): addmm keeps x for dW = dYᵀx; W would only serve dX, which is not needed.
    # ReLU: keeps its output y (dX = dY·[y > 0]), not its input.
    # fc2 (input with grad): keeps x for dW and Wᵀ for dX; Wᵀ is a view of the parameter, not an activation.
    assert fc1.activation_bytes == b * n_in * BYTES
    assert relu.activation_bytes == b * hidden * BYTES
    assert fc2.activation_bytes == b * hidden * BYTES


def test_cpu_scaled_dot_product_attention_flops():
    b, heads, s, d = 2, 3, 8, 4
    attention = Lambda(lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True))
    cost = describe_layers([nn.Identity(), attention], _sample(b, heads, s, d))[1]
    assert cost.forward_flops == 4 * b * heads * s * s * d  # QKᵀ and PV, 2·s·s·d each per head
    assert cost.backward_flops == 10 * b * heads * s * s * d  # recomputed QKᵀ, dP, dV, dQ, dK
    # saved: x (as q, k and v: one storage), the output and the logsumexp (b, heads, s)
    assert cost.activation_bytes == (2 * b * heads * s * d + b * heads * s) * BYTES


def test_matrix_vector_and_dot_flops():
    m, k = 6, 4
    weight = _sample(m, k)
    matrix_vector = describe_layers([Lambda(lambda x: weight @ x)], _sample(k))[0]
    assert (matrix_vector.forward_flops, matrix_vector.forward_kernels) == (2 * m * k, 1)  # aten.mv
    dot = describe_layers([Lambda(lambda x: x @ x)], _sample(k))[0]
    assert (dot.forward_flops, dot.forward_bytes) == (2 * k, 0)  # aten.dot, a matmul: no bytes


# --- the kernel and byte rule -------------------------------------------------------------------------------------

def test_views_are_not_kernels_and_broadcasts_are_read_once():
    b, h = 4, 5
    copy = describe_layers([Lambda(lambda x: x.unsqueeze(0).transpose(1, 2).contiguous())], _sample(b, h))[0]
    assert copy.forward_kernels == 1  # the clone to (1, h, b); unsqueeze and transpose move no data
    assert copy.forward_bytes == 2 * b * h * BYTES
    bias = _sample(h)
    broadcast = describe_layers([Lambda(lambda x: x + bias.expand(b, h))], _sample(b, h))[0]
    assert broadcast.forward_kernels == 1
    assert broadcast.forward_bytes == (b * h + h + b * h) * BYTES  # the stride-0 bias is read once


# --- linearity in the micro-batch ---------------------------------------------------------------------------------

def test_costs_scale_linearly_with_the_batch():
    # no biases or affine norms: their gradients' writes do not grow with the batch
    torch.manual_seed(0)
    layers = [nn.Linear(6, 10, bias=False, dtype=F64), nn.GELU(), nn.Dropout(0.5), nn.LayerNorm(10,
              elementwise_affine=False, dtype=F64), nn.Linear(10, 4, bias=False, dtype=F64), nn.Softmax(dim=-1)]
    small = describe_layers(layers, _sample(4, 6))
    large = describe_layers(layers, _sample(8, 6))
    for half, full in zip(small, large, strict=True):
        doubled = half.scaled(2)
        for field in ("forward_flops", "backward_flops", "forward_bytes", "backward_bytes", "activation_bytes",
                      "input_bytes", "output_bytes"):
            assert getattr(full, field) == pytest.approx(getattr(doubled, field)), (full.name, field)
        assert (full.forward_kernels, full.backward_kernels, full.params) == \
            (half.forward_kernels, half.backward_kernels, half.params)


# --- the plait GPT --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_gpt_layers_params_and_flops(tied):
    config = GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=50, dtype="float64", tied_head=tied)
    b, s, h, heads, vocab = 3, config.seq_len, config.hidden, config.heads, config.vocab
    model = GPT(config)
    costs = describe_module(model, torch.randint(0, vocab, (b, s)))
    assert len(costs) == config.layers + 2
    assert sum(cost.params for cost in costs) == config.num_parameters()  # a tied weight once, with the embedding
    embedding, *blocks, head = costs
    assert embedding.forward_flops == 0
    for block in blocks:
        # QKV 6bsh², QKᵀ 2bs²h, PV 2bs²h, proj 2bsh², MLP 16bsh² (ffn = 4h); backward dX and dW
        assert block.forward_flops == 24 * b * s * h * h + 4 * b * s * s * h
        assert block.backward_flops == 2 * block.forward_flops
        # saved, in elements of 8 bytes unless said: LN1 input x (sbh) + mean, rstd (2sb); QKV input LN1(x) (sbh);
        # q, k, v: views of the QKV output, its storage once (3sbh); the causal mask (s² bools, 1 byte); softmax
        # output P (b·heads·s², also PV's operand); proj input, the re-laid-out context (sbh); LN2 input (sbh)
        # + 2sb; fc1 input LN2(x) (sbh); GeLU input, the fc1 output (4sbh); fc2 input, GeLU's output (4sbh)
        assert block.activation_bytes == (16 * s * b * h + 4 * s * b + b * heads * s * s) * BYTES + s * s
        assert block.input_bytes == block.output_bytes == s * b * h * BYTES
    assert head.forward_flops == 2 * b * s * h * vocab
    # LN_f input + mean, rstd; the head matmul's input LN_f(x); the weight is a parameter
    assert head.activation_bytes == (2 * s * b * h + 2 * s * b) * BYTES
    assert head.output_bytes == b * s * vocab * BYTES
    assert all(param.grad is None for param in model.parameters())


def test_gpt_with_dropout_is_left_as_found():
    config = GPTConfig(layers=1, hidden=16, heads=2, seq_len=8, vocab=20, dropout=0.1, dtype="float64",
                       tied_head=False)
    model = GPT(config).eval()
    streams = {name: module.calls for name, module in model.named_modules() if hasattr(module, "calls")}
    with_dropout = describe_module(model, torch.randint(0, config.vocab, (2, 8)))  # training mode: masks drawn
    without = describe_module(model, torch.randint(0, config.vocab, (2, 8)), training=False)
    assert {name: module.calls for name, module in model.named_modules() if hasattr(module, "calls")} == streams
    assert not any(module.training for module in model.modules())
    # ConsistentDropout's x·mask saves the mask in x's dtype: the block adds the attention mask and the dropped
    # probabilities PV now reads (2·b·heads·s²) and two residual-branch masks (2sbh); the embedding one mask (sbh)
    b, s, h, heads = 2, 8, config.hidden, config.heads
    assert with_dropout[1].activation_bytes - without[1].activation_bytes == (2 * b * heads * s * s
                                                                              + 2 * s * b * h) * BYTES
    assert with_dropout[0].activation_bytes - without[0].activation_bytes == s * b * h * BYTES
    assert with_dropout[1].forward_flops == without[1].forward_flops


# --- saved_activation_bytes ---------------------------------------------------------------------------------------

def test_saved_activation_bytes_dedups_storages_and_excludes_parameters():
    x = _sample(4, 6).requires_grad_()
    weight = _sample(5, 3).requires_grad_()

    def run():
        base = x.exp()  # saves base, its output
        a, c = base[:, :3], base[:, 3:]
        return F.linear(a * c, weight)  # mul saves a and c (views of base); mm saves a·c and Wᵀ (a view of weight)

    base_nbytes, product_nbytes = 4 * 6 * BYTES, 4 * 3 * BYTES
    assert saved_activation_bytes(run, exclude=[weight]) == base_nbytes + product_nbytes
    assert saved_activation_bytes(run) == base_nbytes + product_nbytes + 5 * 3 * BYTES
    with torch.no_grad():  # measured with gradients on regardless
        assert saved_activation_bytes(run, exclude=[weight]) == base_nbytes + product_nbytes


def test_a_saved_slice_counts_its_whole_storage():
    x = _sample(4, 6).requires_grad_()

    def run():
        half = (x * 3.0)[:, :3]  # mul by a number saves nothing
        return half * half  # saves half twice: one storage, all of x * 3.0 stays allocated

    assert saved_activation_bytes(run) == 4 * 6 * BYTES


def test_meta_device_costs_without_memory():
    # meta storages have no address: they are told apart by storage identity
    b, n_in, n_out = 64, 32, 48
    layers = [nn.Identity(), nn.Linear(n_in, n_out, device="meta"), nn.Tanh()]
    _, linear, tanh = describe_layers(layers, torch.empty(b, n_in, device="meta"))
    assert (linear.forward_flops, linear.backward_flops) == (2 * b * n_in * n_out, 4 * b * n_in * n_out)
    assert linear.activation_bytes == b * n_in * 4  # x; Wᵀ is the parameter's storage
    assert tanh.activation_bytes == b * n_out * 4  # its output
    x = torch.empty(4, 6, device="meta", requires_grad=True)
    assert saved_activation_bytes(lambda: (lambda y: y[:, :3] * y[:, 3:])(x.exp())) == 4 * 6 * 4


def test_saved_activation_bytes_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        saved_activation_bytes(42)
    with pytest.raises(TypeError, match=r"exclude\[1\] is a str"):
        saved_activation_bytes(lambda: None, exclude=[torch.zeros(1), "weight"])


# --- state left as found ------------------------------------------------------------------------------------------

def _hook_state(modules):
    module_hooks = [len(getattr(module, attribute)) for module in modules
                    for attribute in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                      "_backward_pre_hooks")]
    from torch.nn.modules import module as module_module
    global_hooks = [len(getattr(module_module, attribute)) for attribute in
                    ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks")]
    return (module_hooks, global_hooks, torch._C._len_torch_dispatch_stack(),
            torch._C._autograd._top_saved_tensors_default_hooks(False), torch.is_grad_enabled())


class Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


class BoomInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward boom")


@pytest.mark.parametrize("failure", [None, "forward", "backward"])
def test_model_is_left_as_found(failure):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, dtype=F64), nn.BatchNorm1d(4, dtype=F64), nn.Dropout(0.5),
                          nn.Linear(4, 2, dtype=F64))
    model.eval()
    model[2].train()
    old_grad = torch.full((4,), 7.0, dtype=F64)
    model[0].bias.grad = old_grad
    if failure == "forward":
        model.insert(3, Boom())
    if failure == "backward":
        model.insert(3, Lambda(BoomInBackward.apply))
    modes = [module.training for module in model.modules()]
    running_mean = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    hooks = _hook_state(list(model.modules()))

    if failure is None:
        describe_module(model, _sample(5, 3))
    else:
        with pytest.raises(RuntimeError, match="boom") as error:
            describe_module(model, _sample(5, 3))
        if failure == "forward":
            assert any("layers[3]" in note for note in error.value.__notes__)

    assert [module.training for module in model.modules()] == modes
    assert model[0].bias.grad is old_grad and bool((old_grad == 7.0).all())
    assert all(param.grad is None for name, param in model.named_parameters() if name != "0.bias")
    assert torch.equal(model[1].running_mean, running_mean)
    assert torch.equal(torch.get_rng_state(), rng)
    assert _hook_state(list(model.modules())) == hooks == ([0] * len(hooks[0]), [0, 0, 0, 0], 0, None, True)


# --- names and bad input ------------------------------------------------------------------------------------------

def test_names_and_single_module():
    model = nn.Sequential(OrderedDict(fc=nn.Linear(3, 3, dtype=F64), act=nn.Tanh()))
    assert [cost.name for cost in describe_module(model, _sample(2, 3))] == ["fc", "act"]
    frozen = Lambda(nn.Linear(3, 2, dtype=F64)).requires_grad_(False)
    single = describe_module(frozen, _sample(2, 3))
    assert len(single) == 1 and single[0].name == "0:Lambda" and single[0].params == 8
    assert (single[0].backward_kernels, single[0].activation_bytes) == (0, 0)  # nothing needs a gradient
    shared = nn.Linear(3, 3, dtype=F64)
    assert [cost.params for cost in describe_layers([shared, nn.Tanh(), shared], _sample(2, 3))] == [12, 0, 0]


def test_bad_layers():
    with pytest.raises(ValueError, match=r"layers\[1\] \(1:Pair\) returned a tuple"):
        describe_layers([nn.Identity(), type("Pair", (nn.Module,), {"forward": lambda self, x: (x, x)})()],
                        _sample(2, 3))
    with pytest.raises(ValueError, match="empty"):
        describe_layers([], _sample(2, 3))
    with pytest.raises(TypeError, match=r"layers\[1\] is a builtin"):
        describe_layers([nn.Identity(), torch.relu], _sample(2, 3))
    with pytest.raises(TypeError, match="describe_module"):
        describe_layers(nn.Linear(3, 3), _sample(2, 3))
    with pytest.raises(TypeError, match="sample_input"):
        describe_layers([nn.Identity()], [1.0, 2.0])
    assert torch._C._len_torch_dispatch_stack() == 0


def test_importing_trace_does_not_import_torch():
    code = "import sys, plait.plan.trace; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"
