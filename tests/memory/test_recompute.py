"""Activation recomputation (plait.memory.recompute) in plait's GPT: full and selective
give the gradients of no recomputation bitwise in float64 (dropout masks replayed), a
split backward (zero bubble's B then W) recomputes once, a tensor-parallel block re-runs
its forward collectives in the backward (counted), and bad use is named."""

import pytest
import torch

import plait.comm as comm
from plait.memory.saved_memory import SavedTensorMeter
from plait.models import GPT, GPTConfig
from plait.memory.recompute import random_streams, recompute, set_block_recompute
from plait.parallel.tensor import new_tensor_parallel
from plait.testing import run_distributed

CONFIG = GPTConfig(layers=3, hidden=32, heads=4, seq_len=16, vocab=67, dropout=0.1, dtype="float64")


def _batch(step: int):
    tokens = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _grads(model):
    return [param.grad.clone() for param in model.parameters()]


def _train(mode, layers, steps=2):
    """Two SGD steps (dropout on); losses, last gradients, dropout counters, recomputes."""
    model = GPT(CONFIG, seed=4)
    recomputed = []
    model.set_recompute(mode, layers, on_recompute=recomputed.append)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = model.loss(*_batch(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    counters = [stream.calls for stream in random_streams(model)]
    return losses, _grads(model), counters, recomputed


@pytest.mark.parametrize("mode,layers,per_step", [("full", None, 3), ("full", 1, 1), ("selective", None, 3),
                                                  ("selective", 2, 2)])
def test_recomputed_gradients_equal_stored_ones_bitwise(mode, layers, per_step):
    losses, grads, counters, recomputed = _train("none", None)
    got_losses, got_grads, got_counters, got_recomputed = _train(mode, layers)
    assert got_losses == losses  # the second step's loss checks the first step's update too
    assert all(torch.equal(got, want) for got, want in zip(got_grads, grads, strict=True))
    assert got_counters == counters  # the recompute's dropout draws were replayed, not new ones
    assert recomputed == []
    region = "a transformer block" if mode == "full" else "the attention core"
    assert got_recomputed == [region] * (2 * per_step)  # once per region per backward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_under_autocast_replays_the_autocast(mode, dtype):
    """The backward runs outside the forward's autocast: the recompute re-enters it, so
    the regenerated tensors are the 16-bit ones the forward saved and the gradients
    equal those of no recomputation under the same autocast, bitwise (float32 weights)."""
    config = GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=67, dropout=0.1)

    def grads(recompute_mode):
        model = GPT(config, seed=4)
        model.set_recompute(recompute_mode)
        inputs, targets = _batch(0)
        with torch.autocast("cpu", dtype=dtype):
            logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, config.vocab), targets.reshape(-1)).backward()
        return _grads(model)

    assert all(torch.equal(got, want) for got, want in zip(grads(mode), grads("none"), strict=True))


def test_a_split_backward_recomputes_once():
    """Zero bubble's B (input gradient, graph retained) then W (weight gradients)."""
    reference = GPT(CONFIG, seed=4)
    model = GPT(CONFIG, seed=4)
    recomputed = []
    model.set_recompute("full", on_recompute=recomputed.append)
    tokens, _ = _batch(0)
    want = reference.embed(tokens).detach().requires_grad_(True)
    x = want.detach().clone().requires_grad_(True)
    out_want, out = want, x
    for block_want, block in zip(reference.blocks, model.blocks, strict=True):
        out_want, out = block_want(out_want, tokens.shape[1]), block(out, tokens.shape[1])
    out_want.square().sum().backward()
    blocks = [param for block in model.blocks for param in block.parameters()]
    out.square().sum().backward(inputs=[x], retain_graph=True)
    assert torch.equal(x.grad, want.grad)
    assert recomputed == ["a transformer block"] * 3
    torch.autograd.backward(out.square().sum(), inputs=blocks)
    assert recomputed == ["a transformer block"] * 3  # W reused B's recompute
    reference_blocks = [param for block in reference.blocks for param in block.parameters()]
    assert all(torch.equal(got.grad, want_param.grad) for got, want_param in zip(blocks, reference_blocks,
                                                                                 strict=True))


def _saved_bytes_of_one_block(mode):
    """Bytes autograd holds after one block's forward (s=64: the (b, n, s, s) attention
    tensors dominate), measured from live storages by the bench's meter."""
    config = GPTConfig(layers=1, hidden=32, heads=4, seq_len=64, vocab=67, dropout=0.1, dtype="float64")
    block = GPT(config, seed=1).blocks[0]
    block.set_recompute(mode)
    x = torch.randn(64, 2, 32, dtype=torch.float64, requires_grad=True)
    meter = SavedTensorMeter(exclude=[param for param in block.parameters()])
    with meter.hooks():
        out = block(x, 64)
    held = meter.live_bytes
    out.sum().backward()
    return held, x.numel() * 8, meter.live_bytes, meter.peak_bytes


def test_recomputation_holds_less_measured_from_live_storages():
    none, x_bytes, after, none_peak = _saved_bytes_of_one_block("none")
    full, _, full_after, full_peak = _saved_bytes_of_one_block("full")
    selective, _, selective_after, _ = _saved_bytes_of_one_block("selective")
    assert full == x_bytes  # full: the block's input and nothing else
    # the backward regenerates what the forward without recomputation kept, and the meter sees it
    assert none_peak == none and full_peak == none
    scores_bytes = 2 * 4 * 64 * 64 * 8  # one (b, n, s, s) float64 tensor
    assert none - selective >= 2 * scores_bytes  # at least the softmax output and the dropped-out probabilities go
    assert x_bytes < selective < none
    assert after == full_after == selective_after == 0  # the backward released everything, kept inputs included


def test_a_region_that_changes_its_path_is_named():
    calls = []

    def region(x):
        calls.append(1)
        return x.exp() if len(calls) == 1 else x * 2  # exp saves its output; x * 2 saves nothing

    x = torch.randn(4, requires_grad=True)
    out = recompute(region, x, name="the odd region")
    with pytest.raises(RuntimeError, match="recomputing the odd region: its forward saved 1 tensors for the "
                                           "backward but the recompute saved 0"):
        out.sum().backward()


def test_without_autograd_the_region_just_runs():
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        out = recompute(torch.exp, x)
    assert not out.requires_grad and torch.equal(out, x.detach().exp())


def test_bad_recompute_settings_are_named():
    model = GPT(CONFIG, seed=4)
    with pytest.raises(ValueError, match="recompute='partial': valid values are none, selective, full"):
        model.set_recompute("partial")
    with pytest.raises(ValueError, match="recompute layers=-1: give a block count >= 0"):
        set_block_recompute(list(model.blocks), "full", -1)


# ----- torch's own randomness (nn.Dropout, torch.rand) is replayed too -----------------------
def _region_drawing_from_torch(linear: torch.nn.Linear, dropout: torch.nn.Dropout):
    def region(x):
        hidden = dropout(linear(x).tanh())  # the dropout mask is saved for the backward
        return hidden * torch.rand(hidden.shape, dtype=hidden.dtype, device=hidden.device)  # so is the rand

    return region


def _torch_random_grads(use_recompute: bool, device: str):
    """Gradients of a region drawing from torch's generators, and the generator's next
    draw after the backward; the generator moves on between the forward and the backward
    (as it does when later layers drop out), so a recompute that did not set it back
    would draw other masks."""
    torch.manual_seed(5)
    linear = torch.nn.Linear(16, 16, dtype=torch.float64, device=device)
    region = _region_drawing_from_torch(linear, torch.nn.Dropout(0.5))
    x = torch.randn(4, 16, dtype=torch.float64, device=device, requires_grad=True)
    recomputed = []
    out = recompute(region, x, on_recompute=recomputed.append) if use_recompute else region(x)
    torch.rand(64, device=device)  # later draws, between the forward and the backward
    out.square().sum().backward()
    after = torch.rand(8, device=device)  # the backward gave the generator back where it was
    return [x.grad, linear.weight.grad, linear.bias.grad], after, recomputed


def _check_torch_randomness_replayed(device: str):
    grads, after, _ = _torch_random_grads(False, device)
    got_grads, got_after, recomputed = _torch_random_grads(True, device)
    assert recomputed == ["region"]  # the region did run again in the backward
    assert all(torch.equal(got, want) for got, want in zip(got_grads, grads, strict=True))
    assert torch.equal(got_after, after)


def test_torch_dropout_and_rand_are_replayed_bitwise():
    """nn.Dropout and torch.rand in a region: the recompute draws the masks of the
    forward (torch's CPU generator set back, as torch.utils.checkpoint does), so the
    gradients equal those without recomputation exactly, in float64."""
    _check_torch_randomness_replayed("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_torch_dropout_and_rand_are_replayed_bitwise_on_cuda():
    """The same on a CUDA device: that device's generator is set back."""
    _check_torch_randomness_replayed("cuda")


# ----- tensor parallelism: the recomputed forward re-runs its collectives --------------------
def recomputed_tp_block(rank, world_size, mode):
    tp = new_tensor_parallel(world_size, algorithm="ring")
    try:
        config = GPTConfig(layers=1, hidden=32, heads=4, seq_len=8, vocab=67, dropout=0.1, dtype="float64")
        results = {}
        for name in ("none", mode):
            model = GPT(config, tp, seed=1)
            model.set_recompute(name)
            x = torch.randn(8, 3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
            x.requires_grad_(True)
            out = model.blocks[0](x, 8)
            comm.reset_stats()
            out.square().sum().backward()
            calls = comm.stats().get("all_reduce", {}).get("calls", 0)
            results[name] = (calls, [param.grad.clone() for param in model.parameters() if param.grad is not None],
                             x.grad.clone())
        (plain_calls, plain_grads, plain_x), (calls, grads, x_grad) = results["none"], results[mode]
        same = torch.equal(x_grad, plain_x) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
        return plain_calls, calls, same
    finally:
        comm.destroy_process_group(tp.group)


@pytest.mark.slow
@pytest.mark.parametrize("mode,extra", [("full", 2), ("selective", 0)])
def test_tensor_parallel_recompute_reruns_the_forward_collectives(mode, extra):
    """A block's forward has 2 all-reduces (attention and MLP outputs), its backward 2:
    full recomputation adds the forward's 2 to the backward; selective recomputes only
    the attention core, which has none."""
    for plain_calls, calls, same in run_distributed(recomputed_tp_block, 2, mode):
        assert plain_calls == 2
        assert calls == plain_calls + extra
        assert same
