"""The GPT on one process: its config, shapes, causality, parameter count, that it
learns, and that unsharded state dicts round-trip (tensor parallelism itself is
tested on real processes in tests/parallel/test_tensor_parallel.py)."""

import pytest
import torch
import torch.nn.functional as F

from plait.models import GPT, GPTConfig
from plait.parallel.tensor import UNSHARDED, gather_state_dict, shard_state_dict

SMALL = dict(layers=2, hidden=32, heads=4, seq_len=16, vocab=67)


def test_config_names_every_bad_value():
    with pytest.raises(ValueError) as info:
        GPTConfig(layers=0, hidden=30, heads=4, dropout=1.5, dtype="float8")
    message = str(info.value)
    for part in ("layers=0 must be a positive int", "dropout=1.5 must be in [0, 1)", "dtype='float8' must be one of"):
        assert part in message
    with pytest.raises(ValueError, match=r"heads=4 does not divide hidden=30; choose heads in \[1, 2, 3, 5, 6"):
        GPTConfig(hidden=30, heads=4)


def test_tensor_parallel_degrees_are_checked_with_the_valid_ones():
    config = GPTConfig(hidden=48, heads=6, ffn_hidden=96)
    config.check_tensor_parallel(3)
    with pytest.raises(ValueError, match=r"^tp=4 does not divide heads=6; valid tp values: 1, 2, 3, 6$"):
        config.check_tensor_parallel(4)
    with pytest.raises(ValueError, match=r"^tp=5 does not divide heads=6 and hidden=48 and ffn_hidden=96; "):
        config.check_tensor_parallel(5)


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_the_formula(tied):
    config = GPTConfig(**SMALL, tied_head=tied)
    model = GPT(config)
    assert sum(param.numel() for param in model.parameters()) == config.num_parameters()


def test_shapes_and_causality():
    model = GPT(GPTConfig(**SMALL, dtype="float64"), seed=3).eval()
    tokens = torch.randint(0, 67, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 12, 67)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 67
    other = model(changed)
    assert torch.equal(other[:, :7], logits[:, :7])  # the past never sees the future
    assert not torch.allclose(other[:, 7:], logits[:, 7:])


def test_loss_is_torch_cross_entropy():
    model = GPT(GPTConfig(**SMALL, dtype="float64"), seed=3)
    tokens = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = tokens.roll(-1, dims=1)
    want = F.cross_entropy(model(tokens).reshape(-1, 67), targets.reshape(-1))
    assert abs(model.loss(tokens, targets).item() - want.item()) < 1e-12  # both: log-sum-exp of the same float64 logits


def test_same_seed_same_model_and_dropout_streams():
    config = GPTConfig(**SMALL, dropout=0.2, dtype="float64")
    a, b, c = GPT(config, seed=4), GPT(config, seed=4), GPT(config, seed=5)
    tokens = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(a(tokens), b(tokens))  # same weights, same masks
    assert not torch.equal(a(tokens), c(tokens))
    assert not torch.equal(a(tokens), a(tokens))  # a fresh mask each call in training mode


def test_gpt_learns_a_repeating_sequence():
    """A period-5 token stream is fully predictable after one period: 60 Adam steps
    must take the loss from ~log(V) to well below it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=11), seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    pattern = torch.tensor([3, 1, 4, 1, 5] * 4)
    tokens = torch.stack([pattern.roll(-shift)[:17] for shift in range(5)])
    first = None
    for _ in range(60):
        optimizer.zero_grad()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        first = loss.item() if first is None else first
    assert first > 2.0 and loss.item() < 0.5 * first


def test_unsharded_state_dict_round_trip_and_errors():
    config = GPTConfig(**SMALL, tied_head=False)
    model, other = GPT(config, seed=1), GPT(config, seed=2)
    shard_state_dict(other, model.state_dict(), UNSHARDED)
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in gather_state_dict(other, UNSHARDED).items())
    state = dict(model.state_dict())
    state["embedding.weight"] = state["embedding.weight"][:-1]
    with pytest.raises(ValueError, match=r"embedding.weight: the unsharded tensor has shape \(66, 32\), the model "
                                         r"expects \(67, 32\)"):
        shard_state_dict(other, state, UNSHARDED)
    del state["head"]
    with pytest.raises(ValueError, match=r"missing \['head'\]"):
        shard_state_dict(other, state, UNSHARDED)
