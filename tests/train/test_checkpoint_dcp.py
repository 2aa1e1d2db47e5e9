"""plait train --checkpoint-format dcp: every checkpoint also holds CHECKPOINT/dcp in
torch.distributed.checkpoint's format, read by torch's own tools in one process:

- a tp=2 run of HF GPT-2 (tied head; plait train --model hf:, float64, 2 processes,
  one run_distributed call for the session, which also logs to TensorBoard and is
  exported to HF format by tests/train/test_tensorboard.py and test_export_hf.py):
  each tp rank holds half of every matrix (the fused c_attn as q_r|k_r|v_r); torch's
  ``dcp.load`` into a plain 1-process model's ``state_dict()`` (strict: the tied
  ``lm_head.weight`` is listed too) and into the state dict torch's
  ``get_optimizer_state_dict`` makes of a plain AdamW over it, then
  ``set_optimizer_state_dict``, gives bit for bit what plait's verified checkpoint
  holds, and the parameters of the same model trained by one plain torch process
  (tests/train/test_train_hf.py's reference) within float64 roundoff (the layouts
  sum in another order: ~1e-15 per step, stated bound 1e-10 as there); param_groups
  carry the last step's lr; ``dcp_to_torch_save`` writes one file holding the same;
- the tied head's two names, from plait's own writer in one process.

Seen failing on the pre-issue code (PYTHONPATH=/work/base34/src): TrainConfig has no
checkpoint_format there ("unknown TrainConfig field"), and plait.train.checkpoint_dcp
does not exist (ImportError at collection); with the tied aliases left out, torch's
strict load says "Missing key in checkpoint state_dict: model.lm_head.weight"."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from plait.train import checkpoint as ckpt
from plait.train.build import make_optimizer
from plait.train.checkpoint_dcp import dcp_path, write_dcp
from plait.train.checkpoint_load import load_full
from plait.train.config import TrainConfig
from tests.hf_models import tiny_gpt2
from tests.train.test_export_hf import close, write_hf_checkpoint


@pytest.mark.slow
def test_torch_reads_the_dcp_copy_of_a_tp2_run(hf_tp2_run, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config, want = hf_tp2_run
    directory = ckpt.latest_complete(config.out, log=None)
    assert directory is not None and directory.name == f"step_{config.steps:08d}"
    _, saved_model, saved_optimizer, _ = load_full(directory)  # plait's verified checkpoint
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.hf_source)).double()  # untrained
    optimizer = make_optimizer(model.named_parameters(), config)
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=dcp_path(directory))  # torch alone, no process group
    model.load_state_dict(state["model"])  # strict
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), saved_model[name]), name  # bit for bit
        assert close(param.detach(), want[name]), name  # what one process trains
        assert not close(param.detach(), want[name] + 1e-6), name  # the comparison can fail
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[param][key], saved_optimizer[name][key]), (name, key)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert [group["lr"] for group in optimizer.param_groups] == [config.lr_at(config.steps - 1)] * 2
    dcp_to_torch_save(dcp_path(directory), tmp_path / "full.pt")
    whole = torch.load(tmp_path / "full.pt", weights_only=True)
    assert all(torch.equal(whole["model"][key], value) for key, value in saved_model.items())


def test_a_tied_hf_head_is_listed_under_both_names(tmp_path):
    from transformers import GPT2LMHeadModel

    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.wte.weight.add_(1.0)  # not the init
    directory = write_hf_checkpoint(tmp_path / "run", 2, model)
    files = [{"name": path.name} for path in sorted(directory.glob("tp*-pp*.pt"))]
    write_dcp(directory, {"step": 2, "mesh": {"dp": 1, "tp": 2, "pp": 1}, **_manifest_model(directory)}, files,
              TrainConfig())
    fresh = GPT2LMHeadModel(model.config).double()
    state = {"model": fresh.state_dict()}
    assert "lm_head.weight" in state["model"]
    dcp.load(state, checkpoint_id=dcp_path(directory))  # strict: every key of the plain model found
    fresh.load_state_dict(state["model"])
    assert torch.equal(fresh.lm_head.weight, model.transformer.wte.weight)
    assert all(torch.equal(param, dict(model.named_parameters())[key]) for key, param in fresh.named_parameters())


def _manifest_model(directory) -> dict:
    return {"model": json.loads((directory / "manifest.json").read_text())["model"]}
