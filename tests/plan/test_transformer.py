"""The analytic GPT against the real one: FLOPs counted by torch's FlopCounterMode,
parameters, and activation memory measured as the bytes autograd saves; and the
Megatron-LM accounting against Korthikanti et al.'s closed forms."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from plait.models.gpt import GPT, GPTConfig
from plait.models.gpt_layers import GPTBlockLayer, GPTEmbeddingLayer, GPTHeadLayer
from plait.parallel.tensor import TensorParallel, vocab_parallel_cross_entropy
from plait.plan.trace import saved_activation_bytes
from plait.plan.transformer import MODEL_PRESETS, TransformerSpec, model_preset
from plait.testing import run_distributed

SMALL = [dict(layers=2, hidden=32, heads=4, seq_len=16, vocab=50, tied_head=True),
         dict(layers=3, hidden=48, heads=6, seq_len=24, vocab=101, tied_head=False),
         dict(layers=1, hidden=64, heads=2, seq_len=40, vocab=17, tied_head=False, ffn_hidden=96)]


def _spec(shape: dict, dropout: bool = False) -> TransformerSpec:
    return TransformerSpec(dropout=dropout, **shape)


@pytest.mark.parametrize("shape", SMALL)
def test_parameters_match_the_module(shape):
    model = GPT(GPTConfig(**shape))
    assert _spec(shape).num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("shape", SMALL)
def test_training_flops_match_a_direct_count(shape):
    """FlopCounterMode counts every matmul of a real forward and backward at 2mnk;
    the description must agree within 1% (it agrees exactly: both count matmuls only)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape, dtype="float64"))
    batch = 3
    tokens = torch.randint(0, shape["vocab"], (batch, shape["seq_len"]))
    with FlopCounterMode(display=False) as counter:
        model.loss(tokens, tokens).backward()
    counted = counter.get_total_flops()
    predicted = _spec(shape).training_flops(batch)
    assert abs(predicted - counted) <= 0.01 * counted
    assert predicted == counted  # the exact count; the 1% above is the bar


def test_flops_follow_the_megatron_formula():
    """72·B·s·l·h²·(1 + s/(6h) + V/(12lh)) without, 96·B·s·l·h²·(1 + s/(6h) + V/(16lh))
    with recomputation (DESIGN §6)."""
    spec = model_preset("gpt-175b")
    b, s, l, h, v = 1536, spec.seq_len, spec.layers, spec.hidden, spec.vocab
    assert spec.training_flops(b) == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)),
                                                   rel=1e-12)
    assert spec.training_flops(b, recompute="full") == pytest.approx(
        96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)), rel=1e-12)
    # selective re-runs QKᵀ and ·V of every block: 4·B·s²·h each
    assert spec.training_flops(b, recompute="selective") == pytest.approx(
        spec.training_flops(b) + 4 * b * s * s * h * l, rel=1e-12)
    with pytest.raises(ValueError, match="recompute=True must be one of none, selective, full"):
        spec.training_flops(b, recompute=True)


def test_presets_have_their_advertised_sizes():
    """Parameter counts within 2% of the names (GPT-3 paper, Megatron-LM Table 1)."""
    sizes = {"gpt-125m": 125e6, "gpt-350m": 350e6, "gpt-1.3b": 1.3e9, "gpt-2.7b": 2.7e9, "gpt-6.7b": 6.7e9,
             "gpt-13b": 13e9, "gpt-175b": 175e9, "gpt-530b": 529.6e9, "gpt-1t": 1008e9, "gpt-145b": 145.6e9,
             "gpt-310b": 310.1e9, "gpt-76b": 76.1e9, "gpt-39b": 39.1e9, "gpt-18b": 18.4e9, "gpt-7.5b": 7.5e9,
             "gpt-3.6b": 3.6e9, "gpt-1.7b": 1.7e9}
    # Table 1's 1.7B is 1.652B rounded to one decimal (2.8% off)
    loose = {"gpt-125m": 0.06, "gpt-1.7b": 0.03}
    for name, size in sizes.items():
        assert MODEL_PRESETS[name].num_parameters() == pytest.approx(size, rel=loose.get(name, 0.02)), name


def test_megatron_accounting_is_korthikanti_table_2():
    """Per layer: 34sbh + 5as²b; with tp: sbh(10 + 24/t) + 5as²b/t; with sp: (34sbh + 5as²b)/t
    (16-bit activations, 1-byte dropout masks); full recomputation keeps 2sbh (/t with sp)."""
    spec = model_preset("gpt-175b")
    s, b, h, a = spec.seq_len, 2, spec.hidden, spec.heads
    sbh, as2b = s * b * h, a * s * s * b
    assert spec.block_activation_bytes(b) == 34 * sbh + 5 * as2b
    assert spec.block_activation_bytes(b, tp=8) == pytest.approx(sbh * (10 + 24 / 8) + 5 * as2b / 8, rel=1e-12)
    assert spec.block_activation_bytes(b, tp=8, sequence_parallel=True) == pytest.approx((34 * sbh + 5 * as2b) / 8,
                                                                                          rel=1e-12)
    assert spec.block_input_bytes(b) == 2 * sbh
    assert spec.block_input_bytes(b, tp=8, sequence_parallel=True) == 2 * sbh / 8


def _measured_layers(config: GPTConfig, batch: int, tp=None, seed=0, recompute="none", autocast_dtype=None):
    """Saved bytes of each of GPT's sequential layers (embedding, blocks, head + loss),
    each run on a fresh input that requires grad, as a pipeline stage runs it (under
    ``torch.autocast(autocast_dtype)`` when given, the loss in float32 outside it)."""
    torch.manual_seed(seed)
    model = GPT(config, tp, seed=seed)
    model.set_recompute(recompute)
    model.train()
    layers = [GPTEmbeddingLayer(model), *map(GPTBlockLayer, model.blocks), GPTHeadLayer(model)]  # tied too
    params = list(model.parameters())
    tokens = torch.randint(0, config.vocab, (batch, config.seq_len))
    x, measured = tokens, []
    for index, layer in enumerate(layers):
        inputs = x.detach().requires_grad_(True) if x.is_floating_point() else x
        out = {}

        def run(layer=layer, inputs=inputs, index=index):
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                out["y"] = layer(inputs)
            if index == len(layers) - 1:  # the last stage's loss is part of its memory
                out["loss"] = vocab_parallel_cross_entropy(out["y"].float(), tokens, model.tp, config.vocab).mean()

        measured.append(saved_activation_bytes(run, exclude=params))
        x = out["y"]
    return measured


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("shape", SMALL[:2])
def test_plait_accounting_matches_the_saved_tensors(shape, dropout):
    """Within 10% (the issue's bar); the formula counts plait's GPT tensor by tensor, so
    it is exact here: float32 activations, float32 dropout masks."""
    batch = 3
    config = GPTConfig(**shape, dropout=dropout)
    measured = _measured_layers(config, batch)
    spec = _spec(shape, dropout=dropout > 0)
    kw = dict(element_bytes=4, accounting="plait")
    predicted = ([spec.embedding_activation_bytes(batch, **kw)] + [spec.block_activation_bytes(batch, **kw)]
                 * shape["layers"] + [spec.head_activation_bytes(batch, **kw)])
    for got, want in zip(measured, predicted):
        assert abs(got - want) <= 0.10 * got
    for got, want in zip(measured[1:-1], predicted[1:-1]):
        assert got == want  # blocks: exact
    costs = spec.layer_costs(batch, **kw)
    assert [c.activation_bytes for c in costs] == predicted


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SMALL[:2])
def test_plait_accounting_of_autocast_matches_the_saved_tensors(shape, autocast_dtype):
    """plait train's mixed precision (autocast over float32 weights): the residual
    stream float32 (r = 4), matmul inputs and the attention core 16-bit (e = 2), and one
    16-bit copy of each matmul weight per forward (w = 2). Blocks and head exact."""
    batch = 3
    measured = _measured_layers(GPTConfig(**shape), batch, autocast_dtype=autocast_dtype)
    spec = _spec(shape)
    kw = dict(element_bytes=2, accounting="plait", residual_bytes=4, weight_copy_bytes=2)
    predicted = ([spec.embedding_activation_bytes(batch, element_bytes=2, accounting="plait")]
                 + [spec.block_activation_bytes(batch, **kw)] * shape["layers"] + [spec.head_activation_bytes(batch, **kw)])
    assert measured[1:] == predicted[1:]
    assert abs(measured[0] - predicted[0]) <= 0.10 * measured[0]
    assert [c.activation_bytes for c in spec.layer_costs(batch, **kw)] == predicted
    full = _measured_layers(GPTConfig(**shape), batch, recompute="full", autocast_dtype=autocast_dtype)
    assert full[1:-1] == [spec.block_input_bytes(batch, element_bytes=4)] * shape["layers"]  # the fp32 input


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputed_blocks_keep_what_the_planner_prices(recompute, dropout):
    """The bytes a recomputed block keeps, measured from the saved tensors, are what
    plait plan prices: selective, the block's activations less its attention core
    (exact); full, the block's input (exact)."""
    shape, batch = SMALL[1], 3
    measured = _measured_layers(GPTConfig(**shape, dropout=dropout), batch, recompute=recompute)
    spec = _spec(shape, dropout=dropout > 0)
    kw = dict(element_bytes=4, accounting="plait")
    if recompute == "selective":
        want = spec.block_activation_bytes(batch, **kw) - spec.attention_core_bytes(batch, **kw)
        stored = _measured_layers(GPTConfig(**shape, dropout=dropout), batch)
        freed = [a - b for a, b in zip(stored[1:-1], measured[1:-1])]
        assert freed == [spec.attention_core_bytes(batch, **kw)] * shape["layers"]  # the core's bytes, measured
    else:
        want = spec.block_input_bytes(batch, element_bytes=4)
    assert measured[1:-1] == [want] * shape["layers"]


def _tp_saved_bytes(rank, world_size, shape, sequence_parallel, dropout):
    tp = TensorParallel(group=dist.group.WORLD, sequence_parallel=sequence_parallel)
    return _measured_layers(GPTConfig(**shape, dropout=dropout), 2, tp=tp)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_plait_accounting_under_tensor_parallelism(sequence_parallel):
    """Two real tensor-parallel ranks: each rank's saved bytes within 10% of the
    description (exact for the blocks)."""
    shape = dict(layers=1, hidden=32, heads=4, seq_len=16, vocab=50, tied_head=False)
    results = run_distributed(_tp_saved_bytes, 2, shape, sequence_parallel, 0.1)
    spec = _spec(shape, dropout=True)
    kw = dict(tp=2, sequence_parallel=sequence_parallel, element_bytes=4, accounting="plait")
    predicted = [spec.embedding_activation_bytes(2, **kw), spec.block_activation_bytes(2, **kw),
                 spec.head_activation_bytes(2, **kw)]
    for measured in results:
        for got, want in zip(measured, predicted):
            assert abs(got - want) <= 0.10 * got
        assert measured[1] == predicted[1]


def test_layer_costs_split_over_tensor_parallel_ranks():
    spec = TransformerSpec(layers=4, hidden=64, heads=8, seq_len=32, vocab=1000, tied_head=False)
    one, four = spec.layer_costs(2, tp=1), spec.layer_costs(2, tp=4)
    assert len(one) == spec.layers + 2
    assert four[1].forward_flops == one[1].forward_flops / 4
    assert four[1].backward_flops == 2 * four[1].forward_flops
    assert sum(c.params for c in one) == spec.num_parameters()
    # per rank: sharded matrices / 4, replicated LayerNorms and row-parallel biases whole
    h, f = 64, 256
    assert four[1].params == (4 * h * h + 3 * h + 2 * h * f + f) // 4 + 6 * h
    comm = spec.tensor_parallel_comm(2, tp=4)
    assert [c for c, _ in comm["block"].forward] == ["all_reduce", "all_reduce"]
    assert [c for c, _ in comm["block"].backward] == ["all_reduce", "all_reduce"]
    sp = spec.tensor_parallel_comm(2, tp=4, sequence_parallel=True)
    assert [c for c, _ in sp["block"].forward] == ["reduce_scatter", "all_gather"] * 2
    assert spec.tensor_parallel_comm(2, tp=1)["block"].forward == ()


def test_bad_shapes_and_degrees_are_named():
    with pytest.raises(ValueError, match="heads=5 does not divide hidden=64"):
        TransformerSpec(layers=2, hidden=64, heads=5, seq_len=8, vocab=10)
    with pytest.raises(ValueError, match="layers=0"):
        TransformerSpec(layers=0, hidden=64, heads=4, seq_len=8, vocab=10)
    spec = TransformerSpec(layers=2, hidden=96, heads=6, seq_len=8, vocab=10)
    assert "tp=4 does not divide heads=6" in spec.tensor_parallel_problem(4)
    assert "valid tp: 1, 2, 3, 6" in spec.tensor_parallel_problem(4)
    with pytest.raises(ValueError, match="unknown model preset 'gpt-9z'.*gpt-175b"):
        model_preset("gpt-9z")


def test_the_planner_and_the_pipeline_schedules_import_without_torch_distributed():
    """DESIGN.md section 2: plan/ may import the pipeline schedules (plain data), never torch.distributed."""
    import subprocess
    import sys

    code = ("import sys, plait.plan, plait.plan.search, plait.parallel.pipeline.schedules, "
            "plait.parallel.pipeline.replay; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_cuda_autocast_keeps_the_attention_probabilities_in_float32_and_16_bits():
    """CUDA's autocast runs softmax in float32 (the CPU's runs it in bf16): the attention
    keeps the float32 probabilities for softmax's backward and the 16-bit copy the PV
    matmul saved, 4 + 2 bytes per element (measured on an H200, bench/gpu/results)."""
    from plait.plan.precision import precision_for

    cpu, cuda = precision_for("bf16-mixed", "plait"), precision_for("bf16-mixed", "plait", "cuda")
    assert cpu.softmax_bytes is None and cuda.softmax_bytes == 6
    assert precision_for("fp32", "plait", "cuda").softmax_bytes is None  # no autocast: one float32 tensor
    assert precision_for("bf16-mixed", "megatron", "cuda").softmax_bytes is None  # fused 16-bit softmax
    spec = model_preset("gpt-125m")
    b, t, extra = 2, 2, (6 - 2) * spec.heads * spec.seq_len ** 2 * 2 / 2
    core = {bytes_: spec.attention_core_bytes(b, tp=t, accounting="plait", softmax_bytes=bytes_)
            for bytes_ in (None, 6)}
    assert core[6] - core[None] == extra
    block = {bytes_: spec.block_activation_bytes(b, tp=t, accounting="plait", residual_bytes=4, weight_copy_bytes=2,
                                                 softmax_bytes=bytes_) for bytes_ in (None, 6)}
    assert block[6] - block[None] == extra
    costs = {bytes_: spec.layer_costs(b, tp=t, accounting="plait", residual_bytes=4, weight_copy_bytes=2,
                                      softmax_bytes=bytes_)[1] for bytes_ in (None, 6)}
    assert costs[6].activation_bytes - costs[None].activation_bytes == extra
    assert costs[6].core_activation_bytes - costs[None].core_activation_bytes == extra
    with pytest.raises(ValueError, match="device_type='tpu'"):
        precision_for("bf16-mixed", "plait", "tpu")
