"""The tiny Hugging Face models the tests train (transformers is a test dependency,
installed under constraints.txt; every model is built from a config in code, nothing is
downloaded): 2 layers, width 32, float64, no dropout, the same weights on every rank for
one seed.

- ``tiny_gpt2``: GPT-2 (HF's Conv1D, fused c_attn), 4 heads, tied embeddings.
- ``tiny_llama``: a Llama-style decoder: RMSNorm, SwiGLU MLP (intermediate 64), rotary
  embeddings, grouped-query attention (4 query heads, 2 key/value heads), untied
  embeddings unless ``tie_word_embeddings=True``.
- ``tiny_phi3``: Phi-3 (the Llama layout with a fused ``qkv_proj`` of 8 query and 4
  key/value heads and a fused ``gate_up_proj``).
"""

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


def tiny_llama(seed: int = 0, vocab_size: int = 64, **config):
    """``LlamaForCausalLM`` as above: hidden 32, intermediate 64, 2 layers, 4 attention
    heads over 2 key/value heads (head_dim 8), up to 32 positions, HF's default attention
    (sdpa). ``config`` overrides LlamaConfig's fields, e.g. ``tie_word_embeddings=True``
    for the tied variant or ``num_key_value_heads=4`` for plain multi-head attention."""
    # imported where used: importing transformers takes seconds, and only the ranks need it
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, attention_dropout=0.0)
    return LlamaForCausalLM(LlamaConfig(**{**fields, **config})).double()


def tiny_phi3(seed: int = 0, vocab_size: int = 64, **config):
    """``Phi3ForCausalLM``: hidden 32, intermediate 64, 2 layers, 8 attention heads over
    4 key/value heads (head_dim 4) in one fused qkv_proj, a fused gate_up_proj, up to 32
    positions, untied. ``config`` overrides Phi3Config's fields."""
    # imported where used: importing transformers takes seconds, and only the ranks need it
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32, pad_token_id=0,
                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    return Phi3ForCausalLM(Phi3Config(**{**fields, **config})).double()
