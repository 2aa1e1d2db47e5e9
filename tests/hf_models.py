"""The tiny Hugging Face GPT-2 the torch-idiom tests train (transformers is a test
dependency, installed under constraints.txt; the model is built from a config, nothing
is downloaded): 2 layers, width 32, 4 heads, float64, no dropout, the same weights on
every rank for one seed."""

import torch


def tiny_gpt2(seed: int = 0, vocab_size: int = 64, **config):
    """``GPT2LMHeadModel`` as above (``config`` overrides GPT2Config's fields, e.g.
    ``tie_word_embeddings=False``)."""
    # imported where used: importing transformers takes seconds, and only the ranks need it
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    fields = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab_size, n_positions=16, bos_token_id=0,
                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(GPT2Config(**{**fields, **config})).double()
