"""torch's state-dict APIs given the optimizer object the user built and handed to ZeRO
(FSDP2's spelling: ``opt = AdamW(groups); zero = ZeRO(model, opt)``, then
``get_optimizer_state_dict(zero, opt)``), on Hugging Face GPT-2 (tied wte / lm_head,
HF's two param groups) at stages 1 and 3 over 2 ranks:

- ``get_optimizer_state_dict(zero, opt)`` (sharded and full) and ``get_state_dict`` give
  the model's keys, and the same as with ``zero.param_optimizer``; before the first step
  as torch gives a plain model's (its lr-0 step), after 2 steps one process's values;
- ``set_optimizer_state_dict(zero, opt, ...)`` of one process's full state after 2 steps
  into a fresh ZeRO, then one more step, equals one process after 3 steps; a sharded
  state dict from the first ZeRO loads the same;
- ``torch.distributed.checkpoint.save({"optim": opt})`` (the optimizer as a Stateful:
  DCP calls its ``state_dict()``) writes each rank's rows, and ``load({"optim": other})``
  into a fresh ZeRO gives one process's state (on the code before, DCP kept rank 0's
  flat shard state for every rank);
- ``torch.save(opt.state_dict())`` stays the flat state of this rank's shards (integer
  keys, one per shard), loadable with ``opt.load_state_dict`` into the same layout.

Tolerance: float64; the wrappers average per-rank mean losses where one process takes
the mean of the whole batch (the same terms in another order, ~1e-16 relative per
gradient element), and AdamW is smooth in them: after 3 steps of lr 1e-2 each state
tensor is within 1e-12 of one process's, relative to its largest element (measured:
3e-14)."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.utils._pytree import tree_map_only

from plait.parallel.zero.module import ZeRO
from plait.testing import run_distributed
from tests.hf_models import tiny_gpt2

BATCH, SEQ, VOCAB = 4, 8, 64
FULL = StateDictOptions(full_state_dict=True)


def _gpt2(seed: int = 0):
    return tiny_gpt2(seed, VOCAB)


def _adamw(model):
    """HF's groups: no weight decay on biases and LayerNorms."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(10 + step))


def _train(model, step_fn, rank, world_size, steps):
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    for step in steps:
        tokens = _tokens(step)[rows]
        model(input_ids=tokens, labels=tokens).loss.backward()
        step_fn()


def _copy(state):
    return tree_map_only(torch.Tensor, lambda t: t.full_tensor().clone() if hasattr(t, "full_tensor") else t.clone(),
                         state)


def _worst(got, want) -> float:
    """The largest relative difference over the optimizer state; inf if keys differ."""
    if sorted(got["state"]) != sorted(want["state"]) or [g["params"] for g in got["param_groups"]] != \
            [g["params"] for g in want["param_groups"]]:
        return float("inf")
    worst = 0.0
    for key, entry in want["state"].items():
        if sorted(entry) != sorted(got["state"][key]):
            return float("inf")
        for name, value in entry.items():
            other = got["state"][key][name]
            scale = max(float(value.abs().max()), 1e-300)
            worst = max(worst, float((other.double() - value.double()).abs().max()) / scale)
    return worst


def _one_process():
    """A plain model and optimizer: torch's full optimizer state before any step (its
    lr-0 step), after 2 steps and after 3, with the model's state after 2."""
    model = _gpt2()
    optimizer = _adamw(model)

    def step():
        optimizer.step()
        optimizer.zero_grad()

    states = {"initial": _copy(get_optimizer_state_dict(model, optimizer, options=FULL))}
    _train(model, step, 0, 1, range(2))
    states["after2"] = _copy(get_optimizer_state_dict(model, optimizer, options=FULL))
    states["model2"] = _copy(model.state_dict())
    _train(model, step, 0, 1, [2])
    states["after3"] = _copy(get_optimizer_state_dict(model, optimizer, options=FULL))
    return states


def _zero_step(zero):
    def step():
        zero.step()
        zero.zero_grad()
    return step


def _worker(rank, world_size, directory):
    reference = _one_process()
    out = {}
    for stage in (1, 3):
        model = _gpt2()
        optimizer = _adamw(model)
        zero = ZeRO(model, optimizer, stage=stage)
        result = {"initial": _worst(_copy(get_optimizer_state_dict(zero, optimizer, options=FULL)),
                                    reference["initial"])}
        _train(zero, _zero_step(zero), rank, world_size, range(2))
        sharded = get_optimizer_state_dict(zero, optimizer)
        view = get_optimizer_state_dict(zero, zero.param_optimizer)
        result["sharded_keys"] = (sorted(sharded["state"]), sorted(view["state"]),
                                  [g["params"] for g in sharded["param_groups"]],
                                  [g["params"] for g in view["param_groups"]])
        result["sharded_vs_view"] = _worst(_copy(sharded), _copy(view))
        result["full_vs_one_process"] = _worst(_copy(get_optimizer_state_dict(zero, optimizer, options=FULL)),
                                               reference["after2"])
        result["get_state_dict"] = _worst(_copy(get_state_dict(zero, optimizer, options=FULL)[1]), reference["after2"])
        flat = optimizer.state_dict()  # torch.save's: the flat shards' state
        result["flat_keys"] = (sorted(flat["state"]), len(zero.units))

        # set: one process's full state after 2 steps into a fresh ZeRO, then one more step
        fresh_model = _gpt2(seed=1)
        fresh_optimizer = _adamw(fresh_model)
        fresh = ZeRO(fresh_model, fresh_optimizer, stage=stage)
        set_model_state_dict(fresh, reference["model2"], options=FULL)
        set_optimizer_state_dict(fresh, fresh_optimizer, reference["after2"], options=FULL)
        result["set_full"] = _worst(_copy(get_optimizer_state_dict(fresh, fresh.param_optimizer, options=FULL)),
                                    reference["after2"])
        _train(fresh, _zero_step(fresh), rank, world_size, [2])
        result["set_full_then_step"] = _worst(_copy(get_optimizer_state_dict(fresh, fresh_optimizer, options=FULL)),
                                              reference["after3"])

        # set: the first ZeRO's sharded (DTensor) state into a fresh one, then the flat one back
        other_model = _gpt2(seed=2)
        other_optimizer = _adamw(other_model)
        other = ZeRO(other_model, other_optimizer, stage=stage)
        set_optimizer_state_dict(other, other_optimizer, sharded)
        result["set_sharded"] = _worst(_copy(get_optimizer_state_dict(other, other.param_optimizer, options=FULL)),
                                       reference["after2"])
        dcp.save({"optim": optimizer}, checkpoint_id=os.path.join(directory, f"stage{stage}"))
        loaded_model = _gpt2(seed=4)
        loaded_optimizer = _adamw(loaded_model)
        loaded = ZeRO(loaded_model, loaded_optimizer, stage=stage)
        dcp.load({"optim": loaded_optimizer}, checkpoint_id=os.path.join(directory, f"stage{stage}"))
        result["dcp_stateful"] = _worst(
            _copy(get_optimizer_state_dict(loaded, loaded.param_optimizer, options=FULL)), reference["after2"])
        # dcp of the dict optimizer.state_dict() gives (not the Stateful): every rank's slice is kept
        dcp.save({"optim": optimizer.state_dict()}, checkpoint_id=os.path.join(directory, f"flat{stage}"))
        again_model = _gpt2(seed=5)
        again_optimizer = _adamw(again_model)
        again = ZeRO(again_model, again_optimizer, stage=stage)
        get_optimizer_state_dict(again, again_optimizer)  # the state made (torch's lr-0 step) to load into
        template = again_optimizer.state_dict()
        dcp.load({"optim": template}, checkpoint_id=os.path.join(directory, f"flat{stage}"))
        again_optimizer.load_state_dict(template)
        result["dcp_flat_dict"] = _worst(
            _copy(get_optimizer_state_dict(again, again.param_optimizer, options=FULL)), reference["after2"])
        last_model = _gpt2(seed=3)
        last_optimizer = _adamw(last_model)
        last = ZeRO(last_model, last_optimizer, stage=stage)
        last_optimizer.load_state_dict(flat)  # the same layout: the same shards' state
        if stage == 1:
            stage1_flat = flat
        else:  # stage 1's flat state into stage 3's units: another layout, refused by name
            try:
                last_optimizer.load_state_dict(stage1_flat)
                result["other_layout"] = "loaded"
            except ValueError as error:
                result["other_layout"] = str(error)
        result["flat_reload"] = _worst(_copy(get_optimizer_state_dict(last, last.param_optimizer, options=FULL)),
                                       reference["after2"])
        out[stage] = result
    return out


@pytest.mark.slow
def test_torch_state_dict_apis_take_the_optimizer_given_to_zero(tmp_path):
    for result in run_distributed(_worker, 2, str(tmp_path), timeout_s=240):
        for stage, got in result.items():
            keys, view_keys, groups, view_groups = got["sharded_keys"]
            assert keys == view_keys and groups == view_groups, stage
            assert "transformer.wte.weight" in keys and all(isinstance(key, str) for key in keys), (stage, keys)
            assert got["sharded_vs_view"] == 0.0, stage  # the same tensors, gathered the same way
            for name in ("initial", "full_vs_one_process", "get_state_dict", "set_full", "set_full_then_step",
                         "set_sharded", "dcp_stateful", "dcp_flat_dict", "flat_reload"):
                assert got[name] < 1e-12, (stage, name, got[name])
            if stage == 3:
                assert "loads only into the same layout" in got["other_layout"], got["other_layout"]
            flat_keys, units = got["flat_keys"]
            assert flat_keys == list(range(units)), (stage, flat_keys, units)
