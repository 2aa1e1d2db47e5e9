"""torch.distributed.checkpoint (DCP) beside plait's own checkpoint:
``plait train --checkpoint-format dcp``.

plait's verified sharded files stay the checkpoint a run resumes from; with ``dcp``
each checkpoint also holds ``CHECKPOINT/dcp/`` (``.metadata`` and ``__0_0.distcp``)
in torch's format, so torch's own tools read it without plait::

    {"model": {name: full tensor},                     # model.state_dict()'s keys
     "optimizer": {"state": {name: {"step", "exp_avg", "exp_avg_sq"} | {"momentum_buffer"}},
                   "param_groups": [{"lr", "betas", "weight_decay", ..., "params": [name, ...]}]}}

the layout of torch.distributed.checkpoint.state_dict's ``get_state_dict(model,
optimizer)`` for the unsharded model and its AdamW/SGD (``make_optimizer``'s two
groups, the lr of the last step taken). Every tensor is whole (unsharded, whatever the
run's dp/ZeRO/tp/pp): rank 0 writes the DCP from the shards every (tp, pp) coordinate
has just written (their tp slices joined as ``load_full`` joins them), before the
manifest, so a checkpoint that is complete holds its DCP. A tied head is listed
under every name model.state_dict() gives it (HF: ``lm_head.weight`` too), so a strict
``dcp.load`` into a plain model's state dict finds every key.

Read it with torch alone::

    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id="RUN/checkpoints/step_00000100/dcp")  # 1 process: no_dist
    model.load_state_dict(state["model"])
    dcp_to_torch_save("RUN/checkpoints/step_00000100/dcp", "full.pt")    # one torch.save file

Cost: rank 0 reads the shards back and writes every tensor once more (about the
plait checkpoint's size again), while the other ranks wait at the save's barrier.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from plait.train.build import make_optimizer
from plait.train.checkpoint_load import load_full
from plait.train.config import TrainConfig
from plait.train.export_hf import checkpoint_hf_config, parameter_groups

DCP_DIR = "dcp"
MODEL_KEY, OPTIMIZER_KEY = "model", "optimizer"


def dcp_path(checkpoint_dir: str | os.PathLike) -> Path:
    """Where a checkpoint's DCP copy lives: CHECKPOINT/dcp."""
    return Path(checkpoint_dir) / DCP_DIR


def param_groups(config: TrainConfig, model: dict[str, torch.Tensor], step: int) -> list[dict]:
    """The optimizer's param_groups as torch's get_optimizer_state_dict gives them:
    make_optimizer's groups over the unsharded model (hyperparameters as the
    optimizer holds them, "params" as names), with the lr of step ``step - 1`` (the
    last one taken: train_step sets each step's lr before stepping)."""
    placeholders = {name: torch.nn.Parameter(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
                    for name, tensor in model.items()}
    name_of = {id(param): name for name, param in placeholders.items()}
    optimizer = make_optimizer(placeholders.items(), config)
    lr = config.lr_at(max(step - 1, 0))
    return [{**{key: value for key, value in group.items() if key != "params"}, "lr": lr,
             "params": [name_of[id(param)] for param in group["params"]]} for group in optimizer.param_groups]


def tied_aliases(directory: Path, manifest: dict, model: dict[str, torch.Tensor]) -> dict[str, str]:
    """{alias: name held} for a HF model's tied parameters (lm_head.weight ->
    transformer.wte.weight), from its config (the checkpoint's config.json) built on
    the meta device; {} for plait's models (their state dicts name a tied head once)."""
    if (manifest.get("model") or {}).get("kind") != "hf":
        return {}
    aliases = {}
    for names in parameter_groups(checkpoint_hf_config(directory, manifest)):
        held = [name for name in names if name in model]
        aliases.update({name: held[0] for name in names if held and name not in model})
    return aliases


def dcp_state(directory: Path, manifest: dict, model: dict, optimizer: dict, config: TrainConfig) -> dict:
    """The DCP state dict of a checkpoint's full tensors (module docstring)."""
    step = int(manifest["step"])
    full_model = dict(model)
    for alias, name in tied_aliases(directory, manifest, model).items():
        full_model[alias] = model[name]
    state = {name: {key: value if torch.is_tensor(value) else torch.tensor(value) for key, value in entry.items()}
             for name, entry in optimizer.items()}
    return {MODEL_KEY: full_model,
            OPTIMIZER_KEY: {"state": state, "param_groups": param_groups(config, model, step)}}


def write_dcp(directory: str | os.PathLike, manifest: dict, files: list[dict], config: TrainConfig) -> Path:
    """Write CHECKPOINT/dcp from the shards just written (``files``: write_shard's
    entries; ``manifest``: the one about to be written). One process (rank 0):
    ``dcp.save(..., no_dist=True)`` into a temporary directory renamed into place."""
    directory = Path(directory)
    pending = {**manifest, "files": {entry["name"]: entry for entry in files}}
    _, model, optimizer, _ = load_full(directory, check_files=False, manifest=pending)
    state = dcp_state(directory, pending, model, optimizer, config)
    temporary, final = directory / f".{DCP_DIR}.tmp", dcp_path(directory)
    for stale in (temporary, final):  # a save interrupted before its manifest left them: not a checkpoint's
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(temporary), no_dist=True)
    os.rename(temporary, final)
    return final
