"""Llama-style decoders under tensor parallelism: ``llama_plan`` and its attention adapter.

A Llama-style decoder (Hugging Face's ``LlamaForCausalLM``: RMSNorm, SwiGLU MLP,
rotary embeddings, grouped-query attention; Mistral and Qwen2 read the same, Phi-3
with fused projections) is split as Megatron splits GPT:

    model.embed_tokens               vocabulary-parallel (rows of the (V, h) table)
    model.layers.*.self_attn.q_proj  column-parallel: rank r computes query heads
    model.layers.*.self_attn.k_proj    [r·H/p, (r+1)·H/p) and key/value heads
    model.layers.*.self_attn.v_proj    [r·KV/p, (r+1)·KV/p), the ones its queries use
    model.layers.*.self_attn.o_proj  row-parallel (one all-reduce, or reduce-scatter)
    model.layers.*.mlp.gate_proj     column-parallel (SiLU(gate)·up is elementwise,
    model.layers.*.mlp.up_proj         so each rank's ffn/p columns stay its own)
    model.layers.*.mlp.down_proj     row-parallel
    RMSNorms                         replicated, or on the sequence shard under SP
    lm_head                          column-parallel over the vocabulary, gathered for
                                     HF's loss (tied: the embedding's own slice)

Phi-3 fuses q|k|v into ``qkv_proj`` (parts H·d, KV·d, KV·d: ColwiseParallel(fused=
(H·d, KV·d, KV·d))) and gate|up into ``gate_up_proj`` (ColwiseParallel(fused=2)).

Grouped-query attention: query head i attends with key/value head i // g
(g = H/KV, ``num_key_value_groups``). Splitting q and k/v contiguously keeps every
query head with its key/value head exactly when tp divides KV (rank r's queries then
use kv heads [r·KV/p, (r+1)·KV/p), the ones it holds); any other tp is refused by
name (Megatron would replicate kv heads; plait does not).

Rotary embeddings have no parameters: LlamaModel makes the positions
(arange(s)), the causal mask and cos/sin from the embedding's output, which is the
whole replicated (b, s, h) in both modes. Under sequence parallelism the sequence
is split only at the first decoder layer's input (``SequenceParallel(entry=True)``
on ``model.layers.0``), after those were made; every q/k/v projection all-gathers
the whole sequence again, so attention runs on positions 0..s-1 with the whole
mask, as in one process. The residual stream stays on the shard through the layers;
the final norm gathers it back (``exit=True``) so ``last_hidden_state`` and HF's
``logits_to_keep`` see the whole sequence.

The adapter (``HeadsAdapter``): HF's attention (transformers 5.24) reshapes q/k/v as
``(..., -1, head_dim)``, so the local head counts follow from the sharded widths,
and ``num_key_value_groups`` = H/KV is the same on every rank (checked). Attention
that reads head counts in ``forward`` (Phi-3 reads ``config.num_attention_heads``
and ``self.num_key_value_heads`` to cut its fused qkv) gets them local: ``localize``
sets ``num_heads`` / ``num_key_value_heads`` where the module has them and gives each
attention module a read-through view of the config with the local
``num_attention_heads`` / ``num_key_value_heads`` (``LocalHeadsConfig``; every other
field, ``_attn_implementation`` included, is the model's config's, live; the model's
own config stays unsharded, so export and ``save_pretrained`` see the true sizes).
"""

from __future__ import annotations

from torch import nn

from plait.parallel.tensor.convert import ColwiseLinear
from plait.parallel.tensor.group import TensorParallel
from plait.parallel.tensor.layers import valid_tp_sizes
from plait.parallel.tensor.layout import REPLICATED
from plait.parallel.tensor.plan import ParallelPlan, name_matches
from plait.parallel.tensor.styles import ColwiseParallel, RowwiseParallel, SequenceParallel, VocabParallel

# model types whose modules and attention read as Llama's (checked in transformers 5.24's
# source): separate q/k/v/o projections reshaped as (..., -1, head_dim), gate/up/down MLP,
# RMSNorms over the hidden size; Phi-3 the same with fused qkv_proj and gate_up_proj
SEPARATE_QKV = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
FUSED_QKV = {"phi3": "Phi3"}
CLASS_PREFIXES = {**SEPARATE_QKV, **FUSED_QKV}


def head_counts(config) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim) of an HF config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def check_heads(config, tp_size: int, owner: str) -> None:
    """Refuse, by name, a tp that does not divide both head counts."""
    heads, kv_heads, _ = head_counts(config)
    if heads % tp_size or kv_heads % tp_size:
        valid = ", ".join(map(str, valid_tp_sizes(num_attention_heads=heads, num_key_value_heads=kv_heads)))
        raise ValueError(f"{owner}: tp={tp_size} does not divide num_key_value_heads={kv_heads} and "
                         f"num_attention_heads={heads}: each rank must hold whole key/value heads with the query "
                         f"heads that use them; use tp in {valid} (or a config with more key/value heads)")


class LocalHeadsConfig:
    """A read-through view of an HF config holding this rank's head counts: the
    fields given here are local, every other read is the model config's, live."""

    def __init__(self, base, **local):
        self.__dict__["_base"] = base
        self.__dict__.update(local)

    def __getattr__(self, name: str):
        base = self.__dict__.get("_base")
        if base is None:  # copy and pickle build the object without __init__ first
            raise AttributeError(name)
        return getattr(base, name)

    def __repr__(self) -> str:
        local = {key: value for key, value in self.__dict__.items() if key != "_base"}
        return f"LocalHeadsConfig({type(self._base).__name__}, {local})"


class HeadsAdapter:
    """What an HF Llama-style attention module must know after its projections are
    split by heads (see the module docstring). ``attention``: the plan-style pattern of
    the attention modules' names; ``projections``: their (query-side, output) children
    that must be column- and row-parallel together."""

    name = "llama"

    def __init__(self, attention: str = "model.layers.*.self_attn", *, fused: bool = False):
        self.attention = attention
        self.qkv = ("qkv_proj",) if fused else ("q_proj", "k_proj", "v_proj")

    def attentions(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(name, module) for name, module in model.named_modules() if name_matches(self.attention, name)]

    def check(self, model: nn.Module, sharded: dict, tp_size: int) -> None:
        config = model.config
        for name, _ in self.attentions(model):
            styles = [sharded.get(f"{name}.{child}") for child in (*self.qkv, "o_proj")]
            if all(style is None for style in styles):
                continue  # left whole: nothing to localize
            kinds = [getattr(style, "kind", None) for style in styles]
            if kinds != ["colwise"] * len(self.qkv) + ["rowwise"]:
                listed = ", ".join(f"{child}={style}" for child, style in zip((*self.qkv, "o_proj"), styles))
                raise ValueError(f"{name}: {type(model).__name__}'s attention needs {', '.join(self.qkv)} "
                                 f"ColwiseParallel and o_proj RowwiseParallel together, got {listed}")
            check_heads(config, tp_size, name)

    def localize(self, model: nn.Module, tp: TensorParallel) -> None:
        heads, kv_heads, head_dim = head_counts(model.config)
        local_heads, local_kv_heads = heads // tp.size, kv_heads // tp.size
        for name, attention in self.attentions(model):
            if not isinstance(getattr(attention, self.qkv[0]), ColwiseLinear):
                continue
            groups = getattr(attention, "num_key_value_groups", heads // kv_heads)
            # invariants of HF's attention that sharding whole kv groups keeps (internal)
            assert groups == local_heads // local_kv_heads, (name, groups, local_heads, local_kv_heads)
            assert getattr(attention, "head_dim", head_dim) == head_dim, (name, attention.head_dim, head_dim)
            if hasattr(attention, "num_heads"):
                attention.num_heads = local_heads
            if hasattr(attention, "num_key_value_heads"):
                attention.num_key_value_heads = local_kv_heads
            attention.config = LocalHeadsConfig(model.config, num_attention_heads=local_heads,
                                                num_key_value_heads=local_kv_heads, head_dim=head_dim)


def is_llama_style(model: nn.Module) -> bool:
    """Whether ``llama_plan`` takes ``model`` (a Llama, Mistral, Qwen2 or Phi-3
    ForCausalLM or bare Model of transformers)."""
    prefix = CLASS_PREFIXES.get(getattr(getattr(model, "config", None), "model_type", None))
    return prefix is not None and type(model).__name__ in (f"{prefix}ForCausalLM", f"{prefix}Model")


def _llama_kind(config_or_model) -> tuple[str, object]:
    """("causal-lm" or "bare", config) of a Llama-style model or of a config (a config
    means its ForCausalLM)."""
    config = getattr(config_or_model, "config", config_or_model)
    model_type = getattr(config, "model_type", None)
    if model_type not in CLASS_PREFIXES:
        raise TypeError(f"llama_plan takes a Llama-style HF model or config (model_type one of "
                        f"{', '.join(CLASS_PREFIXES)}), got {type(config_or_model).__name__} "
                        f"(model_type={model_type!r}); for other models write a plan naming their modules")
    if config_or_model is config:
        return "causal-lm", config
    name, prefix = type(config_or_model).__name__, CLASS_PREFIXES[model_type]
    if name == f"{prefix}ForCausalLM":
        return "causal-lm", config
    if name == f"{prefix}Model":
        return "bare", config
    raise TypeError(f"llama_plan takes {prefix}ForCausalLM, {prefix}Model or their config, got {name}")


def llama_plan(config_or_model, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> ParallelPlan:
    """Megatron's split of a Llama-style HF decoder (``LlamaForCausalLM`` tied or
    untied, the bare ``LlamaModel``, a ``LlamaConfig``; also Mistral, Qwen2 and Phi-3),
    with its ``HeadsAdapter``. The head returns the whole logits (gathered, so HF's
    own loss is exact); ``loss_parallel=True`` leaves them split by vocabulary,
    (b, s, V'/tp), for ``vocab_parallel_cross_entropy(logits, labels, tp, vocab_size=V)``."""
    kind, config = _llama_kind(config_or_model)
    fused = config.model_type in FUSED_QKV
    prefix = "model." if kind == "causal-lm" else ""
    layers = f"{prefix}layers.*"
    # under SP each block's norm runs on the sequence shard and gathers its output
    # (exit): HF's attention reshapes q/k/v by its own input's (b, s), so it must be given
    # the whole sequence, not gather it inside q_proj (the -1 head dim would absorb it)
    whole = ColwiseParallel(input_layout=REPLICATED)
    styles = {
        f"{prefix}embed_tokens": VocabParallel(),  # replicated out: the model makes positions and mask from it
        f"{prefix}layers.0": SequenceParallel(entry=True),  # the residual stream is split from here under SP
        f"{layers}.input_layernorm": SequenceParallel(exit=True),
    }
    if fused:
        heads, kv_heads, head_dim = head_counts(config)
        parts = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        styles[f"{layers}.self_attn.qkv_proj"] = ColwiseParallel(fused=parts, input_layout=REPLICATED)
    else:
        styles.update({f"{layers}.self_attn.{name}": whole for name in ("q_proj", "k_proj", "v_proj")})
    styles[f"{layers}.self_attn.o_proj"] = RowwiseParallel()  # reduce-scatter back to the shard under SP
    styles[f"{layers}.post_attention_layernorm"] = SequenceParallel(exit=True)
    if fused:
        styles[f"{layers}.mlp.gate_up_proj"] = ColwiseParallel(fused=2, input_layout=REPLICATED)
    else:
        styles.update({f"{layers}.mlp.{name}": whole for name in ("gate_proj", "up_proj")})
    styles[f"{layers}.mlp.down_proj"] = RowwiseParallel()
    styles[f"{prefix}norm"] = SequenceParallel(exit=True)
    if kind == "causal-lm":
        styles["lm_head"] = ColwiseParallel(gather_output=not loss_parallel, pad=True, input_layout=REPLICATED)
    return ParallelPlan(styles=styles, sequence_parallel=sequence_parallel, seq_dim=1,
                        adapter=HeadsAdapter(f"{layers}.self_attn", fused=fused))
