"""What a training run is made of, from its TrainConfig: the data (the corpus for the
GPT, the digits for the MLP), the model at this rank's tensor-parallel degree cut
into sequential layers, the optimiser, and each step's batch (a deterministic
function of (seed, step), this dp rank's slice of it)."""

from __future__ import annotations

import sysconfig
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from plait.models.gpt import GPTConfig
from plait.models.mlp import MLP
from plait.train import hf_layout, hf_model
from plait.train.config import TrainConfig
from plait.train.data import load_digits, rank_batch


def load_data(config: TrainConfig, cache_dir=None):
    """The corpus (GPT, and hf models without a tokenizer; cached under ``cache_dir``,
    None: not cached, see load_corpus), an hf model's tokenized text (--tokenizer;
    plait.train.text_data, cached likewise) or the digits (MLP)."""
    if config.hf_source is not None and config.tokenizer:
        from plait.train.text_data import load_text_data  # imports tokenizers: only for a tokenizer

        return load_text_data(_text_files(config), tokenizer=config.tokenizer, text_field=config.text_field,
                              val_fraction=config.val_fraction, cache_dir=cache_dir)
    if config.model == "gpt" or config.hf_source is not None:
        from plait.train.corpus import load_corpus

        return load_corpus(config.data, max_bytes=config.data_max_bytes, val_fraction=config.val_fraction,
                           cache_dir=cache_dir)

    return load_digits(seed=config.seed, dtype=getattr(torch, config.dtype))  # the model's dtype (float64 too)


def _text_files(config: TrainConfig):
    """--data for a tokenizer: the path(s) given, or for "stdlib" the standard library's
    first sources (sorted) up to data_max_bytes, whole files, as the char corpus reads them."""
    if config.data != "stdlib":
        return config.data
    from plait.train.corpus import stdlib_files  # corpus imports numpy: only when asked

    root, chosen, total = Path(sysconfig.get_paths()["stdlib"]), [], 0
    for relative in stdlib_files():
        nbytes = (root / relative).stat().st_size
        if chosen and total + nbytes > config.data_max_bytes:
            break
        chosen.append(str(root / relative))
        total += nbytes
    return chosen


def model_description(config: TrainConfig, data) -> dict:
    """What fixes the model's parameters: compared with a checkpoint's."""
    if config.hf_source is not None:
        return hf_model.description(hf_model.load_config(config.hf_source), config.dtype)
    if config.model == "gpt":
        return {"kind": "gpt", **asdict(gpt_config(config, data.vocab_size))}
    return {"kind": "mlp", "sizes": [64, *config.mlp_hidden, 10], "dtype": config.dtype}


def gpt_config(config: TrainConfig, vocab: int):
    return GPTConfig(layers=config.layers, hidden=config.hidden, heads=config.heads, seq_len=config.seq_len,
                     vocab=vocab, ffn_hidden=config.ffn_hidden, dropout=config.dropout,
                     tied_head=config.tied_head, dtype=config.dtype)


def build_model(config: TrainConfig, data, tp_group=None):
    """(model at this rank's tp degree, its sequential layers, loss_fn)."""
    if config.hf_source is not None:
        return build_hf_model(config, data, tp_group)
    if config.model == "gpt":
        from plait.models.gpt import GPT
        from plait.parallel.pipeline.partition import sequential_layers
        from plait.parallel.tensor import TensorParallel, vocab_parallel_cross_entropy

        tp = TensorParallel(group=tp_group, algorithm=config.algorithm, sequence_parallel=config.sequence_parallel,
                            check_args=False)
        model = GPT(gpt_config(config, data.vocab_size), tp, seed=config.seed)
        vocab = data.vocab_size

        def loss_fn(logits, targets):  # (b, s, V'/tp), (b, s)
            return vocab_parallel_cross_entropy(logits, targets, tp, vocab).mean()

        # a tied head shares the embedding weight, so the model stays in one piece (pp=1 only: TrainConfig)
        layers = [model] if config.tied_head else sequential_layers(model)
        return model, layers, loss_fn

    torch.manual_seed(config.seed)
    model = MLP((64, *config.mlp_hidden, 10)).to(getattr(torch, config.dtype))
    children = list(model.net)
    layers = [nn.Sequential(*children[i:i + 2]) for i in range(0, len(children), 2)]  # Linear + ReLU pairs
    return model, layers, lambda logits, labels: F.cross_entropy(logits, labels)


def build_hf_model(config: TrainConfig, data, tp_group=None):
    """A Hugging Face causal LM (plait.train.hf_model) built on every rank alike, laid
    out by plait.train.hf_layout: tp-sharded by its plan, cut into the schedule's
    chunks at pp > 1 (then the layers are those chunks), its blocks recomputed."""
    model = hf_model.build(config.hf_source, dtype=config.dtype, seed=config.seed)
    hf_model.check_fits(model.config, config.hf_source, data_vocab=data.vocab_size, seq_len=config.seq_len,
                        what=f"tokenizer {data.tokenizer.source}" if config.tokenizer
                        else f"the characters of {data.source}")
    return model, hf_layout.layers(model, config, tp_group), hf_model.loss_fn


def make_optimizer(named_params, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (or SGD with momentum); weight decay on matrices only, not on biases,
    LayerNorm scales or position vectors (GPT-2 / Megatron practice)."""
    named = list(named_params)
    decay = [param for name, param in named if param.dim() >= 2]
    rest = [param for name, param in named if param.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]]
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))


def batch(config: TrainConfig, data, step: int, rank: int, world_size: int, *, evaluation: bool = False):
    """Global batch ``step`` (or validation batch ``step``), this dp rank's slice."""
    if config.hf_source is not None and config.tokenizer:  # plait.train.text_data.TextData: lm_batch's order
        if evaluation:
            return data.eval_batch(step, config.global_batch, config.seq_len, rank=rank, world_size=world_size)
        return data.batch(step, config.global_batch, config.seq_len, seed=config.seed, rank=rank,
                          world_size=world_size)
    if config.model == "gpt" or config.hf_source is not None:
        from plait.train.corpus import eval_batch, lm_batch

        if evaluation:
            return eval_batch(data.val, step, config.global_batch, config.seq_len, rank=rank, world_size=world_size)
        return lm_batch(data.train, step, config.global_batch, config.seq_len, seed=config.seed, rank=rank,
                        world_size=world_size)

    dataset = data[1] if evaluation else data[0]
    size = min(config.global_batch, len(dataset) // world_size * world_size)
    return rank_batch(dataset, step, size, rank, world_size, seed=config.seed)
