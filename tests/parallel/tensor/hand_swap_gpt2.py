"""Tensor parallelism of HF GPT-2 written by hand with plait's Megatron layers, as a
user had to before ``parallelize``: the honest count of what the plan replaces
(issue 34: "about 25 lines per model"). Tied head, no sequence parallelism, a
vocabulary tp divides; the state dict it leaves has plait's orientation, not HF's
(a further export step the plan does not need). The plan version is

    from plait.parallel.tensor import parallelize, plan_for
    parallelize(model, group, plan_for(model))

USER_LINES counts the code lines of ``hand_swap_gpt2`` below (imports included,
docstring, comments and blank lines not), read from this file's source."""

import inspect

import torch

from plait.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TensorParallel, VocabParallelEmbedding


def hand_swap_gpt2(model, group):
    tp = TensorParallel(group=group)
    p, r, h, vocab = tp.size, tp.rank, model.config.n_embd, model.config.vocab_size
    dtype = model.transformer.wte.weight.dtype

    def column(conv, index, bias=True):  # HF Conv1D (in, out) -> plait's (out/p, in), keeping output columns index
        layer = ColumnParallelLinear(conv.nx, conv.nf, tp, dtype=dtype, seed=None)
        with torch.no_grad():
            layer.weight.copy_(conv.weight[:, index].t())
            layer.bias.copy_(conv.bias[index])
        return layer

    def row(conv):  # HF Conv1D (in, out) -> plait's (out, in/p), keeping input rows r
        layer = RowParallelLinear(conv.nx, conv.nf, tp, dtype=dtype, seed=None)
        rows = conv.nx // p
        with torch.no_grad():
            layer.weight.copy_(conv.weight[r * rows:(r + 1) * rows].t())
            layer.bias.copy_(conv.bias)
        return layer

    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        heads = torch.arange(3 * h).view(3, p, h // p)[:, r].reshape(-1)  # this rank's heads' q, k and v columns
        attn.c_attn, attn.c_proj = column(attn.c_attn, heads), row(attn.c_proj)
        attn.num_heads, attn.split_size, attn.embed_dim = attn.num_heads // p, attn.split_size // p, attn.embed_dim // p
        ffn = mlp.c_fc.nf // p
        mlp.c_fc, mlp.c_proj = column(mlp.c_fc, torch.arange(r * ffn, (r + 1) * ffn)), row(mlp.c_proj)
    embedding = VocabParallelEmbedding(vocab, h, tp, dtype=dtype, seed=None)
    with torch.no_grad():
        embedding.weight.copy_(model.transformer.wte.weight[r * (vocab // p):(r + 1) * (vocab // p)])
    model.transformer.wte = embedding
    model.lm_head = ColumnParallelLinear(h, vocab, tp, bias=False, gather_output=True, dtype=dtype, seed=None)
    model.lm_head.weight = embedding.weight  # tied
    return model


def user_lines() -> int:
    """Code lines of hand_swap_gpt2 plus the import line it needs."""
    source = inspect.getsource(hand_swap_gpt2).splitlines()
    code = [line for line in source if line.strip() and not line.strip().startswith("#")]
    return len(code) + 1


PLAN_USER_LINES = 2  # the import and parallelize(model, group, plan_for(model))
