"""Megatron tensor parallelism on real gloo processes against the unsharded GPT
(DESIGN.md section 4: numerical parity), and its communication counts.

Every rank builds the unsharded model from the same seed as its oracle and
compares its gathered logits, loss, gradients and parameters with it.

Why the tolerances: a sharded matmul sums the same products as the unsharded
one, split into p partial sums added by the all-reduce, so the two differ only
by the association order of the additions. Each result is a sum of at most a
few hundred terms of magnitude <= 1 (hidden 32, FFN 128, vocabulary <= 67), so
the difference is a few hundred ulps at most: ~1e-14 in float64 (u = 1.1e-16)
and ~1e-6 in float32 (u = 6e-8). Ten optimiser steps (Adam in float64, SGD
with momentum in float32: see _optimizer) keep that order. The issue's bounds, 1e-10 (float64)
and 1e-5 (float32) absolute, sit above both with room for the compounding.
Parameters right after construction must be bitwise equal: they are the same
float64 draws sliced, then rounded the same way.
"""

import pytest
import torch
import torch.distributed as dist

from plait import comm
from plait.models import GPT, GPTConfig
from plait.parallel.tensor import (
    UNSHARDED,
    ParallelAttention,
    ParallelMLP,
    TensorParallel,
    gather_grads,
    gather_logits,
    gather_state_dict,
    new_tensor_parallel,
    shard_state_dict,
    vocab_parallel_cross_entropy,
)
from plait.testing import run_distributed

BATCH, SEQUENCE = 3, 8  # the sequence divides by 2 and 4 (sequence parallelism)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def _config(dtype, vocab=67, tied=True, dropout=0.0, layers=2, heads=4, hidden=32, seq_len=SEQUENCE):
    return GPTConfig(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab, dropout=dropout,
                     tied_head=tied, dtype={torch.float64: "float64", torch.float32: "float32"}[dtype])


def _batch(step, vocab, batch=BATCH, sequence=SEQUENCE):
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, sequence + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]  # next-token prediction


def _optimizer(model, dtype):
    # Adam divides by sqrt(v): where a gradient is as small as float32's roundoff its
    # step can flip by up to lr, so float32 runs take SGD with momentum, whose steps
    # are Lipschitz in the gradient; float64's roundoff is far below any gradient here.
    if dtype == torch.float64:
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _max_error(got, want):
    return max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))


def _max_relative_error(got, want):
    """Per tensor, the error relative to the tensor's largest entry: catches an error
    confined to a tensor whose entries are all small (LayerNorm gradients ~1e-3)."""
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for g, w in zip(got, want, strict=True))


def _destroy(tp):
    if tp.group is not None:
        dist.destroy_process_group(tp.group)


def train_tp(rank, world_size, tp_size, dtype, sequence_parallel, tied, dropout, vocab, algorithm, steps,
             heads=4, hidden=32, batch=BATCH, sequence=SEQUENCE, accumulate=1):
    """Train the unsharded GPT and a tp-way sharded one side by side (``accumulate``
    backward passes per step, sequences of ``sequence`` <= seq_len tokens); return the
    largest differences seen (init, logits, loss, grads absolute and relative, parameters)."""
    tp = new_tensor_parallel(tp_size, algorithm=algorithm, sequence_parallel=sequence_parallel)
    try:
        config = _config(dtype, vocab, tied, dropout, heads=heads, hidden=hidden)
        reference, sharded = GPT(config, seed=5), GPT(config, tp, seed=5)
        loaded = GPT(config, tp, seed=99)
        shard_state_dict(loaded, reference.state_dict(), tp)  # an unsharded checkpoint into a sharded model
        init_equal = all(torch.equal(gathered, reference.state_dict()[name]) and torch.equal(mine, theirs)
                         for (name, gathered), mine, theirs in zip(gather_state_dict(sharded, tp).items(),
                                                                   sharded.state_dict().values(),
                                                                   loaded.state_dict().values()))
        optimizers = [_optimizer(model, dtype) for model in (reference, sharded)]
        errors = {"logits": 0.0, "loss": 0.0, "grads": 0.0, "grads relative": 0.0}
        for step in range(steps):
            for optimizer in optimizers:
                optimizer.zero_grad()
            for micro in range(accumulate):
                tokens, targets = _batch(step * accumulate + micro, vocab, batch, sequence)
                want_logits = reference(tokens)
                want_loss = torch.nn.functional.cross_entropy(want_logits.reshape(-1, vocab), targets.reshape(-1))
                want_loss.backward()
                logits = sharded(tokens)
                loss = vocab_parallel_cross_entropy(logits, targets, tp, vocab).mean()
                loss.backward()
                errors["logits"] = max(errors["logits"], _max_error([gather_logits(logits.detach(), tp, vocab)],
                                                                    [want_logits]))
                errors["loss"] = max(errors["loss"], abs(loss.item() - want_loss.item()))
            grads = gather_grads(sharded, tp)
            pairs = [(grads[name], param.grad) for name, param in reference.named_parameters()]
            errors["grads"] = max(errors["grads"], _max_error(*zip(*pairs)))
            errors["grads relative"] = max(errors["grads relative"], _max_relative_error(*zip(*pairs)))
            for optimizer in optimizers:
                optimizer.step()
        final = gather_state_dict(sharded, tp)
        errors["params"] = _max_error([final[name] for name in reference.state_dict()],
                                      list(reference.state_dict().values()))
        return init_equal, errors, loss.item()
    finally:
        _destroy(tp)


# Relative bound per gradient tensor: the same few-hundred-ulp argument, relative to
# the tensor's own largest entry (1e-12 float64, 1e-4 float32).
RELATIVE = {torch.float64: 1e-12, torch.float32: 1e-4}


def _check(results, dtype):
    for init_equal, errors, _ in results:
        assert init_equal
        for what, error in errors.items():
            bound = RELATIVE[dtype] if what == "grads relative" else TOLERANCE[dtype]
            assert error < bound, (what, error)


@pytest.mark.slow
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_float64_parity_ten_steps(tp_size):
    # vocab 67 is not divisible by 2 or 4: the padded rows must be invisible
    results = run_distributed(train_tp, 4, tp_size, torch.float64, False, True, 0.0, 67, "auto", 10)
    _check(results, torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("tp_size,sequence_parallel,tied,dropout,algorithm", [
    (2, False, False, 0.0, "ring"),  # untied vocab-parallel head
    (4, True, True, 0.0, "auto"),  # sequence parallelism
    (2, True, False, 0.1, "torch"),  # dropout masks slice the unsharded model's; torch's collectives
    (4, False, True, 0.1, "auto"),
])
def test_float64_parity_variants(tp_size, sequence_parallel, tied, dropout, algorithm):
    results = run_distributed(train_tp, 4, tp_size, torch.float64, sequence_parallel, tied, dropout, 67, algorithm,
                              10)
    _check(results, torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_world_of_three_accumulation_short_sequences(sequence_parallel):
    """tp = 3 (6 heads, hidden 48, FFN 192, vocab 67 padded to 69), a batch of one,
    sequences of 6 < seq_len 8 and two backward passes per step: accumulation must
    stay exact with the sequence-parallel gradient sums."""
    results = run_distributed(train_tp, 3, 3, torch.float64, sequence_parallel, False, 0.1, 67, "auto", 4,
                              heads=6, hidden=48, batch=1, sequence=6, accumulate=2)
    _check(results, torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("tp_size,sequence_parallel", [(2, False), (4, True)])
def test_float32_parity_ten_steps(tp_size, sequence_parallel):
    results = run_distributed(train_tp, 4, tp_size, torch.float32, sequence_parallel, True, 0.0, 67, "auto", 10)
    _check(results, torch.float32)


# ----- communication counts (plait.comm.stats) -------------------------------------------
def _calls_and_bytes():
    return {name: (entry["calls"], entry["bytes_sent"]) for name, entry in comm.stats().items()}


def count_layer_collectives(rank, world_size, sequence_parallel, layers):
    """Collectives of one transformer layer (forward, backward) and of the whole model's
    loss (forward, backward), with the ring so the bytes have a closed form."""
    # check_layout="off": the layer's own collectives only (the layout check's one small
    # all-gather per layer, on its first forward, is counted in test_sequence_layout)
    tp = new_tensor_parallel(world_size, algorithm="ring", sequence_parallel=sequence_parallel, check_layout="off")
    try:
        config = _config(torch.float64, layers=layers)
        model = GPT(config, tp, seed=1)
        rows = SEQUENCE // world_size if sequence_parallel else SEQUENCE
        x = torch.randn(rows, BATCH, config.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        x.requires_grad_(True)
        comm.reset_stats()
        out = model.blocks[0](x, SEQUENCE)
        layer_forward = _calls_and_bytes()
        comm.reset_stats()
        out.square().sum().backward()
        layer_backward = _calls_and_bytes()
        tokens, targets = _batch(0, config.vocab)
        comm.reset_stats()
        loss = model.loss(tokens, targets)
        model_forward = _calls_and_bytes()
        comm.reset_stats()
        loss.backward()
        model_backward = _calls_and_bytes()
        return layer_forward, layer_backward, model_forward, model_backward
    finally:
        _destroy(tp)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_two_all_reduces_forward_and_backward_per_layer(world_size):
    p, n = world_size, SEQUENCE * BATCH * 32  # b·s·h float64 elements per all-reduce
    ring_bytes = 2 * (p - 1) * (n // p) * 8  # ring all-reduce: 2(p-1) chunks of n/p sent per rank
    for layers in (1, 3):
        for layer_forward, layer_backward, model_forward, model_backward in run_distributed(
                count_layer_collectives, world_size, False, layers):
            assert layer_forward == {"all_reduce": (2, 2 * ring_bytes)}
            assert layer_backward == {"all_reduce": (2, 2 * ring_bytes)}
            # the model adds: the embedding's all-reduce and the cross-entropy's two
            # (max, then [sum of exp, target logit]) forward; the head's f backward
            assert model_forward["all_reduce"][0] == 2 * layers + 3
            assert model_backward["all_reduce"][0] == 2 * layers + 1
            assert set(model_forward) == set(model_backward) == {"all_reduce"}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_counts(world_size):
    p, n = world_size, SEQUENCE * BATCH * 32
    gather_bytes = (p - 1) * (n // p) * 8  # ring all-gather / reduce-scatter: (p-1) chunks of n/p
    small = 6 * 32  # two LayerNorms (weight, bias) and the two output biases, summed once per layer
    assert small % p == 0
    small_bytes = 2 * (p - 1) * (small // p) * 8
    for layers in (1, 3):
        for layer_forward, layer_backward, model_forward, model_backward in run_distributed(
                count_layer_collectives, world_size, True, layers):
            assert layer_forward == {"all_gather": (2, 2 * gather_bytes), "reduce_scatter": (2, 2 * gather_bytes)}
            assert layer_backward["all_gather"] == (2, 2 * gather_bytes)
            assert layer_backward["reduce_scatter"] == (2, 2 * gather_bytes)
            assert layer_backward["all_reduce"][0] == 1
            assert layer_backward["all_reduce"][1] == small_bytes
            # model: the embedding's reduce-scatter and the head's all-gather forward, plus
            # the cross-entropy's two all-reduces; backward mirrors them and sums the
            # position embedding's and final LayerNorm's gradients in one more all-reduce
            assert model_forward == {"all_gather": (2 * layers + 1, model_forward["all_gather"][1]),
                                     "reduce_scatter": (2 * layers + 1, model_forward["reduce_scatter"][1]),
                                     "all_reduce": (2, model_forward["all_reduce"][1])}
            assert model_backward["all_gather"][0] == 2 * layers + 1
            assert model_backward["reduce_scatter"][0] == 2 * layers + 1
            assert model_backward["all_reduce"][0] == layers + 1


# ----- bad input -----------------------------------------------------------------------------
def _error_of(call):
    try:
        call()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def build_with_bad_input(rank, world_size):
    """Each bad construction, as the message every rank sees."""
    messages = {
        "tp larger than world": _error_of(lambda: new_tensor_parallel(world_size + 4)),
        "tp not dividing world": _error_of(lambda: new_tensor_parallel(3)),
        "tp differs": _error_of(lambda: new_tensor_parallel(1 if rank == 1 else world_size)),
        "tp type": _error_of(lambda: new_tensor_parallel("2")),
    }
    algorithm = "ring" if rank == 2 else "auto"
    messages["algorithm differs"] = _error_of(lambda: GPT(_config(torch.float64),
                                                          TensorParallel(group=dist.group.WORLD, algorithm=algorithm)))
    tp = new_tensor_parallel(world_size)
    try:
        layers = 3 if rank == 1 else 2  # rank 1 was configured differently
        messages["mismatched config"] = _error_of(lambda: GPT(_config(torch.float64, layers=layers), tp))
        messages["mismatched seed"] = _error_of(lambda: GPT(_config(torch.float64), tp, seed=rank % 2))
        messages["heads"] = _error_of(lambda: GPT(GPTConfig(hidden=24, heads=6, ffn_hidden=48, seq_len=8), tp))
        model = GPT(_config(torch.float64), tp)
        tokens, targets = _batch(0, 67)
        messages["token out of range"] = _error_of(lambda: model(tokens + 67))
        targets = targets.clone()
        targets[0, 0] = 67
        messages["target out of range"] = _error_of(lambda: model.loss(tokens, targets))
        messages["too long"] = _error_of(lambda: model(torch.zeros(1, SEQUENCE + 1, dtype=torch.long)))
        sp = new_tensor_parallel(world_size, sequence_parallel=True)
        try:
            sp_model = GPT(_config(torch.float64), sp)
            messages["sequence not divisible"] = _error_of(lambda: sp_model(torch.zeros(1, 3, dtype=torch.long)))
        finally:
            _destroy(sp)
        return messages
    finally:
        _destroy(tp)


@pytest.mark.slow
def test_bad_input_is_named_on_every_rank():
    results = run_distributed(build_with_bad_input, 4)
    for messages in results:
        assert "tp=8 is larger than the world size 4" in messages["tp larger than world"]
        assert "tp=3 does not divide the world size 4; valid tp values: [1, 2, 4]" in messages["tp not dividing world"]
        assert ("new_tensor_parallel: every rank must ask for the same tensor parallelism: ranks [1] have a "
                "different tp from rank 0's") in messages["tp differs"]
        assert "TypeError: tp must be an int, got str '2'" == messages["tp type"]
        assert ("every rank of a tensor-parallel group must build the same GPT: ranks [2] have a different "
                "algorithm from rank 0's") in messages["algorithm differs"]
        assert ("every rank of a tensor-parallel group must build the same GPT: ranks [1] have a different "
                "GPTConfig from rank 0's") in messages["mismatched config"]
        assert "ranks [1, 3] have a different seed from rank 0's" in messages["mismatched seed"]
        assert "tp=4 does not divide heads=6" in messages["heads"]
        assert "valid tp values: 1, 2, 3, 6" in messages["heads"]
        assert "token ids must lie in [0, 67)" in messages["token out of range"]
        assert "targets must lie in [0, 67)" in messages["target out of range"]
        assert "sequence length 9 must be in [1, seq_len=8]" in messages["too long"]
        assert "sequence length 3 must be a multiple of 4" in messages["sequence not divisible"]


# ----- the layers on their own --------------------------------------------------------------
def standalone_layer_grads(rank, world_size, kind, sequence_parallel):
    """A ParallelMLP or ParallelAttention used alone (its forward adds the bias) against
    the unsharded layer with the same seed: output and every gathered gradient."""
    tp = new_tensor_parallel(world_size, sequence_parallel=sequence_parallel)
    try:
        build = {"mlp": lambda group: ParallelMLP(24, 48, group, dtype=torch.float64, seed=3),
                 "attention": lambda group: ParallelAttention(24, 6, group, dtype=torch.float64, seed=3)}[kind]
        reference, sharded = build(UNSHARDED), build(tp)
        with torch.no_grad():  # a nonzero bias, so its gradient path matters
            for layer in (reference, sharded):
                for name, param in layer.named_parameters():
                    if name in ("fc2.bias", "proj.bias"):
                        param.copy_(torch.linspace(-1, 1, param.numel(), dtype=torch.float64))
        full = torch.randn(SEQUENCE, 2, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        upstream = torch.randn(SEQUENCE, 2, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        want = reference(full)
        (want * upstream).sum().backward()
        mine = full.chunk(world_size)[rank] if sequence_parallel else full
        out = sharded(mine)
        (out * (upstream.chunk(world_size)[rank] if sequence_parallel else upstream)).sum().backward()
        expected = want.chunk(world_size)[rank] if sequence_parallel else want
        grads = gather_grads(sharded, tp)
        return (out - expected).abs().max().item(), _max_error(
            [grads[name] for name, _ in reference.named_parameters()],
            [param.grad for _, param in reference.named_parameters()])
    finally:
        _destroy(tp)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlp", "attention"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_standalone_layers_sum_their_bias_gradients(kind, sequence_parallel):
    for output_error, grad_error in run_distributed(standalone_layer_grads, 2, kind, sequence_parallel):
        assert output_error < 1e-10 and grad_error < 1e-10


def _integers(seed, *shape):
    """Small integers as float64: every sum below is exact, whatever its order."""
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).double()


def mapping_results(rank, world_size):
    """Each of the seven mappings on this rank's input X_r and upstream gradient dY_r
    (rebuilt for every rank from seeds), against its definition written here with
    torch.cat / sums: forward value, input gradient, and the autograd class it ran."""
    from plait.parallel.tensor import mappings

    tp = new_tensor_parallel(world_size)
    p, r, m, k = world_size, rank, 2, 3  # shards of 2 rows / 3 columns
    try:
        def inputs(seed, *shape):
            return [_integers(seed * 100 + q, *shape) for q in range(p)]

        cases = {  # name: (x shape, dY shape, forward from all X, dX from all dY)
            "copy_to_region": ((4, k), (4, k), lambda xs: xs[r], lambda gs: sum(gs)),
            "reduce_from_region": ((4, k), (4, k), lambda xs: sum(xs), lambda gs: gs[r]),
            "scatter_to_region": ((4, p * k), (4, k), lambda xs: xs[r][:, r * k:(r + 1) * k],
                                  lambda gs: torch.cat(gs, dim=-1)),
            "gather_from_region": ((4, k), (4, p * k), lambda xs: torch.cat(xs, dim=-1),
                                   lambda gs: gs[r][:, r * k:(r + 1) * k]),
            "scatter_to_sequence": ((p * m, 5), (m, 5), lambda xs: xs[r][r * m:(r + 1) * m],
                                    lambda gs: torch.cat(gs, dim=0)),
            "gather_from_sequence": ((m, 5), (p * m, 5), lambda xs: torch.cat(xs, dim=0),
                                     lambda gs: sum(g[r * m:(r + 1) * m] for g in gs)),
            "reduce_scatter_to_sequence": ((p * m, 5), (m, 5), lambda xs: sum(x[r * m:(r + 1) * m] for x in xs),
                                           lambda gs: torch.cat(gs, dim=0)),
        }
        results = {}
        for seed, (name, (x_shape, grad_shape, want_y, want_dx)) in enumerate(cases.items(), start=1):
            xs, grads = inputs(seed, *x_shape), inputs(seed + 50, *grad_shape)
            x = xs[r].clone().requires_grad_(True)
            y = getattr(mappings, name)(x, tp)
            y.backward(grads[r])
            results[name] = (type(y.grad_fn).__name__, torch.equal(y.detach(), want_y(xs)),
                             torch.equal(x.grad, want_dx(grads)))
        return results
    finally:
        _destroy(tp)


@pytest.mark.slow
def test_each_mapping_is_its_named_function_with_the_stated_collectives():
    for rank, results in enumerate(run_distributed(mapping_results, 3)):
        assert len(results) == 7
        wrong = {name: (function, forward_ok, backward_ok)
                 for name, (function, forward_ok, backward_ok) in results.items()
                 if not (function == "".join(part.title() for part in name.split("_")) + "Backward"
                         and forward_ok and backward_ok)}
        assert not wrong, f"rank {rank}: (autograd node, forward right, backward right) {wrong}"
