"""Ready tensor-parallel plans: Hugging Face GPT-2 and plait's own GPT, and
``plan_for(model)``, which picks one by the model's class.

Megatron's split of a transformer block, by name: the fused q|k|v projection and
the MLP's first matrix column-parallel, the attention output and the MLP's second
matrix row-parallel (two all-reduces forward, two backward per block), the token
embedding vocabulary-parallel, and under sequence parallelism the LayerNorms on the
sequence shard between an entry after the embedding and an exit before the head.

The adapter of each architecture is the one place that knows what its attention
module reads in ``forward`` (transformers 5.24's GPT2Attention splits its c_attn
output with ``split_size`` and infers the heads from ``head_dim``; it keeps
``num_heads`` and ``embed_dim`` for other code): after sharding those become
this rank's, 1/tp of each.
"""

from __future__ import annotations

from torch import nn

from plait.parallel.tensor.convert import ColwiseLinear
from plait.parallel.tensor.group import TensorParallel
from plait.parallel.tensor.layers import ParallelAttention, valid_tp_sizes
from plait.parallel.tensor.layout import REPLICATED
from plait.parallel.tensor.llama import is_llama_style, llama_plan
from plait.parallel.tensor.native import reshard_marked
from plait.parallel.tensor.plan import ParallelPlan
from plait.parallel.tensor.styles import (
    COLWISE,
    ColwiseParallel,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    VocabParallel,
)

GPT2_HEADED, GPT2_BARE = "GPT2LMHeadModel", "GPT2Model"


class GPT2Adapter:
    """HF GPT-2's attention after its c_attn (ColwiseParallel(fused=3)) and c_proj
    (RowwiseParallel) are sharded: ``split_size``, ``num_heads`` and ``embed_dim``
    become 1/tp of theirs (``head_dim`` stays). Refuses cross-attention (its c_attn is
    a fused k|v and q comes from q_attn) and a head count tp does not divide."""

    name = "gpt2"

    @staticmethod
    def attentions(model: nn.Module):
        return [(name, module) for name, module in model.named_modules() if type(module).__name__ == "GPT2Attention"]

    def check(self, model: nn.Module, sharded: dict, tp_size: int) -> None:
        for name, attention in self.attentions(model):
            qkv, out = sharded.get(f"{name}.c_attn"), sharded.get(f"{name}.c_proj")
            if qkv is None and out is None:
                continue  # left whole: nothing to localize
            if attention.is_cross_attention:
                raise ValueError(f"{name}: GPT-2 cross-attention (add_cross_attention=True) is not supported by the "
                                 f"GPT-2 plan: leave it out of the plan (Replicate)")
            if getattr(qkv, "kind", None) != COLWISE or qkv.fused != 3 or qkv.gather_output or out != RowwiseParallel():
                raise ValueError(f"{name}: GPT2Attention needs c_attn ColwiseParallel(fused=3) and c_proj "
                                 f"RowwiseParallel() together, got {qkv} and {out}")
            if attention.num_heads % tp_size:
                valid = ", ".join(map(str, valid_tp_sizes(heads=attention.num_heads)))
                raise ValueError(f"{name}: num_heads={attention.num_heads} is not divisible by tp={tp_size}; use tp "
                                 f"in {valid}")

    def localize(self, model: nn.Module, tp: TensorParallel) -> None:
        for _, attention in self.attentions(model):
            if isinstance(attention.c_attn, ColwiseLinear):
                attention.num_heads //= tp.size
                attention.split_size //= tp.size
                attention.embed_dim //= tp.size


def _gpt2_kind(config_or_model) -> tuple[str, object]:
    """(class name, config) of an HF GPT-2 model, or of the GPT2LMHeadModel a config builds."""
    name = type(config_or_model).__name__
    if name in (GPT2_HEADED, GPT2_BARE):
        return name, config_or_model.config
    if name == "GPT2Config":
        return GPT2_HEADED, config_or_model
    raise TypeError(f"gpt2_plan takes a GPT2LMHeadModel, a GPT2Model or a GPT2Config, got {name}")


def gpt2_plan(config_or_model, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> ParallelPlan:
    """Megatron's split of HF GPT-2 (GPT2LMHeadModel, tied or untied head, or the bare
    GPT2Model; a GPT2Config means GPT2LMHeadModel). The head returns the whole logits
    (gathered; HF's own loss is exact); ``loss_parallel=True`` leaves them split by
    vocabulary, (b, s, V'/tp) with zero columns past V, for
    ``vocab_parallel_cross_entropy(logits, labels, tp, vocab_size=V)``."""
    kind, config = _gpt2_kind(config_or_model)
    if getattr(config, "add_cross_attention", False):
        raise ValueError("gpt2_plan: add_cross_attention=True is not supported (its cross-attention's c_attn is a "
                         "fused k|v): build the model without it")
    prefix = "transformer." if kind == GPT2_HEADED else ""
    styles = {
        f"{prefix}wte": VocabParallel(),
        f"{prefix}wpe": Replicate(),
        f"{prefix}drop": SequenceParallel(entry=True),  # the sequence is split after the embeddings' sum
        f"{prefix}h.*.ln_1": SequenceParallel(),
        f"{prefix}h.*.attn.c_attn": ColwiseParallel(fused=3, head_dim=config.n_embd // config.n_head),
        f"{prefix}h.*.attn.c_proj": RowwiseParallel(),
        f"{prefix}h.*.ln_2": SequenceParallel(),
        f"{prefix}h.*.mlp.c_fc": ColwiseParallel(),
        f"{prefix}h.*.mlp.c_proj": RowwiseParallel(),
        f"{prefix}ln_f": SequenceParallel(exit=True),  # GPT2Model reshapes ln_f's output with the whole sequence
    }
    if kind == GPT2_HEADED:
        styles["lm_head"] = ColwiseParallel(gather_output=not loss_parallel, pad=True, input_layout=REPLICATED)
    return ParallelPlan(styles=styles, sequence_parallel=sequence_parallel, seq_dim=1, adapter=GPT2Adapter())


class PlaitGPTAdapter:
    """plait's GPT (plait.models.GPT) built unsharded: its blocks, attention and MLP
    take the group (``.tp``, which also turns on their own sequence-parallel code,
    gradient sums included), its attention keeps heads/tp, and an untied head (a
    marked parameter of the GPT itself) keeps its vocabulary slice."""

    name = "plait-gpt"

    def check(self, model: nn.Module, sharded: dict, tp_size: int) -> None:
        tp = getattr(model, "tp", None)
        if not isinstance(tp, TensorParallel) or not hasattr(model, "config"):
            raise TypeError(f"the plait GPT adapter takes a plait.models.GPT, got {type(model).__name__}")
        if tp.size != 1:
            raise ValueError(f"this GPT is already sharded ({tp.describe()}): parallelize a GPT built unsharded")
        model.config.check_tensor_parallel(tp_size)

    def claimed_parameters(self, model: nn.Module) -> set[str]:
        return {name for name, _ in model.named_parameters(remove_duplicate=False)}  # the GPT sums its own

    def localize(self, model: nn.Module, tp: TensorParallel) -> None:
        reshard_marked(model, tp, {}, "")
        for module in model.modules():
            if isinstance(getattr(module, "tp", None), TensorParallel):
                module.tp = tp
            if isinstance(module, ParallelAttention):
                module.local_heads = module.heads // tp.size


def plait_gpt_plan(config_or_model=None, *, sequence_parallel: bool = False) -> ParallelPlan:
    """plait's own GPT as a plan: built unsharded then parallelized it holds exactly
    the shards of ``GPT(config, tp)`` with the same weights, and runs the same code."""
    styles = {
        "embedding": VocabParallel(),
        "blocks.*.attention.qkv": ColwiseParallel(),  # laid out head by head: a contiguous split keeps whole heads
        "blocks.*.attention.proj": RowwiseParallel(),
        "blocks.*.mlp.fc1": ColwiseParallel(),
        "blocks.*.mlp.fc2": RowwiseParallel(),
    }
    return ParallelPlan(styles=styles, sequence_parallel=sequence_parallel, seq_dim=0, adapter=PlaitGPTAdapter())


def _plait_gpt(model: nn.Module) -> bool:
    return type(model).__name__ == "GPT" and type(getattr(model, "config", None)).__name__ == "GPTConfig"


def plan_for(model: nn.Module, *, sequence_parallel: bool = False) -> ParallelPlan:
    """The ready plan (with its adapter) for ``model``'s class, or a TypeError naming
    the classes that have one."""
    name = type(model).__name__
    if name in (GPT2_HEADED, GPT2_BARE):
        return gpt2_plan(model, sequence_parallel=sequence_parallel)
    if _plait_gpt(model):
        return plait_gpt_plan(model, sequence_parallel=sequence_parallel)
    if is_llama_style(model):
        return llama_plan(model, sequence_parallel=sequence_parallel)
    known = f"{GPT2_HEADED}, {GPT2_BARE}, plait's GPT, Llama/Mistral/Qwen2/Phi3 ForCausalLM and Model"
    raise TypeError(f"no ready tensor-parallel plan for {name} (plans exist for {known}): write one, e.g. "
                    f"parallelize(model, tp, {{'layers.*.fc1': ColwiseParallel(), 'layers.*.fc2': RowwiseParallel()}}, "
                    f"adapter=...) naming your modules")
