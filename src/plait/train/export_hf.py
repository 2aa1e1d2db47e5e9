"""A Hugging Face model directory from a plait checkpoint: ``plait checkpoint export
--format hf --out DIR``, which ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.

DIR holds what ``save_pretrained`` writes: ``config.json`` (the model's config, its
``architectures`` and ``dtype``), ``model.safetensors`` (metadata ``{"format":
"pt"}``) with the model's own parameter names and one tensor per *tied group*:
a head tied to its embedding is stored once, under the name the model lists first
(GPT-2's ``transformer.wte.weight``; ``lm_head.weight`` is left out, as
``save_pretrained`` leaves it out, and ``from_pretrained`` ties it again), and the
tokenizer files the run saved (``tokenizer.json``, ``tokenizer_config.json``, ...
in the checkpoint or its run directory), if it used one.

- A run of ``plait train --model hf:CONFIG``: the manifest's model is ``{"kind":
  "hf", "model_type", sizes, "config_sha256", "dtype"}`` and the HF config is the
  ``config.json`` beside the shards (else in the run directory), checked against that
  sha256 (plait.train.hf_model writes both); the checkpoint's tensors (tp slices
  joined by ``load_full``) are the HF model's state dict, checked name by name and
  shape by shape against the model that config builds (on the meta device: no
  memory), every tied group holding one value.
- A run of plait's own GPT (``--model gpt``) is written as ``GPT2LMHeadModel``
  exactly: the same pre-LayerNorm block, ``activation_function="gelu"`` (erf GeLU,
  plait's), eps 1e-5, learned positions, the fused qkv rows reordered from plait's
  head-major (heads, 3, head_dim) to GPT-2's (3, heads, head_dim) and every matrix
  transposed into GPT-2's Conv1D (in, out) layout. Its vocabulary is plait's
  character corpus, not a HF tokenizer, so no tokenizer files are written.
- plait's MLP has no HF architecture: refused by name (export it as safetensors).

Cost: the checkpoint is read once (every shard) and the model written once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Callable

import torch

from plait.models.gpt import LAYER_NORM_EPS, GPTConfig
from plait.train.atomic_files import atomic_write
from plait.train.checkpoint import resolve
from plait.train.checkpoint_checks import check_user_path, cut
from plait.train.checkpoint_load import load_full

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
WRITTEN = (CONFIG_NAME, WEIGHTS_NAME, *TOKENIZER_FILES)
# keys of a HF config dict that say who wrote it, not what the model is
_VOLATILE_KEYS = ("transformers_version", "_name_or_path", "architectures")


# ----------------------------------------------------------------------------- the config

def hf_config(values: dict):
    """The ``transformers`` config of a HF config dict (config.json's, model_type
    included), built by its model_type's config class."""
    from transformers import AutoConfig  # imported where used: transformers is the optional hf extra, slow to import

    values = {key: value for key, value in values.items() if key not in _VOLATILE_KEYS}
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError("the checkpoint's config.json has no model_type: it was not written by plait train "
                         "--model hf:")
    try:
        return AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as error:
        raise ValueError(f"the checkpoint's HF model_type {model_type!r} is not one this transformers knows "
                         f"({error}); export with the transformers version that trained it") from None


def _beside(checkpoint_dir: Path) -> list[Path]:
    """Where a run keeps its HF files: the checkpoint directory, then its run directory."""
    places = [checkpoint_dir]
    if checkpoint_dir.parent.name == "checkpoints":
        places.append(checkpoint_dir.parent.parent)
    return places


def _regular(path: Path) -> bool:
    return os.path.lexists(path) and stat.S_ISREG(os.lstat(path).st_mode)


def checkpoint_hf_config(checkpoint_dir: str | os.PathLike, manifest: dict):
    """The HF config a --model hf: checkpoint was trained with: its config.json (else
    the run's), whose sha256 must be the manifest's model "config_sha256"."""
    checkpoint_dir = Path(checkpoint_dir)
    wanted = (manifest.get("model") or {}).get("config_sha256")
    found = [place / CONFIG_NAME for place in _beside(checkpoint_dir) if _regular(place / CONFIG_NAME)]
    for path in found:
        data = path.read_bytes()
        if wanted is None or hashlib.sha256(data).hexdigest() == wanted:
            try:
                return hf_config(json.loads(data))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ValueError(f"{path} is not JSON ({error}): the HF config of the checkpoint is damaged") from None
    if found:
        raise ValueError(f"{cut(str(found[0]))}: sha256 differs from the manifest's config_sha256 {wanted}: the HF "
                         "config was changed after training; put back the config.json the run wrote")
    raise ValueError(f"{cut(str(checkpoint_dir))} has no {CONFIG_NAME} (nor its run directory): a --model hf: "
                     "checkpoint keeps the HF config beside its shards; copy the run's config.json there")


def gpt2_config(model: dict):
    """GPT2Config equal to plait's GPT of manifest ``model`` ({"kind": "gpt", GPTConfig's fields})."""
    from transformers import GPT2Config  # the optional hf extra, imported where used

    config = GPTConfig(**{key: value for key, value in model.items() if key != "kind"})
    return GPT2Config(vocab_size=config.vocab, n_positions=config.seq_len, n_embd=config.hidden,
                      n_layer=config.layers, n_head=config.heads, n_inner=config.ffn, activation_function="gelu",
                      resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
                      layer_norm_epsilon=LAYER_NORM_EPS, tie_word_embeddings=config.tied_head,
                      bos_token_id=None, eos_token_id=None)


def gpt2_state_dict(model: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """plait GPT's unsharded state dict in GPT2LMHeadModel's names and layouts.
    qkv: plait's rows are (heads, 3, head_dim) [q_0 k_0 v_0 q_1 ...], GPT-2's columns
    (3, heads, head_dim) [q_0 q_1 ... k_0 ...]; every nn.Linear weight (out, in)
    becomes a Conv1D weight (in, out)."""
    config = GPTConfig(**{key: value for key, value in model.items() if key != "kind"})
    heads, head_dim, hidden = config.heads, config.hidden // config.heads, config.hidden

    def qkv_rows(tensor: torch.Tensor) -> torch.Tensor:  # (3h, ...) head-major -> (3h, ...) q|k|v-major
        return tensor.reshape(heads, 3, head_dim, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)

    out = {"transformer.wte.weight": state["embedding.weight"], "transformer.wpe.weight": state["position"],
           "transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": state["ln_f.bias"]}
    if not config.tied_head:
        out["lm_head.weight"] = state["head"]
    for layer in range(config.layers):
        plait, hf = f"blocks.{layer}.", f"transformer.h.{layer}."
        for mine, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            for kind in ("weight", "bias"):
                out[f"{hf}{theirs}.{kind}"] = state[f"{plait}{mine}.{kind}"]
        out[f"{hf}attn.c_attn.weight"] = qkv_rows(state[f"{plait}attention.qkv.weight"]).t()  # (h, 3h)
        out[f"{hf}attn.c_attn.bias"] = qkv_rows(state[f"{plait}attention.qkv.bias"])
        for mine, theirs in (("attention.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            out[f"{hf}{theirs}.weight"] = state[f"{plait}{mine}.weight"].t()
            out[f"{hf}{theirs}.bias"] = state[f"{plait}{mine}.bias"]
    assert config.layers == 0 or out["transformer.h.0.attn.c_attn.weight"].shape == (hidden, 3 * hidden)
    return {name: tensor.contiguous() for name, tensor in out.items()}


# ----------------------------------------------------------------------------- the weights

def meta_model(config) -> torch.nn.Module:
    """The causal LM ``config`` builds, on the meta device (shapes and names, no memory)."""
    from transformers import AutoModelForCausalLM  # the optional hf extra, imported where used

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def parameter_groups(config_or_model) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{names of one tensor: its shape} over the model's state dict (parameters and
    persistent buffers), in the model's order: a tied head and its embedding are one
    entry, ("transformer.wte.weight", "lm_head.weight")."""
    model = config_or_model if isinstance(config_or_model, torch.nn.Module) else meta_model(config_or_model)
    keys = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for name, value in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in keys:  # persistent buffers only
            groups.setdefault(id(value), []).append(name)
            shapes[id(value)] = tuple(value.shape)
    return {tuple(names): shapes[key] for key, names in groups.items()}


def hf_state_dict(config, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """(what model.safetensors holds, the model's class name): ``state`` checked against
    the model ``config`` builds (meta device): every parameter and persistent buffer
    present under one of its names with its shape, nothing else; a tied group (one
    Parameter under several names) stored once under its first name, its values equal
    wherever ``state`` repeats it. ValueError naming what differs."""
    model = meta_model(config)
    groups = parameter_groups(model)
    known = {name for names in groups for name in names}
    unexpected = sorted(set(state) - known)
    out, missing, wrong, untied = {}, [], [], []
    for names, shape in groups.items():
        present = [name for name in names if name in state]
        if not present:
            missing.append(names[0])
            continue
        value = state[present[0]]
        if tuple(value.shape) != shape:
            wrong.append(f"{present[0]} {tuple(value.shape)} != {shape}")
            continue
        if any(not torch.equal(state[name], value) for name in present[1:]):
            untied.append(" and ".join(present))
        out[names[0]] = value.detach().cpu().contiguous()
    problems = ([f"missing {cut(', '.join(missing))}"] if missing else []) \
        + ([f"not in the model: {cut(', '.join(unexpected))}"] if unexpected else []) \
        + ([f"shapes differ: {cut('; '.join(wrong))}"] if wrong else []) \
        + ([f"tied in the config but different in the checkpoint: {cut('; '.join(untied))} (trained with "
            "tie_word_embeddings false?)"] if untied else [])
    if problems:
        raise ValueError(f"the checkpoint is not the state of the {type(model).__name__} its config builds: "
                         + "; ".join(problems) + ": export the checkpoint of the run that trained this config")
    return out, type(model).__name__


# ----------------------------------------------------------------------------- the directory

def check_out_dir(out_dir: str | os.PathLike, what: str = "--out") -> Path:
    """``out_dir`` as a Path: absent, an empty directory, or one an export wrote (only
    its file names); refused in one line otherwise (a file, a link, other files, which
    from_pretrained might read instead: sharded weights, an index, another format)."""
    out_dir = check_user_path(out_dir, what)
    if out_dir.is_symlink():
        raise ValueError(f"{what} {cut(str(out_dir))} is a symbolic link: give the directory itself "
                         f"({cut(os.path.realpath(out_dir))}) or a new path")
    if not out_dir.exists():
        return out_dir
    if not out_dir.is_dir():
        raise ValueError(f"{what} {cut(str(out_dir))} is not a directory: --format hf writes a directory "
                         "(config.json, model.safetensors, tokenizer); give a new path")
    others = sorted(name for name in os.listdir(out_dir) if name not in WRITTEN)
    if others:
        raise ValueError(f"{what} {cut(str(out_dir))} holds other files ({cut(', '.join(others))}) that "
                         "from_pretrained could read with the export: give an empty or new directory")
    return out_dir


def tokenizer_files(checkpoint_dir: Path) -> list[Path]:
    """The tokenizer files the run saved (TOKENIZER_FILES, regular files): those in the
    checkpoint directory, else those in its run directory."""
    for place in _beside(checkpoint_dir):
        found = [place / name for name in TOKENIZER_FILES if _regular(place / name)]
        if found:
            return found
    return []


def export_hf(path: str | os.PathLike, out_dir: str | os.PathLike, log: Callable[[str], None] | None = print, *,
              check_files: bool = True) -> tuple[Path, dict]:
    """Write the HF model directory of a checkpoint (or a run directory's latest
    complete one) to ``out_dir`` (module docstring); returns (out_dir, what was
    written: {"architecture", "step", "tensors", "tokenizer": [names]})."""
    from safetensors.torch import save_file  # the optional hf extra, imported where used

    out_dir = check_out_dir(out_dir)
    directory, verified = resolve(path, log=log)
    manifest, state, _, _ = load_full(directory, check_files=check_files and not verified)
    model = manifest.get("model") or {}
    kind = model.get("kind", "gpt")
    if kind == "hf":
        config = checkpoint_hf_config(directory, manifest)
        tokenizer = tokenizer_files(directory)
    elif kind == "gpt":
        config, state, tokenizer = gpt2_config(model), gpt2_state_dict(model, state), []
    else:
        raise ValueError(f"--format hf: {directory} holds plait's {kind!r} model, which has no Hugging Face "
                         "architecture: export it with --format safetensors (plait's names), or train --model hf:")
    weights, architecture = hf_state_dict(config, state)
    dtypes = sorted({str(tensor.dtype).removeprefix("torch.") for tensor in weights.values()
                     if tensor.is_floating_point()})
    config.architectures = [architecture]
    config.dtype = dtypes[0] if len(dtypes) == 1 else None  # from_pretrained's dtype="auto" takes it
    config_text = config.to_json_string(use_diff=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / WEIGHTS_NAME, lambda temp: save_file(weights, temp, metadata={"format": "pt"}))
    for source in tokenizer:
        atomic_write(out_dir / source.name, lambda temp, source=source: shutil.copyfile(source, temp))
    atomic_write(out_dir / CONFIG_NAME, lambda temp: Path(temp).write_text(config_text))  # last: the directory is whole
    return out_dir, {"architecture": architecture, "step": manifest.get("step"), "tensors": len(weights),
                     "tokenizer": [source.name for source in tokenizer]}
