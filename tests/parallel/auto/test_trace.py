"""plait.parallel.auto.trace: a model's training step as an OpGraph (kinds, params,
shapes, FLOPs against hand counts), Alpa's simplification, refusals by name, and the
traced module computing the model's loss and gradients (float64, 1e-12 relative: the
only difference is the rounding of addmm versus linear's matmul + add)."""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.models.gpt import GPT, GPTConfig
from plait.parallel.auto.trace import dim_groups, simplify, trace_graph
from tests.hf_models import tiny_gpt2


class MLP(nn.Module):
    """x (b, 6) -> Linear(6, 16) -> GELU -> Linear(16, 4, no bias) -> + x @ P^T -> cross-entropy."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16, dtype=torch.float64)
        self.fc2 = nn.Linear(16, 4, bias=False, dtype=torch.float64)
        self.p = nn.Parameter(torch.randn(4, 6, dtype=torch.float64))

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(F.gelu(self.fc1(x))) + x @ self.p.t(), y)


class HFLoss(nn.Module):
    """HF GPT-2 returning the mean next-token cross-entropy (no KV cache)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, targets):
        logits = self.model(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class HFCachedLoss(HFLoss):
    """The same with HF's default use_cache=True: a key/value cache, empty at this first step."""

    def forward(self, ids, targets):
        logits = self.model(input_ids=ids).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPTLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, targets):
        return F.cross_entropy(self.model(ids).reshape(-1, self.model.config.vocab), targets.reshape(-1))


def _kinds(graph):
    return collections.Counter(node.kind for node in graph.nodes)


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    model = HFLoss(tiny_gpt2())
    inputs = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    return model, inputs, trace_graph(model, inputs)


@pytest.fixture(scope="module")
def plait_gpt():
    torch.manual_seed(0)
    model = GPTLoss(GPT(GPTConfig(layers=2, hidden=16, heads=2, seq_len=8, vocab=32, dtype="float64")))
    inputs = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    return model, inputs, trace_graph(model, inputs)


def _close(a, b, rel=1e-12):
    return (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-300)


def test_mlp_kinds_params_flops_shapes():
    torch.manual_seed(0)
    model = MLP()
    inputs = (torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 4, (5,)))
    traced = trace_graph(model, inputs)
    graph = traced.graph
    assert _kinds(graph) == {"input": 2, "linear": 3, "elementwise": 2, "loss": 1, "output": 1}
    fc1, fc2, product = [node for node in graph.nodes if node.kind == "linear"]
    assert fc1.params == ("fc1.weight", "fc1.bias") and fc1.attr("weight_out_dim") == 0
    assert fc1.flops == 2 * 5 * 6 * 16 and fc1.shape == (5, 16) and fc1.dtype == "float64" and fc1.itemsize == 8
    assert fc2.params == ("fc2.weight",) and fc2.attr("bias") is None and fc2.flops == 2 * 5 * 16 * 4
    assert fc2.module == "fc2" and fc1.inputs == ("x",)
    # x @ p.t(): one linear reading p (the t folded in), W as (out, in)
    assert product.params == ("p",) and product.attr("weight_out_dim") == 0 and product.inputs == ("x",)
    assert product.flops == 2 * 5 * 6 * 4 and product.attr("in_features") == 6
    assert [param.name for param in graph.params] == ["p", "fc1.weight", "fc1.bias", "fc2.weight"]  # as named_parameters
    assert graph.param("fc1.weight").shape == (16, 6) and graph.param("p").nbytes == 4 * 6 * 8
    loss = next(node for node in graph.nodes if node.kind == "loss")
    assert loss.attr("reduction") == "mean" and loss.attr("op") == "cross_entropy" and loss.inputs[1] == "y"
    assert graph.output == "output" and graph.node("output").inputs == (loss.name,)


def test_gpt2_kinds_against_hand_counts(gpt2):
    _, _, traced = gpt2
    kinds = _kinds(traced.graph)
    # per block: c_attn, c_proj, c_fc, mlp.c_proj (HF Conv1D addmm -> one linear each), 1 sdpa, 2 LayerNorms;
    # + the tied lm_head linear, ln_f, token + position embeddings, one cross-entropy
    assert kinds["linear"] == 2 * 4 + 1 and kinds["attention"] == 2 and kinds["norm"] == 2 * 2 + 1
    assert kinds["embedding"] == 2 and kinds["loss"] == 1 and kinds["matmul"] == 0
    nodes = {node.module: node for node in traced.graph.nodes if node.kind == "linear"}
    c_fc = nodes["model.transformer.h.1.mlp.c_fc"]
    # Conv1D stores W (in, out): the linear reads it transposed, on (b, s, in) -> (b, s, out), no flatten
    assert c_fc.params == ("model.transformer.h.1.mlp.c_fc.weight", "model.transformer.h.1.mlp.c_fc.bias")
    assert c_fc.attr("weight_out_dim") == 1 and c_fc.shape == (2, 8, 128) and c_fc.flops == 2 * 16 * 32 * 128
    assert traced.graph.node(c_fc.inputs[0]).kind == "norm" and len(c_fc.members) == 2
    head = nodes["model.lm_head"]
    assert head.params == ("model.transformer.wte.weight",) and head.attr("weight_out_dim") == 0  # tied
    attention = next(node for node in traced.graph.nodes if node.kind == "attention")
    assert attention.shape == (2, 4, 8, 8) and attention.flops == 4 * 2 * 4 * 8 * 8 * 8
    assert traced.graph.node(attention.inputs[3]).kind == "constant"  # the causal mask
    # c_attn's split(32, dim=2) into q, k, v: three slices of its (2, 8, 96) output
    c_attn = nodes["model.transformer.h.0.attn.c_attn"]
    parts = sorted((node.attr("start"), node.attr("end"), node.attr("step"), node.attr("sliced_dims"))
                   for node in traced.graph.consumers(c_attn.name))
    assert parts == [(0, 32, 1, (2,)), (32, 64, 1, (2,)), (64, 96, 1, (2,))]
    # the reshape after sdpa to the shape it has is gone (its readers read sdpa)
    graph = traced.graph
    assert not [node.name for node in graph.nodes if node.kind == "view" and node.attr("op") in ("view", "reshape")
                and node.shape == graph.node(node.inputs[0]).shape]
    assert kinds["view"] == 2 * 7 + 2  # 3 slices, 3 head views, 1 merge of heads per block; logits, targets
    # every get_attr names a parameter of the model by its canonical name; the tied head reads wte
    names = {name for name, _ in traced.module.named_parameters()}
    reads = {node.target for node in traced.module.graph.nodes if node.op == "get_attr"}
    assert reads <= names and "model.lm_head.weight" not in reads


def test_gpt2_with_its_empty_cache_traces_the_same(gpt2):
    model, inputs, traced = gpt2
    cached = trace_graph(HFCachedLoss(model.model), inputs)
    # cat(empty cache, k) is k: no cat, the same operators as without the cache
    assert not [node for node in cached.module.graph.nodes if node.target is torch.ops.aten.cat.default]
    plain = {kind: count for kind, count in _kinds(traced.graph).items() if kind != "constant"}
    assert {kind: count for kind, count in _kinds(cached.graph).items() if kind != "constant"} == plain
    assert _close(cached.module(*inputs).detach(), model(*inputs).detach())


def test_plait_gpt_kinds_and_folded_position(plait_gpt):
    _, _, traced = plait_gpt
    kinds = _kinds(traced.graph)
    # per block: qkv, proj, fc1, fc2 linears; QK^T and PV matmuls; one softmax; 2 LayerNorms; + tied head, ln_f
    assert kinds["linear"] == 9 and kinds["matmul"] == 4 and kinds["softmax"] == 2 and kinds["norm"] == 5
    assert kinds["embedding"] == 1 and kinds["attention"] == 0
    # x + position[:s].unsqueeze(1): an elementwise add reading the parameter through a folded slice + unsqueeze
    add = next(node for node in traced.graph.nodes if "model.position" in node.params)
    assert add.kind == "elementwise" and len(add.members) == 3
    assert add.attr("param_operands") == (("model.position", (8, 1, 16), (0, -1, 1), ()),)
    scores = next(node for node in traced.graph.nodes if node.kind == "matmul")
    assert scores.shape == (2, 2, 8, 8) and scores.flops == 2 * 4 * 8 * 8 * 8 and scores.attr("param_side") is None


def test_random_ops_are_listed():
    # nn.Dropout draws in the op; plait's ConsistentDropout draws a whole mask (a constant) from a seeded generator
    class Drops(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4, dtype=torch.float64)
            self.drop = nn.Dropout(0.25)

        def forward(self, x):
            return self.drop(self.inner(x)).sum()

    assert trace_graph(Drops(), (torch.randn(3, 4, dtype=torch.float64),)).random_ops == ("dropout",)
    config = GPTConfig(layers=1, hidden=16, heads=2, seq_len=8, vocab=32, dropout=0.1, dtype="float64")
    ids = torch.randint(0, 32, (2, 8))
    traced = trace_graph(GPTLoss(GPT(config)), (ids, ids))
    assert len(traced.random_ops) == 4  # embedding, attention probabilities, attention out, MLP out
    assert all(traced.fx_node(name).target == torch.ops.aten.rand.generator for name in traced.random_ops)


def test_simplify_merges_gelu_chain_keeps_residual_adds(gpt2):
    _, _, traced = gpt2
    merged = simplify(traced.graph)
    assert len(merged.nodes) < len(traced.graph.nodes)
    c_fc = next(node for node in merged.nodes if node.module == "model.transformer.h.0.mlp.c_fc")
    # new-GELU 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): 8 ops into the linear
    assert c_fc.kind == "linear" and c_fc.attr("merged_ops") == ("mul", "pow", "mul", "add", "mul", "tanh", "add",
                                                                 "mul")
    assert c_fc.attr("partial_ok") is False and len(c_fc.members) == 2 + 8
    assert traced.value_node(c_fc).name == c_fc.members[-1]  # its value is the chain's last mul
    assert traced.random_ops == ()  # dropout p=0, sdpa dropout_p=0
    proj = next(node for node in merged.nodes if node.module == "model.transformer.h.0.attn.c_proj")
    assert proj.attr("merged_ops") == ("dropout",) and proj.attr("partial_ok") is True
    residual = [node for node in merged.nodes if node.kind == "elementwise" and len(set(node.inputs)) == 2
                and node.module.startswith("model.transformer.h.")]
    assert len(residual) == 4  # two residual adds per block stay nodes
    consumers = {name for node in merged.nodes for name in node.inputs}
    assert consumers <= {node.name for node in merged.nodes}
    assert simplify(merged) == merged  # nothing left to merge


def test_cnn_conv_flops_norm_and_shape_only_constants():
    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64)
            self.norm = nn.GroupNorm(2, 4, dtype=torch.float64)
            self.act = nn.ReLU(inplace=True)
            self.head = nn.Linear(4, 2, dtype=torch.float64)

        def forward(self, images, target):
            h = self.act(self.norm(self.conv(images)))
            h = h + torch.zeros_like(h)  # reads h's shape only: a constant
            return F.mse_loss(self.head(h.mean(dim=(2, 3))), target)

    model = CNN()
    inputs = (torch.randn(2, 3, 5, 5, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64))
    traced = trace_graph(model, inputs)
    kinds = _kinds(traced.graph)
    assert kinds["conv"] == 1 and kinds["norm"] == 1 and kinds["constant"] == 1 and kinds["reduce"] == 1
    conv = next(node for node in traced.graph.nodes if node.kind == "conv")
    # 2 * batch * out channels * output pixels * (in channels * kernel area)
    assert conv.flops == 2 * 2 * 4 * 25 * 3 * 9 and conv.params == ("conv.weight", "conv.bias")
    assert conv.attr("groups") == 1 and conv.attr("spatial_ndim") == 2 and conv.attr("transposed") is False
    norm = next(node for node in traced.graph.nodes if node.kind == "norm")
    assert norm.attr("op") == "group_norm" and norm.attr("groups") == 2 and norm.attr("normalized_ndim") == 3
    mean = next(node for node in traced.graph.nodes if node.kind == "reduce")
    assert mean.attr("dims") == (2, 3) and mean.attr("keepdim") is False and mean.shape == (2, 4)
    assert _close(traced.module(*inputs).detach(), model(*inputs).detach())


def test_unbind_chunk_and_fills_become_single_views_and_constants():
    class Pieces(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 6, dtype=torch.float64)

        def forward(self, x):
            h = self.a(x)  # (3, 6)
            filled = torch.full_like(h, 3.0) + h.new_full((3, 6), 2.0)
            return h.unbind(1)[2].sum() + h.chunk(2, dim=1)[1].sum() + (h * filled).sum()

    model = Pieces()
    x = torch.randn(3, 4, dtype=torch.float64)
    traced = trace_graph(model, (x,))
    views = {node.attr("op"): node for node in traced.graph.nodes if node.kind == "view"}
    assert views["select"].attr("dim") == 1 and views["select"].attr("index") == 2 and views["select"].shape == (3,)
    assert (views["slice"].attr("start"), views["slice"].attr("end")) == (3, 6) and views["slice"].shape == (3, 3)
    assert _kinds(traced.graph)["constant"] == 3  # two aten.full and their sum
    assert _close(traced.module(x).detach(), model(x).detach())


def test_simplify_does_not_merge_a_value_read_elsewhere():
    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4, dtype=torch.float64)
            self.b = nn.Linear(4, 4, dtype=torch.float64)

        def forward(self, x):
            h = self.a(x)
            return (self.b(h) + torch.relu(h) * 2).sum()

    traced = trace_graph(Branch(), (torch.randn(3, 4, dtype=torch.float64),))
    merged = simplify(traced.graph)
    relu = next(node for node in merged.nodes if node.attr("op") == "relu")
    # h feeds b as well: relu cannot join a's node, but relu * 2 joins relu
    assert relu.attr("merged_ops") == ("mul",) and relu.inputs == ("linear",)
    assert merged.node("linear").members == ("linear",)


def test_param_views_fold_into_their_reader_and_topk_is_a_reduce():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))

        def forward(self, x):  # x (b, 3, 2)
            h = x * self.scale[1:3].t().unsqueeze(0)  # the parameter sliced, transposed, unsqueezed: (1, 3, 2)
            return h.topk(1, dim=1).values.sum()

    traced = trace_graph(Scaled(), (torch.randn(5, 3, 2, dtype=torch.float64),))
    mul = next(node for node in traced.graph.nodes if node.params)
    assert mul.kind == "elementwise" and mul.params == ("scale",) and mul.inputs == ("x",) and len(mul.members) == 4
    # operand dim 0 is new, dim 1 is the parameter's dim 1, dim 2 its (sliced) dim 0
    assert mul.attr("param_operands") == (("scale", (1, 3, 2), (-1, 1, 0), (0,)),)
    topk = next(node for node in traced.graph.nodes if node.kind == "reduce" and node.attr("op") == "topk")
    assert topk.attr("dims") == (1,) and topk.attr("k") == 1 and topk.shape == (5, 1, 2) and topk.inputs == (mul.name,)
    assert all(traced.graph.consumers(node.name) for node in traced.graph.nodes if node.kind != "output")


def test_reshaped_parameter_refused():
    class Reshapes(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 3, 4, dtype=torch.float64))

        def forward(self, x):
            return (x @ self.w.reshape(6, 4)).sum()

    with pytest.raises(ValueError, match=r"reshape of parameter 'w' from \(2, 3, 4\) to \(6, 4\).*store the parameter"):
        trace_graph(Reshapes(), (torch.randn(5, 6, dtype=torch.float64),))


@pytest.mark.parametrize("op, fix", [(torch.sort, "sorting"), (torch.cumsum, "prefix sums")])
def test_refused_op_names_itself(op, fix):
    class Sorts(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4, dtype=torch.float64)

        def forward(self, x):
            h = self.inner(x)
            values = op(h, 1)
            return (values[0] if isinstance(values, tuple) else values).sum()

    with pytest.raises(ValueError, match=rf"aten\.{op.__name__}.*module '<top>'.*{fix}"):
        trace_graph(Sorts(), (torch.randn(3, 4, dtype=torch.float64),))


class _NonZero(nn.Module):
    def forward(self, x):
        return x[torch.nonzero(x > 0)[:, 0]].sum()


class _Branches(nn.Module):
    def forward(self, x):
        return x.sum() if x.sum() > 0 else -x.sum()


class _Pair(nn.Module):
    def forward(self, x):
        return x * 2, x.sum()


class _Logits(nn.Module):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize("model, message", [
    (_NonZero, r"aten\.nonzero.*module '<top>'.*shape \(u0, 2\) depends on the data"),
    (_Branches, r"torch\.export\(strict=False\) could not trace _Branches: GuardOnDataDependentSymNode"),
    (_Pair, r"must return one tensor, the loss; it returns 2 graph values"),
    (_Logits, r"returns a tensor of shape \(3, 4\), not a scalar loss")])
def test_untraceable_models_are_refused_by_name(model, message):
    with pytest.raises(ValueError, match=message):
        trace_graph(model(), (torch.randn(3, 4, dtype=torch.float64),))


def test_batch_norm_refused_with_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"batch_norm.*module '1'.*GroupNorm or LayerNorm"):
        trace_graph(model, (torch.randn(3, 4),))


def test_traced_module_matches_model_loss_and_gradients(gpt2):
    model, inputs, traced = gpt2
    model.zero_grad()
    expected = model(*inputs)
    expected.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    loss = traced.module(*inputs)
    loss.backward()
    assert _close(loss.detach(), expected.detach())
    for name, param in model.named_parameters():  # the traced module holds the model's own parameters
        assert _close(param.grad, grads[name]), name


def test_dim_groups():
    assert dim_groups((2, 8, 32), (16, 32)) == (((0, 1), (0,)), ((2,), (1,)))
    assert dim_groups((2, 8, 32), (2, 8, 4, 8)) == (((0,), (0,)), ((1,), (1,)), ((2,), (2, 3)))
    assert dim_groups((4, 1, 6), (4, 6, 1)) == (((0,), (0,)), ((1,), ()), ((2,), (1,)), ((), (2,)))
    assert dim_groups((6, 4), (4, 6)) == (((0, 1), (0, 1)),)
    with pytest.raises(ValueError, match="element count"):
        dim_groups((2, 3), (7,))
