"""Text from a trained character-level GPT: autoregressive sampling in one process."""

from __future__ import annotations

from pathlib import Path

import torch

from plait.models.gpt import GPT, GPTConfig
from plait.train import checkpoint as ckpt, checkpoint_load


@torch.no_grad()
def sample(model, corpus, prompt: str = "def ", *, chars: int = 200, temperature: float = 0.8,
           seed: int = 0) -> str:
    """``prompt`` followed by ``chars`` sampled characters. Each step feeds the last
    seq_len tokens and samples from softmax(logits / temperature) of the last
    position (temperature 0: the most likely character)."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 picks the most likely character)")
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = corpus.encode(prompt or "\n").tolist()
    window = model.config.seq_len
    for _ in range(chars):
        context = torch.tensor([ids[-window:]], dtype=torch.int64)
        logits = model.full_logits(context)[0, -1].double()
        logits[0] = float("-inf")  # never emit the unknown-character id
        if temperature == 0:
            ids.append(int(logits.argmax()))
        else:
            probabilities = torch.softmax(logits / temperature, dim=-1)
            ids.append(int(torch.multinomial(probabilities, 1, generator=generator)))
    return corpus.decode(ids)


def model_from_checkpoint(path):
    """A single-process GPT holding the unsharded weights of a checkpoint (a run
    directory's newest complete one, or a checkpoint directory)."""


    path = Path(path)
    if not (path / "manifest.json").exists():
        found = ckpt.latest_complete(path)
        if found is None:
            raise ValueError(f"no complete checkpoint under {path}")
        path = found
    manifest, state, _, _ = checkpoint_load.load_full(path)
    info = {key: value for key, value in manifest["model"].items() if key != "kind"}
    model = GPT(GPTConfig(**info))
    model.load_state_dict(state, strict=True)
    return model, manifest
