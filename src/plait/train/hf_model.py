"""``plait train --model hf:CONFIG``: a Hugging Face causal language model built from a
local ``config.json`` (or a directory holding one) for plait's trainer.

- the model: ``AutoModelForCausalLM.from_config(config)`` after ``torch.manual_seed(seed)``
  (every rank builds the same weights), or ``from_pretrained(directory,
  local_files_only=True)`` when the directory holds weights (``model.safetensors``,
  ``pytorch_model.bin`` or their sharded index); then cast to the run's ``dtype``.
  Nothing is downloaded. The config must be one AutoModelForCausalLM builds.
- the trainer runs ``CausalLMLogits(model)``: ``input_ids (b, s) -> logits (b, s, V)``
  (no key/value cache, HF's default causal mask and positions); the loss is the mean
  token cross-entropy against the shifted targets the data gives, as plait's GPT.
- parameters keep their HF names (``model.named_parameters()``: a tied head is listed
  once, as its embedding ``transformer.wte.weight``), so checkpoints speak HF names.
- ``blocks(model)``: the decoder blocks, the model's largest ``nn.ModuleList``
  (``transformer.h.N`` for GPT-2, ``model.layers.N`` for Llama, ...). ZeRO stage 3
  gathers one unit per block (``zero_units``), and recomputation re-runs blocks
  (``set_recompute``): full keeps each block's inputs and re-runs the block in the
  backward, as plait's GPT does; selective re-runs the block's attention module, which
  is the attention core (QKᵀ, softmax, ·V) *and* its q/k/v and output projections (HF
  modules do not expose the core alone), so it keeps the attention input instead of
  plait's GPT's qkv.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten

from plait.memory.recompute import check_mode, recompute
from plait.names.recompute import FULL, NONE, SELECTIVE
from plait.train.atomic_files import atomic_write
CONFIG_NAME = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# keys of HF's config dict that say who wrote it, not what the model is (left out of the checkpoint's description)
_VOLATILE_KEYS = ("transformers_version", "_name_or_path", "architectures")
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")


def config_file(source: str) -> Path:
    """The config.json ``source`` names (itself, or the one in a directory), refused by name."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"--model hf:{source}: {path} does not exist; give a Hugging Face config.json or a directory "
                         f"holding one (written by config.save_pretrained(DIR)); nothing is downloaded")
    if path.is_dir():
        path = path / CONFIG_NAME
        if not path.is_file():
            raise ValueError(f"--model hf:{source}: the directory holds no {CONFIG_NAME}; give a Hugging Face "
                             f"config.json or a directory holding one (config.save_pretrained(DIR))")
    return path


def load_config(source: str):
    """The ``transformers`` config of ``source``: its model_type's config class, checked
    to be a causal language model AutoModelForCausalLM builds."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = config_file(source)
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--model hf:{source}: cannot read {path} as JSON ({error}); give a Hugging Face "
                         "config.json") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ValueError(f"--model hf:{source}: {path} has no \"model_type\" (e.g. \"gpt2\", \"llama\"); give a "
                         "Hugging Face config.json (config.save_pretrained(DIR) writes one)")
    model_type = values.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as error:
        raise ValueError(f"--model hf:{source}: model_type {model_type!r} is not one this transformers knows "
                         f"({error})") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"--model hf:{source}: model_type {model_type!r} ({type(config).__name__}) is not a causal "
                         "language model (AutoModelForCausalLM has no class for it); plait train trains next-token "
                         "prediction: give a decoder LM's config (e.g. gpt2, llama)")
    config.use_cache = False  # training: no key/value cache
    return config


def has_weights(source: str) -> bool:
    """``source`` is a directory holding saved weights (from_pretrained loads them)."""
    path = Path(source).expanduser()
    return path.is_dir() and any((path / name).is_file() for name in WEIGHT_FILES)


def build(source: str, *, dtype: str, seed: int) -> nn.Module:
    """The causal LM of ``source`` (module docstring), in ``dtype``, in training mode."""
    from transformers import AutoModelForCausalLM

    config = load_config(source)
    if has_weights(source):
        model = AutoModelForCausalLM.from_pretrained(Path(source).expanduser(), config=config, local_files_only=True)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, dtype))
    check_causal(model, source)
    return model.train()


@torch.no_grad()
def check_causal(model: nn.Module, source: str) -> None:
    """Refuse a model whose position 0 sees later tokens (e.g. BertLMHeadModel without
    is_decoder=True attends both ways: trained on next tokens it would read the answer).
    Two eval-mode forwards of 2 tokens that differ only in the second: position 0's
    logits must be equal."""
    was_training = model.training
    model.eval()
    try:
        first, second = (model(input_ids=torch.tensor([[0, token]]), use_cache=False).logits[0, 0]
                         for token in (0, min(1, vocab_size(model.config) - 1)))
    finally:
        model.train(was_training)
    if not torch.equal(first, second):
        raise ValueError(f"--model hf:{source}: {type(model).__name__} is not causal (position 0's logits change with "
                         "the token after it): it would see the tokens it predicts; use a decoder config (e.g. "
                         "is_decoder=true for BERT-style LM heads, or a GPT-2 / Llama config)")


def config_json(config) -> str:
    """The HF config as the JSON text ``from_pretrained`` reads (every field, defaults
    included, sorted; without who wrote it): written as config.json into the run
    directory and every checkpoint, its sha256 kept in the checkpoint's manifest."""
    values = json.loads(config.to_json_string(use_diff=False))
    kept = {key: value for key, value in values.items() if key not in _VOLATILE_KEYS}
    return json.dumps(kept, indent=2, sort_keys=True) + "\n"


def description(config, dtype: str) -> dict:
    """What fixes the parameters, compared with a checkpoint's (flat, as a manifest
    holds it): the architecture's sizes for the reader, the parameter count (a tied
    weight once; verify checks the shards against it), the sha256 of config_json for
    the rest, and the dtype."""
    sizes = {name: getattr(config, name, None) for name in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                              "num_attention_heads")}
    return {"kind": "hf", "model_type": config.model_type, **{k: v for k, v in sizes.items() if isinstance(v, int)},
            "parameters": parameter_count(config),
            "config_sha256": hashlib.sha256(config_json(config).encode()).hexdigest(), "dtype": dtype}


def vocab_size(config) -> int:
    return int(config.vocab_size)


def positions(config) -> int | None:
    """The longest sequence the model's positions cover (None: not bounded, e.g. rotary)."""
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def check_fits(config, source: str, *, data_vocab: int, seq_len: int, what: str = "the tokenizer's") -> None:
    """The model's vocabulary covers the tokenizer's ids, and its positions the
    sequence length; refused naming both sizes."""
    problems = []
    if vocab_size(config) < data_vocab:
        problems.append(f"the model's vocab_size ({vocab_size(config)}) is smaller than the data's vocabulary "
                        f"({data_vocab} ids: {what}): token ids past {vocab_size(config) - 1} have no embedding; use a config with "
                        f"vocab_size >= {data_vocab} or a smaller tokenizer")
    longest = positions(config)
    if longest is not None and seq_len > longest:
        problems.append(f"seq_len({seq_len}) > the model's {longest} positions: use --seq-len <= {longest} or a "
                        "config with more positions")
    if problems:
        raise ValueError(f"--model hf:{source}: " + "; ".join(problems))


class CausalLMLogits(nn.Module):
    """``input_ids (b, s) -> logits (b, s, V)`` of a HF causal LM (no cache)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.lm = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy: logits (b, s, V), targets (b, s)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class CausalLMStep(CausalLMLogits):
    """``(input_ids (b, s), targets (b, s)) -> the mean next-token cross-entropy``: a HF
    causal LM with its loss inside, the training step the auto-parallel planner traces
    (``plait plan --auto --model hf:``, ``plait train --plan``); parameters ``lm.<HF name>``."""

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(super().forward(input_ids), targets)


def causal_lm_step(source: str, seq_len: int | None, global_batch: int) -> tuple[nn.Module, tuple]:
    """(CausalLMStep of ``source`` (fresh weights, seed 0, float32, training mode), (input_ids,
    targets) of ``global_batch`` seeded windows of ``seq_len`` tokens (default: the config's
    positions)): the same module and inputs wherever it is built, so a saved plan's node
    names match its re-trace."""
    config = load_config(source)
    seq_len = seq_len or positions(config)
    if not seq_len:
        raise ValueError(f"--model hf:{source}: the config names no positions; give --seq N")
    model = CausalLMStep(build(source, dtype="float32", seed=0))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, int(config.vocab_size), (global_batch, seq_len + 1), generator=generator)
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks: the model's nn.ModuleList holding the most parameters."""
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList) and len(module)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of decoder blocks: plait finds a HF model's "
                         "blocks as its largest ModuleList (transformer.h, model.layers)")
    return list(max(lists, key=lambda found: sum(param.numel() for param in found.parameters())))


def zero_units(model: nn.Module) -> nn.ModuleList:
    """ZeRO stage 3's units: one per decoder block, and every other child holding
    parameters outside them (embeddings, final norm, head; containers looked inside).
    Given to ShardedOptimizer(modules=[...]) it gathers each around its forward and
    backward; a parameter two units share (a tied head) stays gathered."""
    decoder = blocks(model)
    inside = {id(module) for block in decoder for module in block.modules()}
    ancestors = {id(module) for module in model.modules()
                 if any(id(sub) == id(decoder[0]) for sub in module.modules()) and id(module) not in inside}
    units: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if id(child) == id(decoder[0]):
                units.extend(decoder)
            elif id(child) in ancestors:
                walk(child)
            elif id(child) not in inside and any(True for _ in child.parameters()):
                units.append(child)

    walk(model)
    return nn.ModuleList(units)


def attention_of(block: nn.Module, required: bool = True) -> nn.Module | None:
    for name in ATTENTION_NAMES:
        if isinstance(getattr(block, name, None), nn.Module):
            return getattr(block, name)
    if not required:
        return None
    raise ValueError(f"recompute='selective': {type(block).__name__} has no attention submodule named "
                     f"{' / '.join(ATTENTION_NAMES)}; use recompute=full (the whole block) or none")


def _recomputed_forward(module: nn.Module, name: str, on_recompute):
    """``module``'s forward run through plait.memory.recompute: its tensor arguments
    (positional and keyword, nested tuples included: Llama's (cos, sin)) are kept, the
    rest re-run in the backward."""
    original = type(module).forward

    def forward(*args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        where = [index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

        def run(*tensors):
            filled = list(leaves)
            for index, tensor in zip(where, tensors):
                filled[index] = tensor
            inner_args, inner_kwargs = tree_unflatten(filled, spec)
            return original(module, *inner_args, **inner_kwargs)

        return recompute(run, *(leaves[index] for index in where), name=name, on_recompute=on_recompute)

    return forward


def set_recompute(decoder: list[nn.Module], mode: str, layers: int | None = None, on_recompute=None) -> None:
    """``mode`` (none | selective | full, module docstring) for the first ``layers`` of
    the decoder blocks ``decoder`` (None: all; ``blocks(model)``, or a pipeline chunk's).
    The block's (or its attention's) forward is replaced on that instance only: its
    class, hooks and parameters stay as they are."""
    check_mode(mode)
    count = len(decoder) if layers is None else min(layers, len(decoder))
    for index, block in enumerate(decoder):
        chosen = mode if index < count else NONE
        for module in (block, attention_of(block, required=False)):
            if module is not None:
                module.__dict__.pop("forward", None)  # back to the class's
        if chosen == FULL:
            block.forward = _recomputed_forward(block, f"decoder block {index}", on_recompute)
        elif chosen == SELECTIVE:
            attention = attention_of(block)
            attention.forward = _recomputed_forward(attention, f"attention of decoder block {index}", on_recompute)


def parameter_count(config) -> int:
    """Parameters of the model of ``config`` (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(param.numel() for param in model.parameters())


def write_config(directory, text: str | None, data=None) -> None:
    """``directory/config.json``: an hf model's config_json (what ``from_pretrained``
    reads next to exported weights); nothing for plait's own models (None). With
    ``data`` read through a tokenizer (plait.train.text_data), its tokenizer.json and
    tokenizer_config.json too (what ``AutoTokenizer.from_pretrained`` reads)."""
    if text is None:
        return
    atomic_write(Path(directory) / CONFIG_NAME, lambda temporary: Path(temporary).write_text(text))
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def train_flops(config, global_batch: int, seq_len: int) -> float:
    """Model FLOPs of one optimiser step: (6·N + 12·l·h·s) per token (PaLM's count: 6N
    for the weights, N every parameter; 12·l·h·s for the attention scores and their
    use), times global_batch · seq_len tokens."""
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return float(global_batch * seq_len * (6 * parameter_count(config) + 12 * layers * hidden * seq_len))


def free_unheld(model: nn.Module, held) -> int:
    """Release the storage of ``model``'s parameters this rank does not hold (``held``:
    the parameters of its pipeline chunks); the model object stays (the split's stages
    read its modes) but only the held parameters keep memory. Returns the elements freed."""
    kept = {id(param) for param in held}
    freed = 0
    with torch.no_grad():
        for param in model.parameters():
            if id(param) not in kept and param.numel():
                freed += param.numel()
                param.data = param.data.new_empty(0)
    return freed
