"""An HF causal LM laid out for plait's hybrid engine: tensor parallelism through a
ready plan (``plait.parallel.tensor.plans.plan_for``: HF GPT-2, Llama-style decoders),
pipeline parallelism through the automatic split (``plait.parallel.pipeline.split``),
and recomputation on its decoder blocks.

- pp = 1 (and no interleaving): ``parallelize(model, tp, plan_for(model))`` at tp > 1,
  then the whole model is the one layer (``CausalLMLogits``).
- pp > 1: the model (at tp > 1 already sharded by its plan, so the stages hold the
  sharded modules and the model names the same parameters: a tied embedding and
  head stay one parameter) is traced on one micro-batch of token ids
  (micro_batch, seq_len) and cut into pp · virtual stages balanced by FLOPs (or, with
  --stage-layers, at the decoder blocks that start each chunk: ``split_points``); each
  stage keeps the model's own modules under their original names, takes and returns
  the tuples of tensors crossing its boundaries (hidden states, position ids, masks,
  rotary cos/sin), and the last returns the logits. (Sharding each stage after the
  split instead would replace the leaf modules a stage holds directly, the embedding
  and the head, in the stage only: the model would name other parameters.)
- recompute: the first ``recompute_layers`` decoder blocks of each chunk (-1: all),
  as plait's GPT counts them.

The loss is the mean token cross-entropy of the whole logits (the plans gather the
head's output) against the shifted targets the data gives.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.names.schedules import CHIMERA, INTERLEAVED_1F1B
from plait.parallel.pipeline import split
from plait.parallel.tensor import TensorParallel, parallelize
from plait.parallel.mesh import ParallelDims
from plait.parallel.tensor.plan import ParallelPlan, check_module, match_plan
from plait.parallel.tensor.plans import plan_for
from plait.train import hf_model
from plait.train.budget import ELEMENT_BYTES, optimizer_states
from plait.train.config import TrainConfig
from plait.train.config_rules import example_split


def tensor_plan(model: nn.Module, config: TrainConfig) -> ParallelPlan:
    """The ready plan for ``model``'s class; a class none covers refused naming the covered ones."""
    try:
        return plan_for(model, sequence_parallel=config.sequence_parallel)
    except TypeError as error:
        raise ValueError(f"tp={config.tp} with model={config.model!r}: {error}; plait train applies the ready "
                         "plans only: use tp=1 (dp, ZeRO and pp take any causal LM)") from None


def chunk_count(config: TrainConfig) -> int:
    return config.pp * (config.virtual if config.schedule == INTERLEAVED_1F1B else 1)


def layers(model: nn.Module, config: TrainConfig, tp_group=None) -> list[nn.Module]:
    """The layers build_hybrid runs: the whole model, or at chunk_count > 1 the
    schedule's chunks themselves (build_hybrid(..., layers_are_chunks=True))."""
    recompute_layers = None if config.recompute_layers < 0 else config.recompute_layers
    chunks = chunk_count(config)
    if config.tp > 1:
        tp = TensorParallel(group=tp_group, algorithm=config.algorithm, sequence_parallel=config.sequence_parallel,
                            check_args=False)
        parallelize(model, tp, tensor_plan(model, config))
    decoder = hf_model.blocks(model)
    if chunks == 1:
        hf_model.set_recompute(decoder, config.recompute, recompute_layers)
        return [hf_model.CausalLMLogits(model)]
    # traced once on one micro-batch (at tp > 1 every tp rank traces alike, its collectives paired)
    example = torch.zeros(config.micro_batch, config.seq_len, dtype=torch.int64)
    if config.stage_layers:  # uneven stages: each chunk after the first starts at its first decoder block
        pieces = split(model, example, split_points=split_points(model, config), kwargs={"use_cache": False})
    else:
        pieces = split(model, example, stages=chunks, kwargs={"use_cache": False})
    if config.schedule == CHIMERA and pieces.shared:
        raise ValueError(f"schedule='chimera' with model={config.model!r}: its weights "
                         f"{', '.join(sorted(pieces.shared))} are shared by stages {sorted(pieces.shared.values())} "
                         "(a tied embedding and head), and Chimera's two replicas would hold both ends on one rank; "
                         "use another schedule (1f1b, zero_bubble, interleaved_1f1b) or an untied model")
    stages = pieces.modules
    for stage in stages:
        held = {id(module) for module in stage.modules()}
        hf_model.set_recompute([block for block in decoder if id(block) in held], config.recompute, recompute_layers)
    return list(stages)


def split_points(model: nn.Module, config: TrainConfig) -> list[str]:
    """--stage-layers as the automatic split's points: the qualified names of the decoder
    blocks that start chunks 1.. (the embedding and the glue before the first block run
    in chunk 0, the final norm and head in the last, as Megatron-LM places them)."""
    decoder = hf_model.blocks(model)
    check_stage_layers(config, len(decoder))
    name_of = {id(module): name for name, module in model.named_modules()}
    starts = [sum(config.stage_layers[:index]) for index in range(1, len(config.stage_layers))]
    return [name_of[id(decoder[start])] for start in starts]


def check_stage_layers(config: TrainConfig, blocks: int) -> None:
    """--stage-layers counts the model's decoder blocks: its sum must be ``blocks``."""
    given = ",".join(map(str, config.stage_layers))
    if config.stage_layers and sum(config.stage_layers) != blocks:
        fix = f"e.g. stage_layers={example_split(blocks, len(config.stage_layers))}" \
            if blocks >= len(config.stage_layers) else f"or fewer chunks (pp * virtual <= {blocks})"
        raise ValueError(f"stage_layers={given} sums to {sum(config.stage_layers)} decoder blocks but {config.model} "
                         f"has {blocks}: make the counts add up to {blocks}, {fix}")


# ----------------------------------------------------------------------------- before any process starts

def meta_model(config: TrainConfig) -> nn.Module:
    """The run's model built on the meta device (no memory, no weights): its classes,
    names and sizes, for the launcher's checks."""
    from transformers import AutoModelForCausalLM  # the optional hf extra: only for hf runs

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_model.load_config(config.hf_source))


def check_model(config: TrainConfig, data) -> None:
    """What the ranks would refuse, said before they start: the config read (a causal
    LM), the vocabulary covering the data's and the positions the sequence, and at
    tp > 1 a ready plan whose modules and adapter take this tp (the checks
    ``parallelize`` makes before it changes anything)."""
    model = meta_model(config)
    what = f"tokenizer {data.tokenizer.source}" if getattr(data, "tokenizer", None) is not None \
        else f"the characters of {data.source}"
    hf_model.check_fits(model.config, config.hf_source, data_vocab=data.vocab_size, seq_len=config.seq_len,
                        what=what)
    check_stage_layers(config, len(hf_model.blocks(model)))
    if config.tp > 1:
        plan = tensor_plan(model, config)
        matched = match_plan(model, plan.styles)
        for name, module, style in matched:
            check_module(name, module, style, config.tp, plan.sequence_parallel)
        if plan.adapter is not None:
            plan.adapter.check(model, {name: style for name, _, style in matched}, config.tp)


def checkpoint_bytes(config: TrainConfig) -> int:
    """Bytes of one checkpoint: every parameter once, with its optimizer state."""
    count = hf_model.parameter_count(hf_model.load_config(config.hf_source))
    return ELEMENT_BYTES[config.dtype] * count * (1 + optimizer_states(config))


def describe(config: TrainConfig, data) -> str:
    """What --dry-run prints for an hf model: the mesh, the model, how it is cut."""
    dims = ParallelDims(dp=config.dp, tp=config.tp, pp=config.pp, order=config.mesh_order)
    model = meta_model(config)
    count = sum(param.numel() for param in model.parameters())
    chunks = chunk_count(config)
    stages = {rank: "the whole model" if chunks == 1 else f"chunk(s) of the automatic split (pp rank {rank})"
              for rank in range(config.pp)}
    plan = tensor_plan(model, config) if config.tp > 1 else None
    lines = [dims.describe(stages, " of the plan's sharded modules" if plan is not None else ""), "",
             f"model     {config.model}: {type(model).__name__} ({model.config.model_type}), {count:,} parameters, "
             f"vocab {model.config.vocab_size}, {len(hf_model.blocks(model))} decoder blocks",
             f"tensor    " + (f"parallelize(model, tp={config.tp}, plan_for(model)): {plan.describe()}"
                              if plan is not None else "none (tp=1)"),
             f"pipeline  " + _pipeline_line(config, model, chunks),
             f"schedule  {config.schedule}, {config.microbatches} micro-batches of {config.micro_batch} per dp rank",
             f"batch     global {config.global_batch} = dp {config.dp} x per-rank {config.per_rank_batch} sequences "
             f"of {config.seq_len} tokens",
             f"data      {getattr(data, 'source', config.data)}",
             f"output    {config.out}"]
    return "\n".join(lines)


def _pipeline_line(config: TrainConfig, model: nn.Module, chunks: int) -> str:
    """How --dry-run says the hf model is cut into chunks."""
    if chunks == 1:
        return "none (one stage)"
    head = f"split(model, ids ({config.micro_batch}, {config.seq_len}), "
    if not config.stage_layers:
        return head + f"stages={chunks}) at launch, balanced by forward FLOPs (--stage-layers chooses)"
    points = split_points(model, config)
    return (head + f"split_points={points}): {','.join(map(str, config.stage_layers))} decoder blocks per chunk "
            "(--stage-layers; the embedding in the first, the final norm and head in the last)")
