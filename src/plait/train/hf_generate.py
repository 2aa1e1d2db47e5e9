"""Text from a trained ``--model hf:`` run: its newest checkpoint loaded into the HF
model in one process, and autoregressive sampling through the run's tokenizer (or
the char corpus's characters), for ``plait train``'s closing sample."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from plait.train import checkpoint as ckpt, checkpoint_load, hf_model


def model_from_checkpoint(path) -> tuple[nn.Module, dict]:
    """(the HF model holding a checkpoint's unsharded weights, its manifest): ``path``
    a run directory (its newest complete checkpoint) or a checkpoint directory; the
    model is built from the checkpoint's config.json (checked against the manifest)."""
    from transformers import AutoModelForCausalLM  # the optional hf extra: only for hf runs

    path = Path(path)
    if not (path / ckpt.MANIFEST_NAME).exists():
        found = ckpt.latest_complete(path)
        if found is None:
            raise ValueError(f"no complete checkpoint under {path}")
        path = found
    manifest, state, _, _ = checkpoint_load.load_full(path)
    config = hf_model.load_config(str(path))
    described = hf_model.description(config, manifest["model"].get("dtype", "float32"))
    checkpoint_load.check_compatible(manifest, described, what=f"{path / hf_model.CONFIG_NAME} against checkpoint")
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, described["dtype"]))
    params = dict(model.named_parameters())
    if set(params) != set(state):
        raise ValueError(f"checkpoint {path} holds {sorted(set(state) - set(params))[:3]} the model of its "
                         f"config.json lacks, or lacks {sorted(set(params) - set(state))[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])
    return model.eval(), manifest


@torch.no_grad()
def sample(model: nn.Module, data, prompt: str, *, chars: int = 200, temperature: float = 0.8, seed: int = 0,
           seq_len: int = 64) -> str:
    """``prompt`` and what follows it: tokens sampled from softmax(logits / temperature)
    of the last position (temperature 0: the most likely), each step on the last
    ``seq_len`` tokens, until ``chars`` characters follow the prompt (at most ``chars``
    tokens)."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 picks the most likely token)")
    generator = torch.Generator().manual_seed(seed)
    ids = data.encode(prompt or "\n").tolist()
    start = len(data.decode(ids))
    for _ in range(chars):
        context = torch.tensor([ids[-seq_len:]], dtype=torch.int64)
        logits = model(input_ids=context, use_cache=False).logits[0, -1].double()
        logits = logits[:data.vocab_size]  # ids past the tokenizer's (a larger model vocabulary) never decode
        if getattr(data, "tokenizer", None) is None:
            logits[0] = float("-inf")  # the char corpus's unknown-character id
        if temperature == 0:
            ids.append(int(logits.argmax()))
        else:
            ids.append(int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)))
        text = data.decode(ids)
        if len(text) - start >= chars:
            break
    return data.decode(ids)
