"""torch's state-dict and checkpoint APIs on plait's ZeRO (stages 1 and 3; stage 2 keeps
the state as stage 1) and DataParallel, with Hugging Face GPT-2 (tied wte / lm_head):

- ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` /
  ``get_optimizer_state_dict`` (and ``state_dict()``, ``named_parameters()``) give the
  plain model's keys (no ``module.``, no plait format), and, full, the values one
  process training the whole batch has; a DDP checkpoint's ``module.`` keys load;
- ``torch.distributed.checkpoint.save`` at dp=2 (each rank writes its own rows) and
  ``load`` at dp=1, then one more step, equals one process; saved again at dp=1 and
  loaded at dp=2, the same;
- ``load_full_state_dict(strict=False)`` of a state without the tied ``lm_head.weight``
  loads (through ``transformer.wte.weight``) and returns torch's missing keys;
- ``full_parameters()`` at stage 3: ``generate`` and ``save_pretrained`` on
  ``zero.module``, gathering only inside (live storages measured).

Tolerance: float64. The wrappers average per-rank mean losses where one process takes
the mean of the whole batch (the same terms in another order, ~1e-16 relative per
gradient element); AdamW's update is a smooth function of them, so 3 steps of lr 1e-2
keep parameters within 1e-12 absolute and the moments within 1e-12 relative
(rtol 1e-9 leaves margin for exp_avg_sq, a square)."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils._pytree import tree_map_only
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from plait.parallel.data.data_parallel import DataParallel
from plait.parallel.data.model_keys import consume_ddp_prefix, key_report, raise_key_errors, refuse_assign
from plait.parallel.zero.module import ZeRO
from plait.parallel.zero.row_shards import row_range
from plait.testing import run_distributed
from tests.hf_models import tiny_gpt2

BATCH, SEQ, VOCAB = 4, 8, 64
KINDS = ("dp", 1, 3)  # DataParallel, ZeRO stage 1, ZeRO stage 3
FULL = StateDictOptions(full_state_dict=True)


def _gpt2(seed: int = 0):
    return tiny_gpt2(seed, VOCAB)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(10 + step))


def _wrap(kind, seed: int = 0):
    """(wrapper, the optimizer torch's APIs are given)."""
    model = _gpt2(seed)
    if kind == "dp":
        wrapper = DataParallel(model)
        return wrapper, _adamw(wrapper.parameters())
    zero = ZeRO(model, _adamw, stage=kind)
    return zero, zero.param_optimizer


def _train(wrapper, optimizer, rank, world_size, steps):
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    for step in steps:
        tokens = _tokens(step)[rows]
        wrapper(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(wrapper, optimizer):
    """The full model and optimizer state dicts through torch's APIs (copies: a plain
    model's full state dict holds its live parameters)."""
    return tree_map_only(torch.Tensor, torch.clone, (get_model_state_dict(wrapper, options=FULL),
                                                     get_optimizer_state_dict(wrapper, optimizer, options=FULL)))


def _references(steps: int) -> list:
    """One process, the whole batch: its full model and optimizer state dicts after
    each of ``steps`` steps (index k: after k + 1 steps)."""
    model = _gpt2()
    optimizer = _adamw(model.parameters())
    states = []
    for step in range(steps):
        _train(model, optimizer, 0, 1, [step])
        states.append(_full(model, optimizer))
    return states


def _save_at(rank, world_size, directory):
    """Train 2 steps, save with DCP; the keys and full values; strict=False;
    full_parameters at stage 3."""
    out = {}
    for kind in KINDS:
        wrapper, optimizer = _wrap(kind)
        _train(wrapper, optimizer, rank, world_size, range(2))
        result = {"keys": (list(wrapper.state_dict()), list(get_model_state_dict(wrapper)),
                           sorted(get_optimizer_state_dict(wrapper, optimizer)["state"]),
                           [name for name, _ in wrapper.named_parameters()]),
                  # a DDP checkpoint (module.-prefixed keys) loads: the prefix is consumed
                  "ddp_keys": wrapper.load_state_dict({f"module.{key}": value for key, value
                                                       in get_model_state_dict(wrapper, options=FULL).items()}),
                  "full": _full(wrapper, optimizer)}
        dcp.save({"model": get_model_state_dict(wrapper), "optim": get_optimizer_state_dict(wrapper, optimizer)},
                 checkpoint_id=os.path.join(directory, f"{kind}-dp{world_size}"))
        if kind != "dp":
            result["tied"] = _without_tied_head(wrapper)
        if kind == 3:
            result["full_parameters"] = _full_parameters(wrapper, rank, directory)
        out[kind] = result
    return out


def _without_tied_head(zero):
    """A full state dict without lm_head.weight, into a differently initialised ZeRO."""
    state = zero.full_state_dict()
    del state["lm_head.weight"]
    other = ZeRO(_gpt2(seed=1), _adamw, stage=zero.stage)
    errors = []
    try:
        other.load_full_state_dict(state)
    except ValueError as error:
        errors.append(str(error))
    report = other.load_full_state_dict(state, strict=False)
    try:
        other.load_state_dict({**state, "extra.weight": torch.zeros(1)})
    except RuntimeError as error:
        errors.append(str(error))
    report_sharded = other.load_state_dict({**state, "extra.weight": torch.zeros(1)}, strict=False)
    return errors, report, report_sharded, other.full_state_dict()


def _full_parameters(zero, rank, directory):
    """generate and save_pretrained inside full_parameters() at stage 3, bytes of the
    gathered parameters before, inside and after."""
    prompt = _tokens(5)[:1, :4]
    before = zero.model_state_bytes()["params_bytes"]
    refused = []
    try:  # the parameters are freed between steps: refused by name (reading them was a crash)
        zero.module.state_dict()
    except RuntimeError as error:
        refused.append(str(error))
    with zero.full_parameters() as model:
        inside = zero.model_state_bytes()["params_bytes"]
        generated = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        try:
            zero(input_ids=prompt)
        except RuntimeError as error:
            refused.append(str(error))
        saved = os.path.join(directory, "pretrained")
        if rank == 0:
            model.save_pretrained(saved)
    with zero.full_parameters(writeback=False) as model:
        model.transformer.ln_f.bias.data.add_(1.0)  # dropped on exit
    unchanged = zero.full_state_dict()["transformer.ln_f.bias"]
    after = zero.model_state_bytes()["params_bytes"]
    return {"bytes": (before, inside, after), "generated": generated, "refused": refused, "saved": saved,
            "unchanged": unchanged, "model_bytes": sum(p.numel() * 8 for p in zero.module.parameters())}


def _load_at(rank, world_size, directory, saved_at, next_step, then_save):
    """A differently initialised wrapper loads the DCP checkpoint saved at
    ``saved_at`` ranks, takes step ``next_step`` (``then_save``: and saves at this size)."""
    out = {}
    for kind in KINDS:
        wrapper, optimizer = _wrap(kind, seed=1)
        state = {"model": get_model_state_dict(wrapper), "optim": get_optimizer_state_dict(wrapper, optimizer)}
        dcp.load(state, checkpoint_id=os.path.join(directory, f"{kind}-dp{saved_at}"))
        set_model_state_dict(wrapper, state["model"])
        set_optimizer_state_dict(wrapper, optimizer, state["optim"])
        loaded = _full(wrapper, optimizer)
        _train(wrapper, optimizer, rank, world_size, [next_step])
        out[kind] = {"loaded": loaded, "stepped": _full(wrapper, optimizer)}
        if then_save:
            dcp.save({"model": get_model_state_dict(wrapper), "optim": get_optimizer_state_dict(wrapper, optimizer)},
                     checkpoint_id=os.path.join(directory, f"{kind}-dp{world_size}"))
    return out


def _assert_model_equal(got, want, what):
    assert list(got) == list(want), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=f"{what}: {name}")


def _assert_optim_equal(got, want, what):
    assert sorted(got["state"]) == sorted(want["state"]), what
    for name, entry in want["state"].items():
        assert sorted(got["state"][name]) == sorted(entry), f"{what}: {name}"
        for key, value in entry.items():
            torch.testing.assert_close(got["state"][name][key], value, rtol=1e-9, atol=1e-14,
                                       msg=f"{what}: {name} {key}")
    assert [group["params"] for group in got["param_groups"]] == [group["params"] for group in want["param_groups"]]
    assert [group["lr"] for group in got["param_groups"]] == [group["lr"] for group in want["param_groups"]]


@pytest.mark.slow
def test_torch_state_dict_apis_and_dcp_across_dp_sizes(tmp_path):
    """DCP at dp=2 -> dp=1 -> dp=2 of DataParallel and ZeRO 1 / 3 equals one process;
    torch's state-dict APIs speak the model's keys; strict=False; full_parameters."""
    references = _references(4)
    want_model, want_optim = references[1]
    plain_keys = list(_gpt2().state_dict())
    saved = run_distributed(_save_at, 2, str(tmp_path))
    for rank, per_kind in enumerate(saved):
        for kind, result in per_kind.items():
            what = f"{kind} rank {rank}"
            state_keys, model_keys, optim_keys, param_names = result["keys"]
            assert state_keys == plain_keys and model_keys == plain_keys, what
            assert optim_keys == sorted(want_optim["state"]) == sorted(param_names), what
            assert (result["ddp_keys"].missing_keys, result["ddp_keys"].unexpected_keys) == ([], []), what
            _assert_model_equal(result["full"][0], want_model, what)
            _assert_optim_equal(result["full"][1], want_optim, what)
            if kind != "dp":
                errors, report, report_sharded, loaded = result["tied"]
                assert "missing ['lm_head.weight']" in errors[0] and "strict=False" in errors[0], what
                assert 'Unexpected key(s) in state_dict: "extra.weight"' in errors[1], what
                assert (report.missing_keys, report.unexpected_keys) == (["lm_head.weight"], []), what
                assert (report_sharded.missing_keys, report_sharded.unexpected_keys) == \
                    (["lm_head.weight"], ["extra.weight"]), what
                _assert_model_equal(loaded, want_model, f"{what} tied")
    _check_full_parameters([per_kind[3]["full_parameters"] for per_kind in saved], want_model)

    # saved at dp=2 after 2 steps -> loaded at dp=1, step 3, saved -> loaded at dp=2, step 4
    for loaded_at, saved_at, next_step in ((1, 2, 2), (2, 1, 3)):
        results = run_distributed(_load_at, loaded_at, str(tmp_path), saved_at, next_step, loaded_at == 1)
        for rank, per_kind in enumerate(results):
            for kind, result in per_kind.items():
                what = f"{kind} dp{saved_at} -> dp{loaded_at} rank {rank}"
                for got, want in ((result["loaded"], references[next_step - 1]),
                                  (result["stepped"], references[next_step])):
                    _assert_model_equal(got[0], want[0], what)
                    _assert_optim_equal(got[1], want[1], what)


def _check_full_parameters(results, trained):
    from transformers import GPT2LMHeadModel  # a test dependency, imported where used

    reference = _gpt2()
    reference.load_state_dict(trained)
    prompt = _tokens(5)[:1, :4]
    want = reference.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    for rank, result in enumerate(results):
        before, inside, after = result["bytes"]
        # stage 3 between steps holds no gathered parameter; inside, the whole model (the
        # padding of each unit to a multiple of N = 2 at most one element a unit)
        assert before == 0 and after == 0, result["bytes"]
        assert result["model_bytes"] <= inside <= result["model_bytes"] + 8 * 2 * 16, result["bytes"]
        assert torch.equal(result["generated"], want), rank
        assert "zero.module.state_dict() between steps" in result["refused"][0]
        assert "inside full_parameters()" in result["refused"][1]
        torch.testing.assert_close(result["unchanged"], trained["transformer.ln_f.bias"], rtol=1e-10, atol=1e-12)
    loaded = GPT2LMHeadModel.from_pretrained(results[0]["saved"], dtype=torch.float64)
    _assert_model_equal(loaded.state_dict(), trained, "save_pretrained")


def test_row_ranges_are_torch_chunks():
    """Shard(0)'s rows per rank are torch.chunk's (trailing ranks may get none)."""
    for rows in range(13):
        for world_size in range(1, 6):
            chunks = torch.arange(rows).chunk(world_size) if rows else ()
            for rank in range(world_size):
                start, end = row_range(rows, world_size, rank)
                want = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(start, end)) == want, (rows, world_size, rank)


def test_state_dict_keys_as_torch_names_them():
    model = {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}
    ddp = {"module.weight": torch.ones(2, 3), "module.bias": torch.ones(2)}
    assert list(consume_ddp_prefix(ddp, model)) == ["weight", "bias"]
    assert list(consume_ddp_prefix(ddp, {"module.weight": None})) == list(ddp)  # the model's own "module"
    with pytest.raises(TypeError, match="dict of tensors"):
        consume_ddp_prefix([1], model)
    state = {"weight": torch.zeros(3, 3), "extra": torch.zeros(1)}
    missing, unexpected, sizes = key_report(state, model)
    assert (missing, unexpected) == (["bias"], ["extra"])
    assert sizes == ["size mismatch for weight: copying a param with shape (3, 3) from checkpoint, the shape in "
                     "current model is (2, 3)."]
    with pytest.raises(RuntimeError, match='(?s)Unexpected key.*"extra".*Missing key.*"bias"'):
        raise_key_errors(missing, unexpected, [], True, "Net")
    raise_key_errors(missing, unexpected, [], False, "Net")  # strict=False: returned, not raised
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        raise_key_errors([], [], sizes, False, "Net")
    with pytest.raises(ValueError, match=r"load_state_dict\(assign=True\) would replace"):
        refuse_assign(True, "ZeRO")  # a wrapper's hooks and flat units hold the Parameter objects
    refuse_assign(False, "ZeRO")
