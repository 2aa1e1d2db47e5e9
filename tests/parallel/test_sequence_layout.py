"""Tensor-parallel layers know the layout they expect (plait.parallel.tensor.layout):
a replicated input under sequence parallelism, or a rank-local one without it, is
refused by name with the shapes; SequenceParallelEntry / SequenceParallelExit convert
a Hugging Face (b, s, h) in and out, exactly.

The oracle is Hugging Face's own GPT-2 MLP (GPT2MLP from a GPT2Config, float64, one
process: run in the test process, so the workers need not import transformers);
plait re-expresses it as ColumnParallelLinear -> GPT-2's gelu_new (tanh GeLU) ->
RowParallelLinear at tp=2, loading each rank's slice of HF's Conv1D weights (stored
(in, out): transposed into torch's (out, in)).

Tolerance: the sharded MLP sums the same products as HF's, split into 2 partial sums
of the row-parallel matmul (32 of the 64 inner features each) added by the
reduce-scatter, and the gradients of the replicated bias/input add the ranks' parts:
a few ulps of terms of magnitude <= ~1, so 1e-12 relative to each tensor's largest
entry in float64 (u = 1.1e-16) leaves room; a layout mistake is off by O(1) (x2).
"""

import pytest
import torch
import torch.nn.functional as F

from plait import comm
from plait.parallel.tensor import (
    ColumnParallelLinear,
    ParallelAttention,
    RowParallelLinear,
    SequenceParallelEntry,
    SequenceParallelExit,
    UNSHARDED,
    TensorParallel,
    VocabParallelEmbedding,
)
from plait.parallel.tensor.layout import REPLICATED, SEQUENCE_SHARDED, fingerprint, layout_problem
from plait.testing import run_distributed

BATCH, SEQUENCE, HIDDEN, INNER = 2, 8, 16, 64
RELATIVE = 1e-12  # float64: see the module docstring


def _gathered(*tensors):
    return torch.stack([fingerprint(t) for t in tensors])


# ----- the decision, on fingerprints (one process) ----------------------------------------
def test_the_decision_on_fingerprints():
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(SEQUENCE, BATCH, HIDDEN, dtype=torch.float64, generator=generator)
    shards = full.chunk(2)
    replicated_message = layout_problem(_gathered(full, full.clone()), SEQUENCE_SHARDED, 1e-8)
    assert "(8, 2, 16) is the same on every tp rank (replicated), not sharded along the sequence" in replicated_message
    assert "SequenceParallelEntry(tp, seq_dim=...)" in replicated_message
    assert layout_problem(_gathered(*shards), SEQUENCE_SHARDED, 1e-8) is None
    # LayerNorm'd shards: every row sums to 0, yet they are told apart
    normed = [F.layer_norm(shard, (HIDDEN,)) for shard in shards]
    assert layout_problem(_gathered(*normed), SEQUENCE_SHARDED, 1e-8) is None
    assert layout_problem(_gathered(normed[0], normed[0].clone()), SEQUENCE_SHARDED, 1e-8) is not None
    # rows all equal, or zero: a replicated and a sharded input look alike, nothing is refused
    ones = torch.ones(4, BATCH, HIDDEN, dtype=torch.float64)
    assert layout_problem(_gathered(ones, ones), SEQUENCE_SHARDED, 1e-8) is None
    assert layout_problem(_gathered(ones * 0, ones * 0), SEQUENCE_SHARDED, 1e-8) is None
    # replicated: rounding-level differences pass, different data or a permutation of it is named
    assert layout_problem(_gathered(full, full * (1 + 1e-15)), REPLICATED, 1e-8) is None
    differ = layout_problem(_gathered(full, full.flip(0), full), REPLICATED, 1e-8)
    assert "input of shape (8, 2, 16) differs between the tp ranks (ranks [1] from rank 0's)" in differ
    assert "rank 0 (8, 2, 16), rank 1 (4, 2, 16)" in layout_problem(_gathered(full, shards[0]), REPLICATED, 1e-8)
    tokens = torch.randint(0, 50, (SEQUENCE, BATCH), generator=generator)
    changed = tokens.clone()
    changed[3, 1] += 1
    assert layout_problem(_gathered(tokens, tokens.clone()), REPLICATED, 0.0) is None
    assert layout_problem(_gathered(tokens, changed), REPLICATED, 0.0) is not None


def test_check_layout_values_are_named():
    with pytest.raises(ValueError, match="check_layout='sometimes' must be one of 'first', 'always', 'off'"):
        TensorParallel(group=None, check_layout="sometimes")


# ----- HF GPT-2's MLP at tp=2 -------------------------------------------------------------
def _hf_mlp():
    from transformers import GPT2Config  # a test dependency: imported where it is used
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(7)
    mlp = GPT2MLP(INNER, GPT2Config(n_embd=HIDDEN, n_head=2, n_layer=1, resid_pdrop=0.0)).double()
    with torch.no_grad():  # nonzero biases, so their gradient paths matter
        mlp.c_fc.bias.copy_(torch.linspace(-0.5, 0.5, INNER, dtype=torch.float64))
        mlp.c_proj.bias.copy_(torch.linspace(-1, 1, HIDDEN, dtype=torch.float64))
    return mlp


class PlaitMLP(torch.nn.Module):
    """HF's GPT2MLP (its state dict ``hf``) as plait layers: c_fc column-parallel,
    c_proj row-parallel."""

    def __init__(self, hf, tp, rank):
        super().__init__()
        self.fc1 = ColumnParallelLinear(HIDDEN, INNER, tp, dtype=torch.float64, seed=None)
        self.fc2 = RowParallelLinear(INNER, HIDDEN, tp, dtype=torch.float64, seed=None)
        with torch.no_grad():  # Conv1D stores (in, out): transpose, then take this rank's slice
            self.fc1.weight.copy_(hf["c_fc.weight"].t().chunk(tp.size, 0)[rank])
            self.fc1.bias.copy_(hf["c_fc.bias"].chunk(tp.size, 0)[rank])
            self.fc2.weight.copy_(hf["c_proj.weight"].t().chunk(tp.size, 1)[rank])
            self.fc2.bias.copy_(hf["c_proj.bias"])

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))  # GPT-2's gelu_new


def _relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _run(model, x, upstream):
    """Output and every gradient (the input's, then the parameters') of sum(model(x) * upstream)."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, {name: param.grad for name, param in model.named_parameters()}


def _errors(oracle, x, upstream, model, tp, rank):
    """Largest relative error of the output and each gradient of ``model`` (tp rank
    ``rank``'s PlaitMLP, wrapped) against HF's one-process MLP (``oracle``: _run's result)."""
    want_out, want_dx, want = oracle
    out, dx, grads = _run(model, x, upstream)
    expected = {"fc1.weight": want["c_fc.weight"].t().chunk(tp.size, 0)[rank],
                "fc1.bias": want["c_fc.bias"].chunk(tp.size, 0)[rank],
                "fc2.weight": want["c_proj.weight"].t().chunk(tp.size, 1)[rank],
                "fc2.bias": want["c_proj.bias"]}
    errors = {"output": _relative(out, want_out), "input grad": _relative(dx, want_dx)}
    by_suffix = {name: grad for key, grad in grads.items() for name in expected if key.endswith("." + name)}
    errors.update({name: _relative(by_suffix[name], value) for name, value in expected.items()})
    return errors


def _refusal(call):
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def layouts_at_tp2(rank, world_size, hf, x, upstream, oracle):
    """Every scenario on the same two ranks: refusals (message or None) and the
    relative errors of the converted runs. ``hf``: HF's MLP state dict; x, upstream:
    its input (b, s, h) and the output's gradient; ``oracle``: its output and gradients."""
    # four settings of the one world group (group=None): every refusal is raised on both
    # ranks after the same collectives, so the group stays usable
    sp = TensorParallel(sequence_parallel=True)
    plain = TensorParallel()
    always = TensorParallel(sequence_parallel=True, check_layout="always")
    off = TensorParallel(sequence_parallel=True, check_layout="off")
    result = {}

    # 1. SP on HF's replicated (b, s, h), no entry: refused by name, on every rank
    result["sp replicated"] = _refusal(lambda: PlaitMLP(hf, sp, rank)(x))
    # ... and what the check prevents: exactly tp times the gradient of every sharded weight
    _, _, wrong = _run(torch.nn.Sequential(PlaitMLP(hf, off, rank)), x, upstream)
    _, _, right = _run(torch.nn.Sequential(SequenceParallelEntry(off, seq_dim=1), PlaitMLP(hf, off, rank),
                                           SequenceParallelExit(off, seq_dim=1)), x, upstream)
    result["unchecked ratio"] = [_relative(wrong["0." + name], world_size * right["1." + name])
                                 for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]

    # 2. entry/exit around the SP layers (and around the plain ones): exact against HF
    for name, tp in (("sp entry", sp), ("plain entry", plain), ("always entry", always)):
        model = torch.nn.Sequential(SequenceParallelEntry(tp, seq_dim=1), PlaitMLP(hf, tp, rank),
                                    SequenceParallelExit(tp, seq_dim=1))
        result[name] = _errors(oracle, x, upstream, model, tp, rank)
        result[name + " again"] = _errors(oracle, x, upstream, model, tp, rank)  # checked once or every time
    # recomputation (the forward run twice) under check_layout="always": the same ranks
    # recompute the same layers, so the check's all-gathers stay matched
    inner = PlaitMLP(hf, always, rank)
    checkpointed = torch.nn.Sequential(SequenceParallelEntry(always, seq_dim=1), _Checkpointed(inner),
                                       SequenceParallelExit(always, seq_dim=1))
    result["recomputed"] = _errors(oracle, x, upstream, checkpointed, always, rank)

    # 3. without SP, each rank its own batch (rank-local): refused
    local = torch.randn(BATCH, SEQUENCE, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    result["plain rank-local"] = _refusal(lambda: PlaitMLP(hf, plain, rank)(local))
    result["plain entry rank-local"] = _refusal(lambda: SequenceParallelEntry(plain, seq_dim=1)(local))
    # 4. attention under SP on a batch-first replicated input: refused (it would attend
    # over p copies); sequence-first shards are its layout
    attention = ParallelAttention(HIDDEN, 2, sp, dtype=torch.float64, seed=1)
    result["attention replicated"] = _refusal(lambda: attention(x))
    # ... and through the entry/exit it attends over the whole sequence: the one-process
    # layer (same seed) on the sequence-first transpose, output and input gradient
    whole = ParallelAttention(HIDDEN, 2, UNSHARDED, dtype=torch.float64, seed=1)
    want_out, want_dx, _ = _run(_BatchFirst(whole), x, upstream)
    out, dx, _ = _run(torch.nn.Sequential(SequenceParallelEntry(sp, seq_dim=1), attention,
                                          SequenceParallelExit(sp, seq_dim=1)), x, upstream)
    result["attention entry"] = max(_relative(out, want_out), _relative(dx, want_dx))
    # 5. token ids differing between ranks (the embedding sums rank-local lookups)
    embedding = VocabParallelEmbedding(32, HIDDEN, plain, dtype=torch.float64, seed=1)
    result["tokens differ"] = _refusal(lambda: embedding(torch.full((SEQUENCE, BATCH), rank)))

    # 6. cost: "first" gathers one fingerprint per layer on its first forward only
    counted = PlaitMLP(hf, sp, rank)
    shard = x.transpose(0, 1).chunk(world_size)[rank]
    calls = []
    for _ in range(2):
        comm.reset_stats()
        counted(shard)
        calls.append(comm.stats().get("all_gather", {}).get("calls", 0))
    result["all_gathers first"] = calls  # the layer's own SP all-gather, plus the check the first time
    # "always" checks every forward: a later replicated input is still refused, "first" lets it pass
    checked_always, checked_first = PlaitMLP(hf, always, rank), PlaitMLP(hf, sp, rank)
    checked_always(shard), checked_first(shard)
    replicated = x.transpose(0, 1)
    result["always later"] = _refusal(lambda: checked_always(replicated))
    result["first later"] = _refusal(lambda: checked_first(replicated))
    return result


class _BatchFirst(torch.nn.Module):
    """A sequence-first layer on a (b, s, h) input, in one process."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.transpose(0, 1)).transpose(0, 1)


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.slow
def test_hf_gpt2_mlp_under_sequence_parallelism_is_refused_or_exact():
    hf = _hf_mlp()
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH, SEQUENCE, HIDDEN, dtype=torch.float64, generator=generator)  # HF's (b, s, h)
    upstream = torch.randn(BATCH, SEQUENCE, HIDDEN, dtype=torch.float64, generator=generator)
    oracle = _run(hf, x, upstream)
    state = {name: value.detach().clone() for name, value in hf.state_dict().items()}
    for rank, result in enumerate(run_distributed(layouts_at_tp2, 2, state, x, upstream, oracle)):
        message = result["sp replicated"]
        assert message is not None, f"rank {rank}: a replicated (b, s, h) under sequence parallelism was accepted"
        assert message.startswith("ColumnParallelLinear(in=16, out=64) (sequence_parallel=True, tp=2, this rank "
                                  f"{rank} has shape (2, 8, 16)): input of shape (2, 8, 16) is the same on every "
                                  "tp rank (replicated), not sharded along the sequence"), message
        assert "plait.parallel.tensor.SequenceParallelEntry(tp, seq_dim=...)" in message
        assert max(result["unchecked ratio"]) < RELATIVE  # exactly tp x the gradients: what the check refuses
        for name in ("sp entry", "sp entry again", "plain entry", "plain entry again", "always entry",
                     "always entry again", "recomputed"):
            errors = result[name]
            assert set(errors) == {"output", "input grad", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
            assert max(errors.values()) < RELATIVE, (rank, name, errors)
        for name in ("plain rank-local", "plain entry rank-local"):
            assert "input of shape (2, 8, 16) differs between the tp ranks (ranks [1] from rank 0's) where it " \
                   "must be replicated" in result[name], (name, result[name])
        assert result["plain rank-local"].startswith("ColumnParallelLinear(in=16, out=64) (sequence_parallel=False")
        assert result["plain entry rank-local"].startswith("SequenceParallelEntry(seq_dim=1)")
        assert result["attention replicated"].startswith("ParallelAttention(hidden=16, heads=2) input "
                                                         "(sequence_parallel=True"), result["attention replicated"]
        assert result["attention entry"] < RELATIVE, result["attention entry"]
        assert result["tokens differ"].startswith("VocabParallelEmbedding(vocab=32, hidden=16) tokens"), \
            result["tokens differ"]
        assert result["all_gathers first"] == [2, 1]
        assert "is the same on every tp rank (replicated)" in result["always later"]
        assert result["first later"] is None
